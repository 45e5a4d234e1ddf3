"""Everything serving derives from a core and the startup options, derived once.

    setup = derive_setup(contract, manifest, read_resource, options)
    setup.settings      # EffectiveSettings (explicit option > core default > built-in)
    setup.model         # NativeModel: the selected graphs, the executor, the packer
    setup.scheduler     # SchedulerConfig of that model

Engine.start, the benchmarks (bench/gpu_decode.py, bench/engine_decode.py) and the tests
all come through here, so the figures a benchmark prints are the server's: the same
graphs, the same executor options (including the staging extents that trim each step's
copy to the bytes its bindings write) and the same scheduler capacities.
"""
from __future__ import annotations

from dataclasses import dataclass

from helios_proto import contract_pb2 as cp
from helios_proto import manifest_pb2 as mp

from helios_backend.engine.model import ModelOptions, NativeModel
from helios_backend.engine.settings import EffectiveSettings, StartupOptions, resolve
from helios_backend.executors.base import ResourceReader
from helios_backend.scheduler.config import SchedulerConfig


@dataclass(frozen=True)
class EngineSetup:
    settings: EffectiveSettings
    model: NativeModel
    scheduler: SchedulerConfig


def model_options(settings: EffectiveSettings, executor: str, kernel_arch: str | None = None,
                  options: StartupOptions | None = None, core_digest: str = "") -> ModelOptions:
    """The model's options; `options` adds how tensor-parallel ranks meet (rank_peers)."""
    ranks: dict = {}
    if options is not None and options.rank_peers == "processes":
        defaults = ModelOptions()
        ranks = {"rank_peers": options.rank_peers, "rank_store": options.rank_store or "", "core_digest": core_digest,
                 "rank_timeout_s": options.rank_timeout or defaults.rank_timeout_s,
                 "rank_join_timeout_s": options.rank_join_timeout or defaults.rank_join_timeout_s}
    # SPECULATIVE variants serve only history drafting, the one drafter: with it off none is loaded
    # (on CUDA 18-20 captured graphs and their scratch fewer; speculation is a startup choice, SRV-11)
    return ModelOptions(concurrency=settings.concurrency, cache_pages=settings.page_capacity,
                        cache_memory_share=settings.cache_memory_share, executor=executor, kernel_arch=kernel_arch,
                        vendor_products=True if options is None else options.vendor_products,
                        activations=None if options is None else options.activations,
                        speculative=settings.history_drafting, **ranks)


def scheduler_config(contract: cp.ServingContract, manifest: mp.ExecutionManifest, model: NativeModel,
                     settings: EffectiveSettings, clock_origin_ns: int = 0) -> SchedulerConfig:
    vocab = contract.model.vocabulary
    decode = [g for g in model.graphs if g.operation == cp.OPERATION_DECODE]
    return SchedulerConfig(
        page_tokens=contract.model.cache.page_tokens, num_pages=model.manifests[0].cache_pages,
        request_slots=manifest.request_slots, max_active=settings.max_active,
        queue_capacity=settings.queue_capacity, context_tokens=contract.context_tokens,
        max_pages_per_row=manifest.max_pages_per_row, vocab_size=vocab.sampled_tokens,
        input_vocab_size=contract.model.input_vocabulary.input_tokens or vocab.sampled_tokens,
        eos_ids=tuple(contract.defaults.eos_token_ids), snapshot_capacity=settings.snapshot_capacity,
        cache_fingerprint=contract.cache_identity.fingerprint,
        top_logprobs_capacity=manifest.completion.top_logprobs,
        logprobs_recorded=any(f.name == "logprob" for f in manifest.completion.row),
        device_pending_token=bool(decode) and all(g.pending_token.HasField("device_state_view") for g in decode),
        clock_origin_ns=clock_origin_ns, admission_burst=settings.admission_burst)


def derive_setup(contract: cp.ServingContract, manifest: mp.ExecutionManifest, read_resource: ResourceReader,
                 options: StartupOptions, clock_origin_ns: int = 0, core_digest: str = "") -> EngineSetup:
    """Resolve the options against the core, load the model, size the scheduler (SettingsError
    names a bad option; ExecutorLoadError a core the executor cannot run). `core_digest`
    (Core.content_digest) is the identity rank processes must share."""
    settings = resolve(options, contract)
    model = NativeModel.load(contract, manifest, read_resource,
                             model_options(settings, options.executor, options.kernel_arch, options, core_digest))
    try:
        config = scheduler_config(contract, manifest, model, settings, clock_origin_ns)
    except BaseException:
        model.close()
        raise
    return EngineSetup(settings, model, config)
