"""The GPU architectures kernels are compiled for, and what each one allows.

    target = TARGETS["sm_86"]         # Target(name, capability, portable, pdl, shared_limit)
    default_archs()                   # DEFAULT_ARCHS the installed Triton can target

One table drives the choices that differ between architectures, so no kernel source, model
or runtime flag decides them:

* `pdl`: programmatic dependent launch (griddepcontrol, and the L2 weight prefetch issued
  before the wait) exists from sm_90 on; older targets compile the plain-launch path.
* `shared_limit`: the opt-in dynamic shared memory of one block on the smallest device of the
  target; a kernel compiled above it fails preparation instead of failing to launch.
* `portable`: a PTX image for the lowest capability, which the driver JIT-compiles at startup
  on any device at or above it. It is the PTX of the same compilation as that capability's
  cubin (Triton emits both), so it costs no extra compile.

Tile sizes (specs.py) are the same for every target: the programs' grids are recorded once
and serve every module of a core (docs/kernels.md, "Architectures").
"""
from __future__ import annotations

import dataclasses
import re
from typing import Iterable, Mapping, Sequence

KIB = 1024


@dataclasses.dataclass(frozen=True)
class Target:
    name: str                 # "sm_90a": a cubin for exactly 9.0; "compute_80": PTX for >= 8.0
    capability: int           # major * 10 + minor
    portable: bool            # PTX image, JIT-compiled by the driver at startup
    pdl: bool                 # programmatic dependent launch (sm_90 and later)
    shared_limit: int         # bytes of dynamic shared memory one block may opt in to
    min_cuda: tuple[int, int]  # oldest ptxas release that targets it


TARGETS: Mapping[str, Target] = {t.name: t for t in (
    Target("sm_80", 80, False, False, 163 * KIB, (11, 0)),      # A100, A30
    Target("sm_86", 86, False, False, 99 * KIB, (11, 1)),       # A10, A40, RTX 30xx
    Target("sm_89", 89, False, False, 99 * KIB, (11, 8)),       # L4, L40S, RTX 40xx
    Target("sm_90a", 90, False, True, 227 * KIB, (12, 0)),      # H100, H200
    Target("sm_100a", 100, False, True, 227 * KIB, (12, 8)),    # B200, GB200
    # the portable fallback runs on every device from 8.0, so it keeps under the smallest limit
    Target("compute_80", 80, True, False, 99 * KIB, (11, 0)),
)}
DEFAULT_ARCHS: tuple[str, ...] = ("sm_80", "sm_86", "sm_89", "sm_90a", "sm_100a", "compute_80")


class TargetError(ValueError):
    """An architecture name preparation does not know, or the installed Triton cannot target."""


def target(name: str) -> Target:
    try:
        return TARGETS[name]
    except KeyError:
        raise TargetError(f"unknown architecture {name!r}; known: {', '.join(TARGETS)}") from None


def compiled_target(portable: Target) -> Target:
    """The cubin target whose compilation also yields `portable`'s PTX (same capability)."""
    if not portable.portable:
        return portable
    return next(t for t in TARGETS.values() if not t.portable and t.capability == portable.capability)


def _ptxas_release(capability: int) -> tuple[int, int] | None:
    """(major, minor) of the ptxas Triton uses for `capability`, or None without one."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        found = re.search(r"(\d+)\.(\d+)", get_ptxas(capability).version or "")
    except Exception:          # no Triton, no NVIDIA backend, or no ptxas binary
        return None
    return (int(found.group(1)), int(found.group(2))) if found else None


def targetable(name: str) -> bool:
    """Can the installed Triton compile for `name` (its ptxas is recent enough)?"""
    wanted = target(name)
    release = _ptxas_release(compiled_target(wanted).capability)
    return release is not None and release >= wanted.min_cuda


def default_archs() -> tuple[str, ...]:
    """DEFAULT_ARCHS less the ones the installed Triton cannot target."""
    return tuple(name for name in DEFAULT_ARCHS if targetable(name))


def resolve(names: Iterable[str] | None) -> tuple[Target, ...]:
    """Targets of `names` (default: default_archs()), in table order, each once; TargetError
    for an unknown name or one the installed Triton cannot target."""
    chosen: Sequence[str] = tuple(names) if names else default_archs()
    for name in chosen:
        if not targetable(name):
            raise TargetError(f"the installed Triton cannot target {name} (its ptxas predates "
                              f"CUDA {'.'.join(map(str, target(name).min_cuda))})")
    if not chosen:
        raise TargetError("no architecture to compile for")
    return tuple(t for t in TARGETS.values() if t.name in set(chosen))
