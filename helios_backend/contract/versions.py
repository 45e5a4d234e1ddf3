"""What each semantic contract version (ModelContract.version) carries.

    version 1  vocabulary, input_vocabulary, cache, graphs (bindings, state accesses,
               pending tokens, resources, state rows), frontend text syntaxes
    version 2  + ModelContract.vision, GraphContract.tuned_bindings, image frontend
               (ImagePreparationSettings, non-NONE image selectors, IMAGE_* value sources)
    version 3  + GraphContract.speculative, GraphContract.cursor, OPERATION_SPECULATIVE,
               speculative prefix limits and copied-proposal value sources, logit-bias
               value sources (an additive extension: version-3 contracts without them load)

A field or enum value introduced in a later version that appears in an earlier-version
contract is an unknown identifier. Decoding an older version fills the later fields'
defaults (no vision, no tuned bindings, no speculative programs, draft cursor -1), so
cores exported for versions 1 and 2 keep loading (FMT-8).
"""
from __future__ import annotations

from helios_proto import contract_pb2 as c

SUPPORTED_VERSIONS = (1, 2, 3)
CURRENT_VERSION = 3   # what exporters write

# (message full name, field name) -> first version carrying it
FIELD_SINCE: dict[tuple[str, str], int] = {
    ("helios.v1.ModelContract", "vision"): 2,
    ("helios.v1.GraphContract", "tuned_bindings"): 2,
    ("helios.v1.FrontendContract", "image_preparation_settings"): 2,
    ("helios.v1.GraphContract", "speculative"): 3,
    ("helios.v1.GraphContract", "cursor"): 3,
}

# (enum full name, value number) -> first version carrying it
ENUM_VALUE_SINCE: dict[tuple[str, int], int] = {
    ("helios.v1.ImagePreparation", c.IMAGE_PREPARATION_RESIZE_NORMALIZE): 2,
    ("helios.v1.ImageLayout", c.IMAGE_LAYOUT_FIXED_SPAN): 2,
    ("helios.v1.ValueSource", c.VALUE_SOURCE_IMAGE_FEATURE_INDICES): 2,
    ("helios.v1.ValueSource", c.VALUE_SOURCE_IMAGE_CONTEXT_INDICES): 2,
    ("helios.v1.ValueSource", c.VALUE_SOURCE_IMAGE_FEATURE_SLOT): 2,
    ("helios.v1.ValueSource", c.VALUE_SOURCE_IMAGE_TENSOR): 2,
    ("helios.v1.Operation", c.OPERATION_SPECULATIVE): 3,
    ("helios.v1.ValueSource", c.VALUE_SOURCE_SPECULATIVE_PREFIX_LIMIT): 3,
    ("helios.v1.ValueSource", c.VALUE_SOURCE_PROPOSAL_IDS): 3,
    ("helios.v1.ValueSource", c.VALUE_SOURCE_PROPOSAL_COUNT): 3,
    ("helios.v1.ValueSource", c.VALUE_SOURCE_PROPOSAL_GENERATION): 3,
    ("helios.v1.ValueSource", c.VALUE_SOURCE_PROPOSAL_CONSUMED): 3,
    ("helios.v1.ValueSource", c.VALUE_SOURCE_PROPOSAL_GRAMMAR_MASKS): 3,
    ("helios.v1.ValueSource", c.VALUE_SOURCE_LOGIT_BIAS_IDS): 3,
    ("helios.v1.ValueSource", c.VALUE_SOURCE_LOGIT_BIAS_VALUES): 3,
}
