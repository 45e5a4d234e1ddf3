"""Preparation pipeline: recipe -> (ServingContract, ExecutionManifest, resources).

    prepared = prepare(recipe_module, options, progress=bar.update)
    write_payload_core(path, contract=prepared.contract, manifest=prepared.manifest,
                       resources=prepared.resources, namespace=..., signing_key=...)

Steps: open the recipe's source; turn its tensors into fp16 weight buffers packed into
one weight resource per rank (256-byte aligned, WeightSource offsets); record one program per
(operation, capacity variant, rank) with the recipe's forward pass between the shared
prologue and epilogue; declare bindings, state accesses, cache and completion layout.
Runs without a GPU. Kernel modules are added when a kernel library is supplied: one per
(architecture, kernel set) for the library's architectures (ignition/gpu_kernels/targets.py).

Tensor parallelism (`options.tensor_parallel` = W ranks, default 1; tensor_parallel.py): the
recipe's divided dimensions are partitioned, each rank gets its own weight resource
"weights.rank{r}" (its shards plus the replicated tensors), its own buffers (same names, its
sizes) and its own copy of every program (same name, Program.rank = r) and graph contract.
The staging frame, completion layout, slot state and sampling are the same on every rank.
"""
from __future__ import annotations

import dataclasses

import hashlib
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
from helios_proto import contract_pb2 as C
from helios_proto import manifest_pb2 as M

from helios_backend.core import ResourceInput, ResourceKind
from helios_backend.kernel_abi import abi
from helios_backend.kernel_abi.blocks import BlockMatrix
from helios_backend.kernel_abi.sampling import LOGIT_BIAS_CAPACITY
from ignition.preparation import contract as shared
from ignition.preparation import tensor_parallel, vocabulary
from ignition.preparation.speculative import SpeculativePlan
from ignition.preparation.tensor_parallel import Partition
from ignition.progress import COMPILING, READING, RECORDING, SOURCE, Progress
from ignition.recorder import Geometry, Recorder, unit_geometry
from ignition.sources.packaged import PackagedFile
from ignition.sources.tokenizer import tokenizer_json_from_gguf

if TYPE_CHECKING:                   # the library imports Triton: only preparation with kernels loads it
    from ignition.gpu_kernels.library import KernelLibrary

EXECUTION_ABI = "helios-abi-1"
CONTRACT_VERSION = 3


def weights_resource(rank: int) -> str:
    return f"weights.rank{rank}"


WEIGHTS_RESOURCE = weights_resource(0)
TOKENIZER_RESOURCE = "tokenizer.json"
CHAT_TEMPLATE_RESOURCE = "chat_template.jinja"
WEIGHT_ALIGNMENT = 256



@dataclass
class PreparedModel:
    contract: C.ServingContract
    manifest: M.ExecutionManifest
    resources: list[ResourceInput]
    node_counts: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class CaptureVariant:
    operation: C.Operation.ValueType
    rows: int
    tokens: int

    @property
    def name(self) -> str:
        op = C.Operation.Name(self.operation).removeprefix("OPERATION_").lower()
        return f"{op}.r{self.rows}" if self.tokens == 0 else f"{op}.r{self.rows}.t{self.tokens}"


def variants(options: Any) -> list[CaptureVariant]:
    out = [CaptureVariant(C.OPERATION_INITIALIZATION, rows, 0) for rows in options.admission_rows]
    out += [CaptureVariant(C.OPERATION_PREFILL, rows, tokens) for rows, tokens in options.prefill_variants]
    out += [CaptureVariant(C.OPERATION_DECODE, rows, rows) for rows in options.decode_rows]
    out += [CaptureVariant(C.OPERATION_MIXED, rows, tokens) for rows, tokens in options.mixed_variants]
    # RESUME: decode-shaped steps whose pending token the host feeds (readmitted / restored requests)
    out += [CaptureVariant(C.OPERATION_RESUME, rows, rows) for rows in getattr(options, "resume_rows", ())]
    out += [CaptureVariant(C.OPERATION_SCORED_PREFILL, rows, tokens)
            for rows, tokens in getattr(options, "scored_prefill_variants", ())]
    if options.snapshot_rows:
        out += [CaptureVariant(C.OPERATION_RESTORATION, rows, 0) for rows in options.restoration_rows]
    return out


