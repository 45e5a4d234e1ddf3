"""Startup options: parsed once from the Triton model config, resolved once against the core.

Precedence (SRV-15, SRV-16), in `layered` for every setting (NativeModel.load uses it too):
explicit startup option > the core's ServingDefaults > built-in default. An empty config
parameter means "not set".
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Mapping, TypeVar

from helios_proto import contract_pb2 as cp

from helios_backend.executors.factory import EXECUTOR_NAMES, RANK_PEERS, default_concurrency
from helios_backend.kernel_abi.activations import ACTIVATIONS
from helios_backend.ranks.rendezvous import parse_address
from helios_backend.scheduler.config import ADMISSION_BURST

DEFAULT_CORE = "var/cores/smollm2-135m-instruct.core"   # what `make serve` prepares
DEFAULT_ACCEPTANCE = "helios.local/smollm2"              # the embedded default's namespace
# The serving process runs three Python threads that share one GIL: the engine loop (which,
# with a round always in flight, seldom blocks), the response thread and Triton's execute()
# thread. A thread that wakes for the GIL waits until the holder blocks or the switch interval
# forces a handoff: CPython's 5 ms default puts up to 5 ms on every new request's execute() and
# every channel send. A quarter millisecond keeps those waits below a decode step.
SWITCH_INTERVAL_US = 250


class SettingsError(ValueError):
    """A startup option is malformed or cannot be honoured by the core; names the option."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(f"startup option {option}: {message}")
        self.option = option


