"""Session fixtures of the serving part: the embedded default core that `make serve` uses.

`default_core` is var/cores/smollm2-135m-instruct.core, prepared like `make core` when
missing (about a minute on a CPU). Servers are started per test module (tests/triton_server.py).
"""
from __future__ import annotations

import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_CORE = ROOT / "var" / "cores" / "smollm2-135m-instruct.core"
DEFAULT_ACCEPTANCE = "helios.local/smollm2"


@pytest.fixture(scope="session")
def default_core() -> pathlib.Path:
    if not DEFAULT_CORE.exists():
        from ignition.cli import prepare_core

        DEFAULT_CORE.parent.mkdir(parents=True, exist_ok=True)
        prepare_core("smollm2-135m-instruct", DEFAULT_CORE)
    return DEFAULT_CORE
