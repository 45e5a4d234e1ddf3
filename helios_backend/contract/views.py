"""Frozen, typed views of a decoded contract (built by PreparedContract.decode).

Enum-valued attributes hold the proto enum numbers (helios_proto.contract_pb2);
syntax and layout data the frontend consumes stay Protobuf messages (copies: do
not mutate them).
"""
from __future__ import annotations

import dataclasses
from typing import Literal

from helios_proto import contract_pb2 as c

# The ServingDefaults counts a core may leave unset (optional fields: HasField tells).
OptionalCount = Literal["queue_capacity", "max_active", "event_capacity", "frontend_workers", "max_output_tokens",
                        "page_capacity", "snapshot_capacity"]


@dataclasses.dataclass(frozen=True)
class Versions:
    contract: int            # ModelContract.version (1, 2 or 3)
    execution_abi: str       # ExecutionManifest.abi: a label, never gates loading (FMT-7)


@dataclasses.dataclass(frozen=True)
class Vocabulary:
    sampled_tokens: int      # sampled ids lie in [0, sampled_tokens)
    histogram_bins: int
    mask_words: int          # grammar mask width, 32-bit words
    input_tokens: int        # input ids lie in [0, input_tokens)
    image_sentinels: frozenset[int]   # valid inputs, never sampled

    def is_sampled(self, token: int) -> bool:
        return 0 <= token < self.sampled_tokens

    def is_input(self, token: int) -> bool:
        return 0 <= token < self.input_tokens


@dataclasses.dataclass(frozen=True)
class Vision:
    feature_slots: int
    features_per_window: int
    patches_per_feature: int
    patch_capacities: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class CachePlane:
    buffer: str
    bytes_per_page: int


@dataclasses.dataclass(frozen=True)
class HistoryRegion:
    name: str
    kind: int                # c.HistoryKind
    planes: tuple[CachePlane, ...]
    tokens_per_record: int   # paged kinds: compression ratio
    window_tokens: int       # sliding windows
    bytes_per_row: int       # recurrent / continuation


@dataclasses.dataclass(frozen=True)
class PageTableView:
    destination: str
    page_offset: int         # a shifted (draft) view references page index + offset
    pages_per_row: int


@dataclasses.dataclass(frozen=True)
class Cache:
    page_tokens: int         # logical tokens per page id
    regions: tuple[HistoryRegion, ...]
    page_table_views: tuple[PageTableView, ...]


@dataclasses.dataclass(frozen=True)
class Binding:
    destination: str
    source: int              # c.ValueSource
    index: int               # c.IndexMode
    offset: int
    padding: int
    constant: int
    image_output: str


@dataclasses.dataclass(frozen=True)
class StateView:
    name: str
    buffer: str
    byte_offset: int
    row_stride: int          # bytes between request rows
    byte_extent: int         # bytes per row


@dataclasses.dataclass(frozen=True)
class StateAccess:
    view: StateView
    access: int              # c.Access


@dataclasses.dataclass(frozen=True)
class TunedBinding:
    buffer: str
    producer: str            # a program of the manifest's tuning catalog


@dataclasses.dataclass(frozen=True)
class Speculative:
    batch_capacity: int        # B
    draft_tokens: int          # D
    token_capacity: int        # W
    packed_token_capacity: int # P
    confidence_width: int      # == D when confidence is produced, else 0
    confidence_buffer: str
    confidence_draft_capacity: int
    length_source: int         # c.VALUE_SOURCE_QUERY_LENGTH or ..._SPECULATIVE_PREFIX_LIMIT

    @property
    def lane_limit(self) -> int:
        """The most target tokens one lane may offer: min(D + 1, W) (SPEC-13)."""
        return min(self.draft_tokens + 1, self.token_capacity)

    def lane_limit_for(self, output_tokens_left: int, context_tokens_left: int) -> int:
        """A lane's target-token limit: min(D + 1, W, output left, context left) (SPEC-13/14)."""
        return max(0, min(self.lane_limit, output_tokens_left, context_tokens_left))

    @property
    def device_allocates(self) -> bool:
        """True when the captured program allocates prefixes (prefix-limit source)."""
        return self.length_source == c.VALUE_SOURCE_SPECULATIVE_PREFIX_LIMIT


@dataclasses.dataclass(frozen=True)
class Cursor:
    reports_draft_cursor: bool   # False: the completion's draft cursor reads -1
    lag_tokens: int
    state_view: str

    def expected_draft_cursor(self, consumed_tokens: int) -> int:
        """max(consumed - lag, 0), or -1 when the graph reports no draft cursor (CACHE-11/12)."""
        if not self.reports_draft_cursor:
            return -1
        return max(consumed_tokens - self.lag_tokens, 0)


NO_CURSOR = Cursor(False, 0, "")


@dataclasses.dataclass(frozen=True)
class PendingToken:
    device_state_view: str       # set when the device owns the pending token
    host_destination: str        # set when the host feeds it


@dataclasses.dataclass(frozen=True)
class Graph:
    program: str
    operation: c.Operation.ValueType
    rank: int
    rows: int                    # captured request rows
    tokens: int                  # packed query tokens
    bindings: tuple[Binding, ...]
    state_accesses: tuple[StateAccess, ...]
    resources: tuple[str, ...]
    tuned_bindings: tuple[TunedBinding, ...]
    speculative: Speculative | None
    state_rows_per_request: int
    pending_token: PendingToken | None
    cursor: Cursor
    rng_draws_per_row: int       # declared RNG reservation, kept whether or not allocation runs (SPEC-33)

    def sources(self) -> frozenset[int]:
        return frozenset(binding.source for binding in self.bindings)


@dataclasses.dataclass(frozen=True)
class Frontend:
    tool_parser: c.ToolParser.ValueType
    reasoning_parser: c.ReasoningParser.ValueType
    image_preparation: int       # c.ImagePreparation
    image_layout: int            # c.ImageLayout
    tool_syntax: c.ToolSyntax | None
    reasoning_syntax: c.ReasoningSyntax | None
    image_layout_data: c.ImageLayoutData | None
    image_preparation_settings: c.ImagePreparationSettings | None
    prefix_rules: tuple[c.PrefixBoundaryRule, ...]
    template_tokens: c.TemplateTokens
    tokenizer_resource: str
    chat_template_resource: str


@dataclasses.dataclass(frozen=True)
class Sampling:
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float


@dataclasses.dataclass(frozen=True)
class Defaults:
    """Core defaults: they fill what startup options / requests leave out (SRV-15..17)."""

    sampling: Sampling
    eos_token_ids: tuple[int, ...]
    queue_capacity: int | None
    max_active: int | None
    event_capacity: int | None
    frontend_workers: int | None
    max_output_tokens: int | None
    cache_memory_share: float | None
    page_capacity: int | None
    snapshot_capacity: int | None


@dataclasses.dataclass(frozen=True)
class CacheIdentity:
    label: str
    fingerprint: bytes


@dataclasses.dataclass(frozen=True)
class Extents:
    context_tokens: int
    prefill_tokens: int
    prepared_pages: int          # preparation's working set, replaced at load (SRV-10)
    prepared_snapshots: int
    concurrency: int             # captured rows; load may reduce it (SRV-7)
    speculative_widths: tuple[int, ...]