@dataclass(frozen=True)
class StartupOptions:
    """Explicit options; None = not set (the core default or a built-in applies)."""
    core_path: Path
    acceptance: str = DEFAULT_ACCEPTANCE
    executor: str = "cpu"
    concurrency: int | None = None
    speculative_width: int | None = None
    history_drafting: bool | None = None
    # history drafting's cost of one verified row per lane, in DECODE steps (a fixed cost model:
    # reproducible width choices); None: measured per program while serving (speculative_width.py)
    speculative_row_cost: float | None = None
    queue_capacity: int | None = None
    max_active: int | None = None
    event_capacity: int | None = None
    page_capacity: int | None = None
    snapshot_capacity: int | None = None
    cache_memory_share: float | None = None
    kernel_arch: str | None = None      # cuda: KernelModule.arch to load (e.g. "compute_80"); None: the device's
    # cuda: serve the product path's ids through cuBLASLt where it loads (False: their cubins)
    vendor_products: bool = True
    # cpu and numpy executors: block-weight products' activations, "f32" or "q8" (8-bit blocks,
    # integer dot products: kernel_abi/activations.py, docs/cpu-executor.md); None: the executor's default
    activations: str | None = None
    # tensor-parallel ranks: "threads" (every rank in this process, OWN-14) or "processes" (rank 0
    # here, the others helios-rank processes that join the store at rank_store, OWN-15)
    rank_peers: str = "threads"
    rank_store: str | None = None       # processes: HOST:PORT rank 0 listens on
    rank_timeout: float | None = None   # processes: seconds a peer may take to answer (default 30)
    rank_join_timeout: float | None = None   # processes: seconds rank 0 waits for every peer (default 600)
    # the serving process's GIL switch interval (sys.setswitchinterval), microseconds; None: SWITCH_INTERVAL_US
    switch_interval_us: int | None = None
    # tokens a plain channel stream gathers before its output leaves, after its first
    # (responses.StreamInterval); None: automatic, growing with the open streams
    stream_interval: int | None = None
    # Triton: the core, the scheduler and the executor run in an engine process of their own,
    # outside the stub's GIL (process_engine.py); False keeps them in the stub. None: True
    engine_process: bool | None = None
    # waiting requests that make a round of prompts only; fewer are admitted one a round beside
    # the decode lanes (MIXED). None: BUILT_IN.admission_burst
    admission_burst: int | None = None
    # more model ids requests may name, after the core's served id and signed aliases (the config
    # parameter is a JSON list of strings; helios-serve --served-model-name)
    served_model_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.executor not in EXECUTOR_NAMES:
            raise SettingsError("executor", f"{self.executor!r} is not one of {EXECUTOR_NAMES}")
        for name in ("concurrency", "speculative_width", "queue_capacity", "max_active", "event_capacity",
                     "page_capacity", "switch_interval_us", "stream_interval"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise SettingsError(name, f"must be positive, got {value}")
        if self.snapshot_capacity is not None and self.snapshot_capacity < 0:
            raise SettingsError("snapshot_capacity", "cannot be negative")
        if self.admission_burst is not None and self.admission_burst < 2:
            raise SettingsError("admission_burst", f"must be at least 2 (a round of prompts takes several), "
                                                   f"got {self.admission_burst}")
        if self.activations is not None and self.activations not in ACTIVATIONS:
            raise SettingsError("activations", f"{self.activations!r} is not one of {ACTIVATIONS}")
        if self.rank_peers not in RANK_PEERS:
            raise SettingsError("rank_peers", f"{self.rank_peers!r} is not one of {RANK_PEERS}")
        if self.rank_peers == "processes":
            try:
                parse_address(self.rank_store or "")
            except ValueError:
                raise SettingsError("rank_store", f"{self.rank_store!r} is not HOST:PORT (rank_peers=processes "
                                                  "needs the address rank 0 listens on)") from None
        for name in ("rank_timeout", "rank_join_timeout"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise SettingsError(name, f"must be positive, got {value}")
        for index, name in enumerate(self.served_model_names):
            if not name.strip() or name != name.strip():
                raise SettingsError("served_model_names", f"[{index}] {name!r} is empty or has surrounding spaces")
        if self.speculative_row_cost is not None and self.speculative_row_cost < 0:
            raise SettingsError("speculative_row_cost", f"cannot be negative, got {self.speculative_row_cost}")
        if self.cache_memory_share is not None and not 0.0 < self.cache_memory_share <= 1.0:
            raise SettingsError("cache_memory_share", f"must lie in (0, 1], got {self.cache_memory_share}")

    @classmethod
    def from_parameters(cls, parameters: Mapping[str, str], project_root: Path) -> "StartupOptions":
        """From config.pbtxt `parameters` (string values); relative core paths are
        resolved against the project root (the model repository's parent)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(parameters) - known - {"EXECUTION_ENV_PATH"})
        if unknown:
            raise SettingsError(unknown[0], "unknown parameter")
        values: dict[str, object] = {}
        for f in dataclasses.fields(cls):
            raw = parameters.get(f.name, "").strip()
            if not raw:
                continue
            values[f.name] = _parse(f.name, raw)
        core = Path(str(values.pop("core_path", DEFAULT_CORE)))
        if not core.is_absolute():
            core = project_root / core
        return cls(core_path=core, **values)  # type: ignore[arg-type]


def _parse(name: str, raw: str) -> object:
    try:
        if name in ("core_path", "acceptance", "executor", "kernel_arch", "rank_peers", "rank_store", "activations"):
            return raw
        if name in ("history_drafting", "engine_process", "vendor_products"):
            if raw.lower() not in ("true", "false"):
                raise ValueError(raw)
            return raw.lower() == "true"
        if name in ("cache_memory_share", "rank_timeout", "rank_join_timeout", "speculative_row_cost"):
            return float(raw)
        if name == "served_model_names":
            names = json.loads(raw)
            if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                raise ValueError(raw)
            return tuple(names)
        return int(raw)
    except ValueError:
        raise SettingsError(name, f"cannot parse {raw!r}") from None


@dataclass(frozen=True)
class BuiltInDefaults:
    queue_capacity: int = 64
    event_capacity: int = 256
    frontend_workers: int = 2
    max_output_tokens: int = 256
    cache_memory_share: float = 0.9
    admission_burst: int = ADMISSION_BURST        # scheduler/config.py says why


BUILT_IN = BuiltInDefaults()


@dataclass(frozen=True)
class EffectiveSettings:
    queue_capacity: int
    max_active: int
    event_capacity: int
    frontend_workers: int
    max_output_tokens: int
    page_capacity: int | None            # None: NativeModel.load chooses (core default / prepared)
    snapshot_capacity: int
    cache_memory_share: float
    concurrency: int
    speculative_width: int
    history_drafting: bool
    admission_burst: int
    aliases: tuple[str, ...]    # every model id besides the served id: the core's, then the startup ones
    speculative_row_cost: float | None = None     # None: measured (StartupOptions says why)


T = TypeVar("T")
# the core's ServingDefaults that a setting may take
CoreDefault = Literal["queue_capacity", "max_active", "event_capacity", "cache_memory_share", "page_capacity",
                      "snapshot_capacity", "frontend_workers", "max_output_tokens"]
# the settings an option, the core's ServingDefaults and BUILT_IN all name the same way
_LayeredSetting = Literal["queue_capacity", "event_capacity", "cache_memory_share"]


def layered(explicit: T | None, defaults: cp.ServingDefaults, name: CoreDefault, built_in: T) -> T:
    """The precedence of every setting (SRV-15, SRV-16): the explicit option, else the core's
    ServingDefaults field `name`, else the built-in value."""
    if explicit is not None:
        return explicit
    if defaults.HasField(name):
        core_default: T = getattr(defaults, name)
        return core_default
    return built_in


def resolve(options: StartupOptions, contract: cp.ServingContract) -> EffectiveSettings:
    d = contract.defaults

    def pick(name: _LayeredSetting) -> int | float:
        built_in: int | float = getattr(BUILT_IN, name)
        return layered(getattr(options, name), d, name, built_in)

    # no option: the executor's default rows (every captured row on CUDA, at most 32 on the host)
    concurrency = (options.concurrency if options.concurrency is not None
                   else default_concurrency(options.executor, contract.concurrency))
    if not 1 <= concurrency <= contract.concurrency:
        raise SettingsError("concurrency", f"{concurrency} outside 1..{contract.concurrency} captured rows "
                                           "(load may only reduce it)")
    widths = sorted(contract.speculative_widths)
    width = options.speculative_width if options.speculative_width is not None else (widths[-1] if widths else 1)
    if width > 1 and width > (widths[-1] if widths else 1):
        raise SettingsError("speculative_width", f"{width} exceeds the captured widths {widths or [1]}")
    drafting = bool(options.history_drafting)
    if drafting:
        speculative = any(g.operation == cp.OPERATION_SPECULATIVE for g in contract.model.graphs)
        if not speculative or width <= 1:
            raise SettingsError("history_drafting", "requires enabled learned speculation (a SPECULATIVE "
                                                    "program and a speculative width above one)")
    page_capacity = layered(options.page_capacity, d, "page_capacity", None)
    # snapshot rows are continuation rows the core's state buffers hold: never more than prepared
    snapshots = min(layered(options.snapshot_capacity, d, "snapshot_capacity", contract.prepared_snapshots),
                    contract.prepared_snapshots)
    return EffectiveSettings(
        queue_capacity=int(pick("queue_capacity")),
        # built-in: every served row generates (the host executors' 32 rows, CUDA's captured ones)
        max_active=min(int(layered(options.max_active, d, "max_active", concurrency)), concurrency),
        event_capacity=int(pick("event_capacity")),
        frontend_workers=int(layered(None, d, "frontend_workers", BUILT_IN.frontend_workers)),
        max_output_tokens=int(layered(None, d, "max_output_tokens", BUILT_IN.max_output_tokens)),
        page_capacity=page_capacity,
        snapshot_capacity=int(snapshots),
        cache_memory_share=float(pick("cache_memory_share")),
        concurrency=concurrency, speculative_width=width, history_drafting=drafting,
        admission_burst=options.admission_burst or BUILT_IN.admission_burst,
        aliases=served_aliases(contract, options.served_model_names),
        speculative_row_cost=options.speculative_row_cost)


def served_aliases(contract: cp.ServingContract, startup_names: tuple[str, ...]) -> tuple[str, ...]:
    """The core's signed aliases, then the startup names not already served (in order, once each)."""
    aliases = list(contract.aliases)
    for name in startup_names:
        if name != contract.served_id and name not in aliases:
            aliases.append(name)
    return tuple(aliases)