class KernelLibraryGeometry:
    """Launch geometry from the AOT kernel library for the ids it implements, else (1,1,1)."""

    def __init__(self, library: KernelLibrary | None) -> None:
        self._library = library
        self._ids = set(library.kernel_ids()) & set(abi.KERNELS) if library is not None else set()
        # ids some recorded launch needs widened tiles for -> the widest such launch's immediate
        self._widened: dict[str, int] = {}

    def __call__(self, kernel_id: str, args: Sequence[object]) -> Geometry:
        if self._library is not None and kernel_id in self._ids:
            width = self._library.widening_of(kernel_id, args)
            if width is not None:
                self._widened[kernel_id] = max(width, self._widened.get(kernel_id, 0))
            return self._library.geometry(kernel_id, args)
        return unit_geometry(kernel_id, args)

    def check_early_reads(self, programs: Sequence[M.Program]) -> None:
        """Refuse a recording where a kernel's reads before its PDL wait may race the node
        before it (KernelLibrary.early_read_conflicts): a recipe error, named, at preparation."""
        if self._library is None:
            return
        problems = [f"{program.name}: {problem}" for program in programs
                    for problem in self._library.early_read_conflicts(program.nodes)]
        if problems:
            raise ValueError("nodes read data the node before them may still be writing: "
                             + "; ".join(problems[:5]))

    def modules(self, progress: Progress | None = None) -> list[tuple[bytes, M.KernelModule]]:
        """One (image, module) per (architecture, kernel set) of the library's architectures;
        progress(COMPILING, done, total) as each compilation is done or found in the kernel cache."""
        if self._library is None or not self._ids:
            return []
        compiled = self._library.build_modules(
            widened=self._widened,
            progress=None if progress is None else lambda done, total: progress(COMPILING, done, total))
        return [(cubin, module) for cubin, module in compiled if all(k.id in self._ids for k in module.kernels)]


