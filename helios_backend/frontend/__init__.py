"""Frontend assets at serving time: tokenizer, chat template rendering, prompt encoding."""
