"""The instruction set the CPU executor's kernels are compiled for: one path per process, chosen at load.

numba compiles for one LLVM target per process (a CPU name and a feature string), fixed when its
CPU code generator starts, i.e. at the first compilation. `activate()` chooses the path before
that: `HELIOS_CPU_ISA` (auto, avx512, avx2 or host; auto when unset) against the host's features,
and hands the target to numba (its NUMBA_CPU_NAME / NUMBA_CPU_FEATURES, set in the environment
as well, so numba's config reloads and the rank processes this one starts keep it). numba's disk
cache keys compiled code by that target, so each path keeps its own cached machine code.

The paths:
    avx512  AVX-512 F/BW/DQ/VL with FMA and F16C: 32 vector registers of 512 bits
    avx2    AVX2 with FMA and F16C, no other vector extension: 16 registers of 256 bits. On a wider
            host it is the host's own target with every AVX-512, AVX10, AMX, AVX-VNNI/IFMA, GFNI,
            VAES and VPCLMULQDQ feature switched off: the code an AVX2-only CPU (Zen 2/3,
            Haswell-Skylake) runs, on this core
    host    the host's target as numba picks it, where neither of the above can run (NEON on arm64,
            SSE on x86-64 without AVX2)
auto picks the widest the host can execute. The codegen modules read `vector_bits` at compile
time to shape their loops to the register file (block_codegen.py: accumulators per pass).

numba's disk cache also keys a function only by its own file's stamp (mtime and size), while the
kernels' machine code comes from several files of this package (block_products.py's loops are
built from block_codegen.py's IR): after an edit or an update of a codegen module alone, numba
would load the machine code of the code before. So `activate()` also points numba's cache at a
folder named by a digest of this package's sources and numba's version (`cache_folder`), under
NUMBA_CACHE_DIR when the user set one, else in the package's own __pycache__.
"""
from __future__ import annotations

import hashlib
import os
import pathlib
from dataclasses import dataclass
from typing import Mapping, Optional

ISA_VARIABLE = "HELIOS_CPU_ISA"
CACHE_VARIABLE = "NUMBA_CACHE_DIR"
_CACHE_PREFIX = "helios-numba-"
_PACKAGE = pathlib.Path(__file__).resolve().parent

# features a path needs (LLVM's names) and the vector width its loops are shaped for
_REQUIRED = {"avx512": ("avx512f", "avx512bw", "avx512dq", "avx512vl", "fma", "f16c"),
             "avx2": ("avx2", "fma", "f16c"),
             "host": ()}
_VECTOR_BITS = {"avx512": 512, "avx2": 256, "host": 128}
# the host's features worth recording beside a benchmark's figures (LLVM's names)
REPORTED_FEATURES = ("sse4.2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl",
                     "avx512vnni", "avx512bf16", "avx512fp16", "avxvnni", "neon", "fp16", "dotprod", "sve")
# features switched off for the avx2 path: every vector extension beyond AVX2 + FMA + F16C (Zen 2,
# Zen 3 and Haswell-Skylake laptops have none of them; LLVM used GFNI for the Q4_1 nibbles where on)
_BEYOND_AVX2 = ("avx512", "avx10", "amx", "avxvnni", "avxifma", "avxneconvert", "gfni", "vaes", "vpclmulqdq")


@dataclass(frozen=True)
class IsaPath:
    """A compilation target of the kernels: its name, the LLVM target numba compiles for, and the
    vector width the loops are shaped for."""

    name: str                  # avx512, avx2 or host
    vector_bits: int           # 512, 256; 128 for host (shaped as 256: see block_codegen)
    cpu_name: str              # LLVM CPU name (the host's: its scheduling model)
    features: str              # LLVM feature string numba compiles with

    def has(self, feature: str) -> bool:
        """Whether the target compiles with `feature` (an LLVM feature name) on."""
        return f"+{feature}" in self.features.split(",")


class IsaUnavailable(ValueError):
    """HELIOS_CPU_ISA names a path that is unknown or that this host cannot execute."""


def host_cpu() -> tuple[str, dict[str, bool]]:
    """The host's LLVM CPU name and its features (LLVM's names -> present)."""
    import llvmlite.binding as llvm  # type: ignore[import-untyped]

    return llvm.get_host_cpu_name(), {name: bool(on) for name, on in llvm.get_host_cpu_features().items()}


