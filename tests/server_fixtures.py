"""Session fixtures of the serving part: the embedded default core that `make serve` uses.

`default_core` is var/cores/smollm2-135m-instruct.core, prepared like `make core` when
missing or older than the preparation sources (the Makefile's CORE_SOURCES rule: a core from
before a new program input would serve without it; about a minute on a CPU). Servers are
started per test module (tests/triton_server.py).
"""
from __future__ import annotations

import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_CORE = ROOT / "var" / "cores" / "smollm2-135m-instruct.core"
DEFAULT_ACCEPTANCE = "helios.local/smollm2"


def _core_sources() -> list[pathlib.Path]:
    """What `make core` re-prepares the default core for (Makefile CORE_SOURCES)."""
    return (list((ROOT / "ignition").rglob("*.py")) + list((ROOT / "helios_backend" / "kernels").glob("*.py"))
            + list((ROOT / "proto" / "helios_proto").glob("*.proto")))


def _stale(core: pathlib.Path) -> bool:
    return not core.exists() or any(p.stat().st_mtime > core.stat().st_mtime for p in _core_sources())


@pytest.fixture(scope="session")
def default_core() -> pathlib.Path:
    if _stale(DEFAULT_CORE):
        from ignition.cli import prepare_core

        DEFAULT_CORE.parent.mkdir(parents=True, exist_ok=True)
        prepare_core("smollm2-135m-instruct", DEFAULT_CORE)
    return DEFAULT_CORE
