"""Frontend syntaxes as data: tables of spellings driven by one streaming engine and one grammar builder.

- `tables`: the syntax presets (contract ToolSyntax / ReasoningSyntax messages) and their pairing.
- `validate`: contract cross-checks of the frontend selectors and syntax data.
- `markup`: delimiters as patterns (atomic tokens vs plain text), shared by engine and grammar.
- `events`: what the engine emits; `collect` folds events into a one-shot result.
- `engine`: the single streaming parser fed (token_id, text) pairs.
- `prompt_state`: the initial reasoning/frame state from the rendered prompt.
- `grammar`: one llguidance grammar per request built from the same syntax data.
"""