def executable_paths(features: Optional[Mapping[str, bool]] = None) -> tuple[str, ...]:
    """The paths this host can execute, widest first; `host` only where no other one can run (on
    an AVX2 or AVX-512 host it would be the same target as one of them, shaped differently, and
    numba's cache keys compiled code by the target alone)."""
    present = host_cpu()[1] if features is None else features
    paths = tuple(name for name, needs in _REQUIRED.items() if needs and all(present.get(f, False) for f in needs))
    return paths or ("host",)


def choose(requested: str, cpu_name: str, features: Mapping[str, bool]) -> IsaPath:
    """The path `requested` (auto: the widest executable) on a host with these features."""
    executable = executable_paths(features)
    name = executable[0] if requested == "auto" else requested
    if name not in _REQUIRED:
        raise IsaUnavailable(f"{ISA_VARIABLE}={requested!r}: expected one of auto, {', '.join(_REQUIRED)}")
    if name not in executable:
        missing = [f for f in _REQUIRED[name] if not features.get(f, False)]
        raise IsaUnavailable(f"{ISA_VARIABLE}={requested!r}: this CPU ({cpu_name}) lacks {', '.join(missing)}; "
                             f"it can execute {', '.join(executable)}")
    flags = [("-" if name == "avx2" and feature.startswith(_BEYOND_AVX2) else "+" if on else "-") + feature
             for feature, on in sorted(features.items())]
    return IsaPath(name, _VECTOR_BITS[name], cpu_name, ",".join(flags))


_active: Optional[IsaPath] = None
_cache_base: Optional[str] = None     # NUMBA_CACHE_DIR as the user set it (None: unset), read once


def sources_digest(package: pathlib.Path = _PACKAGE) -> str:
    """A digest of every Python source of the CPU executor's package and numba's version: what the
    cached machine code was compiled from."""
    import numba

    digest = hashlib.sha256(numba.__version__.encode())
    for source in sorted(package.glob("*.py")):
        digest.update(source.name.encode() + b"\0" + source.read_bytes())
    return digest.hexdigest()[:16]


def cache_folder(user_folder: Optional[str], package: pathlib.Path = _PACKAGE) -> str:
    """Where numba caches this package's compiled code: a folder per sources digest, under the
    user's NUMBA_CACHE_DIR when set, else under the package's __pycache__ (numba falls back to its
    user-wide folder where that is not writable)."""
    base = pathlib.Path(user_folder) if user_folder else package / "__pycache__"
    if base.name.startswith(_CACHE_PREFIX):      # a rank process inherits its parent's folder
        base = base.parent
    return str(base / f"{_CACHE_PREFIX}{sources_digest(package)}")


def active() -> IsaPath:
    """The path this process compiles for (activate() on first use)."""
    return _active if _active is not None else activate()


def activate(environment: Optional[Mapping[str, str]] = None) -> IsaPath:
    """Choose this process's path from HELIOS_CPU_ISA and hand its target to numba, before the first
    compilation; later calls return it. Raises IsaUnavailable for a path the host cannot run, and
    RuntimeError where numba already compiled for another target (nothing can switch it then)."""
    global _active, _cache_base
    if _active is not None:
        return _active
    from numba.core import config, registry

    env = os.environ if environment is None else environment
    if _cache_base is None:
        _cache_base = os.environ.get(CACHE_VARIABLE, "")
    folder = cache_folder(_cache_base or None)
    os.environ[CACHE_VARIABLE] = folder          # the rank processes this one starts keep it
    setattr(config, "CACHE_DIR", folder)          # numba reads it as each cached function is defined
    cpu_name, features = host_cpu()
    path = choose(env.get(ISA_VARIABLE, "auto").strip().lower() or "auto", cpu_name, features)
    if "_toplevel_target_context" in vars(registry.cpu_target):       # numba's code generator already started
        compiled_for = registry.cpu_target.target_context.codegen().magic_tuple()[2]
        if set(compiled_for.split(",")) != set(path.features.split(",")):
            raise RuntimeError(f"numba compiled for another target before the CPU executor chose {path.name}: "
                               f"import helios_backend.executors.cpu first")
    else:
        for variable, value in (("CPU_NAME", path.cpu_name), ("CPU_FEATURES", path.features)):
            os.environ[f"NUMBA_{variable}"] = value
            setattr(config, variable, value)          # numba's config: attributes read from the environment
    _active = path
    return path
