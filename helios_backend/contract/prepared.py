"""PreparedContract: the decoded, validated, typed view of a ServingContract.

decode() runs, in order: the version gate, the schema walk (zero enums, unknown
identifiers, fields newer than the version), then every cross-check table against
the execution manifest. The first violation raises ContractError naming its field.
"""
from __future__ import annotations

import dataclasses
import types
from typing import Literal, Mapping

from helios_proto import contract_pb2 as c
from helios_proto import manifest_pb2

from . import checks_cache, checks_frontend, checks_graphs, checks_serving, checks_speculative
from . import views as v
from .catalog import build_context
from .errors import ContractError
from .schema_walk import walk
from .versions import ENUM_VALUE_SINCE, FIELD_SINCE, SUPPORTED_VERSIONS

CHECKS = (
    checks_serving.CHECKS
    + checks_graphs.CHECKS
    + checks_speculative.CHECKS
    + checks_cache.CHECKS
    + checks_frontend.CHECKS
)
# never walked or checked: preparation inputs only (SRV-18..20)
IGNORED_SUBTREES = ("rebuild",)


def _copy(message):
    out = type(message)()
    out.CopyFrom(message)
    return out


def _graph_view(graph: c.GraphContract) -> v.Graph:
    spec = None
    if graph.HasField("speculative"):
        s = graph.speculative
        spec = v.Speculative(
            s.batch_capacity, s.draft_tokens, s.token_capacity, s.packed_token_capacity,
            s.confidence_width, s.confidence_buffer, s.confidence_draft_capacity,
            checks_speculative.length_source(graph) or c.VALUE_SOURCE_UNSPECIFIED,
        )
    pending = None
    if graph.HasField("pending_token"):
        pending = v.PendingToken(graph.pending_token.device_state_view, graph.pending_token.host_destination)
    cursor = v.NO_CURSOR
    if graph.HasField("cursor"):
        cursor = v.Cursor(graph.cursor.reports_draft_cursor, graph.cursor.lag_tokens, graph.cursor.state_view)
    return v.Graph(
        program=graph.program,
        operation=graph.operation,
        rank=graph.rank,
        rows=graph.capacity.rows,
        tokens=graph.capacity.tokens,
        bindings=tuple(
            v.Binding(b.destination, b.source, b.index, b.offset, b.padding, b.constant, b.image_output)
            for b in graph.bindings
        ),
        state_accesses=tuple(
            v.StateAccess(
                v.StateView(a.view.name, a.view.buffer, a.view.byte_offset, a.view.row_stride, a.view.byte_extent),
                a.access,
            )
            for a in graph.state_accesses
        ),
        resources=tuple(graph.resources),
        tuned_bindings=tuple(v.TunedBinding(t.buffer, t.producer) for t in graph.tuned_bindings),
        speculative=spec,
        state_rows_per_request=graph.state_rows_per_request,
        pending_token=pending,
        cursor=cursor,
        rng_draws_per_row=graph.rng_draws_per_row,
    )


def _frontend_view(fe: c.FrontendContract) -> v.Frontend:
    def optional(name: Literal["tool_syntax", "reasoning_syntax", "image_layout_data", "image_preparation_settings"]):
        return _copy(getattr(fe, name)) if fe.HasField(name) else None

    return v.Frontend(
        tool_parser=fe.tool_parser,
        reasoning_parser=fe.reasoning_parser,
        image_preparation=fe.image_preparation,
        image_layout=fe.image_layout,
        tool_syntax=optional("tool_syntax"),
        reasoning_syntax=optional("reasoning_syntax"),
        image_layout_data=optional("image_layout_data"),
        image_preparation_settings=optional("image_preparation_settings"),
        prefix_rules=tuple(_copy(rule) for rule in fe.prefix_rules),
        template_tokens=_copy(fe.template_tokens),
        tokenizer_resource=fe.tokenizer_resource,
        chat_template_resource=fe.chat_template_resource,
    )


def _defaults_view(d: c.ServingDefaults) -> v.Defaults:
    s = d.sampling

    def optional(name: v.OptionalCount) -> int | None:
        return int(getattr(d, name)) if d.HasField(name) else None

    return v.Defaults(
        sampling=v.Sampling(
            s.temperature, s.top_p, s.top_k, s.min_p, s.presence_penalty, s.frequency_penalty, s.repetition_penalty
        ),
        eos_token_ids=tuple(d.eos_token_ids),
        queue_capacity=optional("queue_capacity"),
        max_active=optional("max_active"),
        event_capacity=optional("event_capacity"),
        frontend_workers=optional("frontend_workers"),
        max_output_tokens=optional("max_output_tokens"),
        cache_memory_share=d.cache_memory_share if d.HasField("cache_memory_share") else None,
        page_capacity=optional("page_capacity"),
        snapshot_capacity=optional("snapshot_capacity"),
    )


def _cache_view(cache: c.CacheContract) -> v.Cache:
    return v.Cache(
        page_tokens=cache.page_tokens,
        regions=tuple(
            v.HistoryRegion(
                r.name, r.kind, tuple(v.CachePlane(p.buffer, p.bytes_per_page) for p in r.planes),
                r.tokens_per_record, r.window_tokens, r.bytes_per_row,
            )
            for r in cache.regions
        ),
        page_table_views=tuple(
            v.PageTableView(p.destination, p.page_offset, p.pages_per_row) for p in cache.page_table_views
        ),
    )