@dataclass
class RankWeights:
    """One rank's weight resource: its bytes, the WEIGHT buffers placed in it, its catalog views."""

    resource: str
    blob: bytearray = field(default_factory=bytearray)
    buffers: list[M.Buffer] = field(default_factory=list)
    views: list[C.TensorView] = field(default_factory=list)
    # False: lay the buffers out (offsets, shapes) but keep no bytes; the resource is then empty
    # and its loader makes the bytes (a layout without weights: ignition/sources/hf_layout.py)
    keep_bytes: bool = True
    nbytes: int = 0

    def append(self, name: str, array: np.ndarray | BlockMatrix, sources: Sequence[str]) -> None:
        offset = -(-self.nbytes // WEIGHT_ALIGNMENT) * WEIGHT_ALIGNMENT
        if self.keep_bytes:
            self.blob.extend(b"\0" * (offset - len(self.blob)))
        shape: tuple[int, ...]
        if isinstance(array, BlockMatrix):      # the source's blocks, verbatim (kernel_abi/blocks.py)
            data, dtype, shape = np.ascontiguousarray(array.data), C.DType.ValueType(array.dtype), array.shape
        else:   # a placeholder (keep_bytes off) is not copied: its shape and dtype are enough
            data = array if not self.keep_bytes else np.ascontiguousarray(array)
            dtype = {np.dtype(np.float16): C.DTYPE_F16, np.dtype(np.float32): C.DTYPE_F32,
                     np.dtype(np.int32): C.DTYPE_I32}[data.dtype]
            shape = data.shape
        declared = shared.buffer(name, M.BUFFER_KIND_WEIGHT, dtype, shape)
        declared.weight.CopyFrom(M.WeightSource(resource=self.resource, byte_offset=offset))
        self.buffers.append(declared)
        self.nbytes = offset + data.nbytes
        if self.keep_bytes:
            self.blob.extend(data.tobytes())
        for source in sources:
            self.views.append(C.TensorView(name=source, buffer=name, byte_offset=offset,
                                           shape=list(shape), dtype=dtype))


def pack_weights(recipe: ModuleType, source: Any, options: Any, partition: Partition,
                 progress: Progress | None = None) -> list[RankWeights]:
    """Every rank's weight resource, from one pass over the recipe's (dequantized) tensors."""
    total = recipe.weight_tensor_count(source.shape)
    keep = getattr(source, "weights_in_core", True)
    ranks = [RankWeights(weights_resource(rank), keep_bytes=keep) for rank in range(partition.degree)]
    for done, tensor in enumerate(recipe.weight_tensors(source, options), start=1):
        for rank, weights in enumerate(ranks):
            weights.append(tensor.buffer, partition.shard(tensor.array, getattr(tensor, "split", None), rank),
                           tensor.sources)
        if progress is not None:
            progress(READING, done, total)
    return ranks


def _record_programs(rec: Recorder, recipe: ModuleType, shape: Any, options: Any, cap: shared.TextCapacities,
                     transport: M.Transport, cache: shared.PagedKV, resource: str) -> list[C.GraphContract]:
    """Every variant's program on `rec`'s rank; `shape` is that rank's model shape."""
    graphs = []
    for variant in variants(options):
        capacity = C.Capacity(rows=variant.rows, tokens=variant.tokens)
        rec.begin(variant.name, variant.operation, capacity)
        if variant.operation == C.OPERATION_INITIALIZATION:
            shared.record_initialization(rec, transport, cap, variant.rows)
            bindings = shared.initialization_bindings()
        elif variant.operation == C.OPERATION_RESTORATION:
            shared.record_restoration(rec, transport, cap, cache, variant.rows)
            bindings = shared.restoration_bindings()
        else:
            io = shared.record_step_prologue(rec, transport, cap, variant.operation, variant.rows, variant.tokens)
            recipe.forward(rec.forward_view(), io, shape, cache, options)
            vocabulary.record_mask(rec, cap, io)
            if variant.operation == C.OPERATION_SCORED_PREFILL:
                shared.record_scoring(rec, transport, cap, io)
            snapshots = bool(cap.snapshot_rows) and variant.operation in shared.SNAPSHOT_OPERATIONS
            if snapshots:
                shared.record_snapshot(rec, transport, cap, cache, variant.rows)
            shared.record_sampling_epilogue(rec, transport, cap, variant.operation, variant.rows)
            bindings = shared.generation_bindings(variant.operation, snapshots, bool(cap.logit_bias_capacity))
        program = rec.end()
        graphs.append(shared.graph_contract(program, bindings, rec.buffers, [resource], cap.request_slots))
    return graphs


def _record_rank(rec: Recorder, recipe: ModuleType, shape: Any, options: Any, cap: shared.TextCapacities,
                 transport: M.Transport, speculative: SpeculativePlan | None, weights: RankWeights
                 ) -> list[C.GraphContract]:
    """One rank's buffers and programs: `shape` is the rank's model shape, `weights` its resource."""
    shared.declare_shared_buffers(rec, cap, transport)
    cache = recipe.paged_kv(shape, options)
    cache.declare(rec, cap.snapshot_rows)
    recipe.declare_scratch(rec, shape, cap.max_tokens, options)
    if speculative is not None:
        speculative.declare_buffers(rec, cap)
    for declared in weights.buffers:
        rec.declare(declared)
    graphs = _record_programs(rec, recipe, shape, options, cap, transport, cache, weights.resource)
    if speculative is not None:
        graphs += speculative.record_programs(rec, recipe, shape, options, cap, transport, cache, [weights.resource])
    return graphs


def prepare(recipe: ModuleType, options: Any, progress: Progress | None = None,
            kernel_library: KernelLibrary | None = None) -> PreparedModel:
    packaged = getattr(recipe, "SOURCE", None)
    if isinstance(packaged, PackagedFile) and not getattr(options, "gguf_path", None):
        # a packaged source is reassembled and hashed here with progress (1.1 GB: seconds); the
        # recipe's own open_source then finds it checked
        packaged.assemble(progress=None if progress is None else lambda done, total: progress(SOURCE, done, total))
    source = recipe.open_source(options)
    # the kernels' vocabulary widths are multiples of 16: a library's core pads its vocabulary
    if kernel_library is not None:
        source = vocabulary.with_kernel_geometry(source, vocabulary.VOCABULARY_MULTIPLE)
    shape = source.shape
    all_variants = variants(options)
    generation = [v for v in all_variants if v.tokens > 0]
    cap = shared.TextCapacities(
        vocab=shape.vocab, request_slots=max(v.rows for v in all_variants),
        max_tokens=max(v.tokens for v in generation),
        max_admission_rows=max(v.rows for v in all_variants if v.operation == C.OPERATION_INITIALIZATION),
        page_tokens=options.page_tokens, context_tokens=options.context_tokens, snapshot_rows=options.snapshot_rows,
        logprobs=True, top_logprobs=getattr(options, "top_logprobs", 0),
        scored_tokens=max((v.tokens for v in all_variants if v.operation == C.OPERATION_SCORED_PREFILL), default=0),
        logit_bias_capacity=getattr(options, "logit_bias_capacity", LOGIT_BIAS_CAPACITY),
        masked_tokens=shape.vocab - vocabulary.spelled_tokens(shape))
    degree = getattr(options, tensor_parallel.OPTION, 1)
    partition = tensor_parallel.plan_for(recipe, shape, degree)
    geometry = KernelLibraryGeometry(kernel_library)
    speculative = SpeculativePlan.from_options(options, cap)   # None when the options declare none
    if speculative is not None:   # the completion layout reserves its extension records
        cap = dataclasses.replace(cap, speculative_width=speculative.max_width)
    transport = shared.build_transport(cap)
    if speculative is not None:
        speculative.extend_transport(transport, cap)
    weights = pack_weights(recipe, source, options, partition, progress)
    if cap.masked_tokens:   # one (ids, -inf) row per logits row of the widest program
        ids, values = vocabulary.mask_tensors(max(cap.request_slots, speculative.max_packed if speculative else 0),
                                              vocabulary.spelled_tokens(shape), shape.vocab)
        for rank_weights in weights:
            rank_weights.append(vocabulary.MASK_IDS, ids, ())
            rank_weights.append(vocabulary.MASK_VALUES, values, ())
    recorders: list[Recorder] = []
    graphs: list[C.GraphContract] = []
    programs = degree * (len(all_variants) + (len(speculative.variants) if speculative is not None else 0))

    def recorded() -> None:
        if progress is not None:
            progress(RECORDING, sum(len(r.programs) for r in recorders), programs)

    for rank, rank_weights in enumerate(weights):
        rec = Recorder(rank=rank, geometry=geometry, world_size=degree, on_program=recorded)
        recorders.append(rec)
        graphs += _record_rank(rec, recipe, tensor_parallel.rank_shape(recipe, shape, partition, rank), options,
                               cap, transport, speculative, rank_weights)

    # a checkpoint that carries tokenizer.json gives it verbatim; a GGUF's fields are converted
    tokenizer_json = (source.tokenizer_json() if hasattr(source, "tokenizer_json")
                      else tokenizer_json_from_gguf(source)).encode()
    # a recipe may carry its own template (e.g. one that presents tools), else the source's
    chat_template = (recipe.chat_template(source) if hasattr(recipe, "chat_template")
                     else source.chat_template or "").encode()
    resources = [ResourceInput(w.resource, ResourceKind.RESOURCE_KIND_WEIGHTS, bytes(w.blob)) for w in weights]
    resources += [ResourceInput(TOKENIZER_RESOURCE, ResourceKind.RESOURCE_KIND_TOKENIZER, tokenizer_json),
                  ResourceInput(CHAT_TEMPLATE_RESOURCE, ResourceKind.RESOURCE_KIND_CHAT_TEMPLATE, chat_template)]

    manifest = M.ExecutionManifest(abi=EXECUTION_ABI, world_size=degree,
                                   buffers=[b for rec in recorders for b in rec.buffers.values()],
                                   programs=[p for rec in recorders for p in rec.programs], transport=transport,
                                   completion=shared.completion_layout(cap), request_slots=cap.request_slots,
                                   max_pages_per_row=cap.pages_per_row)
    geometry.check_early_reads(manifest.programs)
    for image, module in geometry.modules(progress):
        module.resource = f"{module.kernel_set}.{module.arch}"          # e.g. kernels.3.sm_90a
        manifest.modules.append(module)
        resources.append(ResourceInput(module.resource, ResourceKind.RESOURCE_KIND_KERNEL_MODULE, image))

    # the cache contract describes a whole logical page: every rank holds its KV heads' share
    cache_contract = recipe.paged_kv(shape, options).cache_contract(cap)
    fingerprint = hashlib.sha256()
    for part in ([hashlib.sha256(w.blob).digest() for w in weights]
                 + [tokenizer_json, cache_contract.SerializeToString(deterministic=True)]):
        fingerprint.update(part)
    frontend = recipe.frontend()
    frontend.tokenizer_resource = TOKENIZER_RESOURCE
    frontend.chat_template_resource = CHAT_TEMPLATE_RESOURCE
    model = C.ModelContract(
        version=CONTRACT_VERSION,
        vocabulary=C.Vocabulary(sampled_tokens=shape.vocab, histogram_bins=cap.histogram_bins,
                                mask_words=cap.mask_words),
        input_vocabulary=C.InputVocabulary(input_tokens=shape.vocab),
        cache=cache_contract, graphs=graphs, frontend=frontend)
    defaults = C.ServingDefaults(sampling=recipe.SAMPLING_DEFAULTS, eos_token_ids=list(recipe.EOS_TOKEN_IDS),
                                 max_output_tokens=options.max_output_tokens)
    rebuild = C.RebuildManifest(catalog_version=1, recipe=recipe.NAME,
                                sources=[C.SourceFile(name=path.name, nbytes=path.stat().st_size)
                                         for path in (source.source_files() if hasattr(source, "source_files")
                                                      else [source.path])],
                                weight_catalogs=[C.WeightCatalog(rank=rank, tensors=w.views)
                                                 for rank, w in enumerate(weights)])
    layout = f"{recipe.NAME}/fp16/page{options.page_tokens}" + (f"/tp{degree}" if degree > 1 else "")
    contract = C.ServingContract(
        served_id=recipe.SERVED_ID, aliases=list(recipe.ALIASES),
        cache_identity=C.CacheIdentity(label=layout, fingerprint=fingerprint.digest()),
        context_tokens=options.context_tokens, prefill_tokens=max(v.tokens for v in generation
                                                                  if v.operation == C.OPERATION_PREFILL),
        prepared_pages=options.prepared_pages, prepared_snapshots=options.snapshot_rows, concurrency=cap.request_slots,
        defaults=defaults, model=model, rebuild=rebuild,
        speculative_widths=speculative.widths if speculative is not None else [])
    return PreparedModel(contract=contract, manifest=manifest, resources=resources,
                         node_counts=dict(recorders[0].node_counts()))
