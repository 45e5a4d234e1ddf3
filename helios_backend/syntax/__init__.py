"""Frontend syntaxes as data: tables of spellings driven by one streaming engine and one grammar builder.

- `tables`: the syntax presets (contract ToolSyntax / ReasoningSyntax messages) and their pairing.
- `validate`: cross-checks of the selectors and the syntax data the engine relies on.
- `markup`: delimiters as patterns (atomic tokens vs plain text), shared by engine and grammar.
- `events`: what the engine emits; `collect` folds events into a one-shot result.
- `engine` (+ `phases`, `scanner`, `tool_phases`, `frame_phases`): the single streaming parser
  fed (token_id, text) pairs.
- `prompt_state`: the initial reasoning/frame state from the rendered prompt.
- `grammar` (+ `schema_check`): one llguidance grammar per request from the same syntax data.
- `request`: the per-request plan the gateway uses (state, grammar, one parser per choice).
"""