@dataclasses.dataclass(frozen=True)
class PreparedContract:
    """A validated ServingContract, as the runtime and gateway consume it.

    Attributes: served_id, aliases, versions (contract version, execution ABI label),
    cache_identity, extents (context/prefill extents, prepared pages and snapshots,
    concurrency, speculative widths), vocabulary, vision (None before version 2 or
    when absent), cache, graphs (all, in contract order), graphs_by_operation
    (Operation -> graphs sorted by (rank, rows, tokens)), frontend, defaults.
    """

    served_id: str
    aliases: tuple[str, ...]
    versions: v.Versions
    cache_identity: v.CacheIdentity
    extents: v.Extents
    vocabulary: v.Vocabulary
    vision: v.Vision | None
    cache: v.Cache
    graphs: tuple[v.Graph, ...]
    graphs_by_operation: Mapping[int, tuple[v.Graph, ...]]
    frontend: v.Frontend
    defaults: v.Defaults

    @classmethod
    def decode(
        cls,
        contract: c.ServingContract,
        manifest: manifest_pb2.ExecutionManifest,
        *,
        resource_ids: frozenset[str] | set[str] | None = None,
    ) -> "PreparedContract":
        """Validate `contract` against `manifest` and return the typed view.

        Accepts ModelContract.version 1, 2 and 3. `resource_ids` (the core's resource
        ids), when given, is checked against graph and frontend resource references.
        Raises ContractError(field, reason) at the first violation.
        """
        version = contract.model.version
        if version not in SUPPORTED_VERSIONS:
            raise ContractError("model.version", f"unsupported contract version {version} (supported: {SUPPORTED_VERSIONS})")
        walk(contract, "", version=version, field_since=FIELD_SINCE, enum_since=ENUM_VALUE_SINCE, skip=IGNORED_SUBTREES)
        walk(manifest, "manifest")
        ids = frozenset(resource_ids) if resource_ids is not None else None
        ctx = build_context(contract, manifest, ids)
        for check in CHECKS:
            check(ctx)
        return cls._build(contract, manifest)

    @classmethod
    def _build(cls, contract: c.ServingContract, manifest: manifest_pb2.ExecutionManifest) -> "PreparedContract":
        model = contract.model
        graphs = tuple(_graph_view(g) for g in model.graphs)
        by_operation: dict[int, list[v.Graph]] = {}
        for graph in graphs:
            by_operation.setdefault(graph.operation, []).append(graph)
        vision = None
        if model.HasField("vision"):
            vi = model.vision
            vision = v.Vision(vi.feature_slots, vi.features_per_window, vi.patches_per_feature, tuple(vi.patch_capacities))
        return cls(
            served_id=contract.served_id,
            aliases=tuple(contract.aliases),
            versions=v.Versions(contract=model.version, execution_abi=manifest.abi),
            cache_identity=v.CacheIdentity(contract.cache_identity.label, bytes(contract.cache_identity.fingerprint)),
            extents=v.Extents(
                contract.context_tokens, contract.prefill_tokens, contract.prepared_pages,
                contract.prepared_snapshots, contract.concurrency, tuple(contract.speculative_widths),
            ),
            vocabulary=v.Vocabulary(
                model.vocabulary.sampled_tokens, model.vocabulary.histogram_bins, model.vocabulary.mask_words,
                model.input_vocabulary.input_tokens, frozenset(model.input_vocabulary.image_sentinels),
            ),
            vision=vision,
            cache=_cache_view(model.cache),
            graphs=graphs,
            graphs_by_operation=types.MappingProxyType(
                {op: tuple(sorted(gs, key=lambda g: (g.rank, g.rows, g.tokens))) for op, gs in by_operation.items()}
            ),
            frontend=_frontend_view(model.frontend),
            defaults=_defaults_view(contract.defaults),
        )

    # -- queries --------------------------------------------------------------
    @property
    def model_ids(self) -> tuple[str, ...]:
        """Every id a request may name: the served id, then the aliases."""
        return (self.served_id, *self.aliases)

    def graphs_for(self, operation: c.Operation.ValueType, rank: int = 0) -> tuple[v.Graph, ...]:
        """The captured variants of one operation on one rank, smallest capacity first."""
        return tuple(g for g in self.graphs_by_operation.get(operation, ()) if g.rank == rank)

    def select(self, operation: c.Operation.ValueType, rows: int, tokens: int = 0, rank: int = 0) -> v.Graph | None:
        """The smallest captured variant with at least `rows` rows and `tokens` packed
        tokens, or None (the request is outside the prepared capacities)."""
        fitting = [g for g in self.graphs_for(operation, rank) if g.rows >= rows and g.tokens >= tokens]
        return min(fitting, key=lambda g: (g.rows, g.tokens), default=None)

    def state_rows_per_request(self, selected: tuple[v.Graph, ...] | None = None) -> int:
        """The maximum state_rows_per_request among the selected graphs: what partitions the
        execution and snapshot rows (STA-10)."""
        chosen = self.graphs if selected is None else selected
        return max((g.state_rows_per_request for g in chosen), default=0)
