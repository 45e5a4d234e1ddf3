"""`helios-serve --model DIR`: a checkpoint folder prepared into the core cache on first use,
reused on the next start, served through the real gateway; the cache key follows the folder's
content; bad folders and option combinations exit non-zero naming the option or file."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

pytest.importorskip("safetensors")

from helios_backend.cli.serve import main as serve_main  # noqa: E402
from helios_backend.core import open_core  # noqa: E402
from ignition.core_cache import CoreCache, ModelFolderError  # noqa: E402
from ignition.progress import READING, RECORDING, WRITING  # noqa: E402
from ignition.recipes.hf_checkpoint import NAMESPACE  # noqa: E402
from tests.tiny_checkpoints import TinyShape, tiny_vocabulary, tiny_weights, write_tiny_hf_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    weights = tiny_weights(TinyShape(), len(tiny_vocabulary()[0]), seed=5, biases=False, tied=True)
    return write_tiny_hf_checkpoint(tmp_path_factory.mktemp("hf") / "tiny-llama", "llama", weights)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh publisher key and core cache for the test (the default locations read these)."""
    monkeypatch.setenv("HELIOS_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HELIOS_CORE_CACHE", str(tmp_path / "cores"))
    return tmp_path


def _identity(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_ino, stat.st_mtime_ns


# spec: FMT-21, FMT-23
def test_the_first_start_prepares_a_signed_core_and_the_second_reuses_it(folder: Path, home: Path) -> None:
    cache = CoreCache()
    assert cache.root == home / "cores"
    first = cache.find_or_prepare(folder, kernels=False, show_progress=False)
    assert first.prepared and not first.kernels and first.path.parent == home / "cores"
    assert first.namespace == NAMESPACE
    with open_core(first.path) as core:
        core.authorize(NAMESPACE)            # signed under the checkpoint namespace, by the local key
        core.verify_stored()
        from helios_backend.core import load_or_create_publisher_key
        from helios_backend.core.keys import public_key_bytes
        assert core.public_key == public_key_bytes(load_or_create_publisher_key())
    before = _identity(first.path)
    digests = home / "cores" / "weight-digests.json"
    remembered = _identity(digests)
    again = CoreCache().find_or_prepare(folder, kernels=False, show_progress=False)
    assert not again.prepared and again.path == first.path and again.key == first.key
    assert _identity(again.path) == before                  # not written again
    assert _identity(digests) == remembered                 # the weights were not hashed again


def test_the_key_follows_the_folders_content_not_its_timestamps(folder: Path, home: Path, tmp_path: Path) -> None:
    cache = CoreCache()
    key = cache.key(folder)
    copy = tmp_path / "copy" / folder.name
    shutil.copytree(folder, copy)                            # new inodes and mtimes, same bytes
    os.utime(copy / "model.safetensors", ns=(1, 1))
    assert cache.key(copy) == key
    config = json.loads((copy / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5
    (copy / "config.json").write_text(json.dumps(config))
    edited_config = cache.key(copy)
    assert edited_config != key
    weights = bytearray((copy / "model.safetensors").read_bytes())
    weights[-1] ^= 1                                         # one bit of one weight, same size
    (copy / "model.safetensors").write_bytes(bytes(weights))
    assert cache.key(copy) not in (key, edited_config)
    changed = cache.find_or_prepare(copy, kernels=False, show_progress=False)
    original = cache.find_or_prepare(folder, kernels=False, show_progress=False)
    assert changed.prepared and original.prepared and changed.path != original.path
    assert sorted(p.name for p in cache.root.glob("*.core")) == sorted([changed.path.name, original.path.name])


def test_a_core_with_kernels_serves_a_lookup_without_and_a_foreign_signature_is_not_reused(
        folder: Path, home: Path, tmp_path: Path) -> None:
    cache = CoreCache()
    plain = cache.find_or_prepare(folder, kernels=False, show_progress=False)
    assert cache.lookup(folder, plain.key, kernels=True) is None           # a GPU host needs kernels
    with_kernels = plain.path.with_name(plain.path.name.replace(".no-kernels.", ".kernels."))
    shutil.copy(plain.path, with_kernels)
    found = cache.lookup(folder, plain.key, kernels=False)
    assert found is not None and found.kernels and found.path == with_kernels
    # a core another publisher key signed, placed under this key's name, is not served as local
    other = CoreCache(root=tmp_path / "other", key_path=tmp_path / "other.pem")
    foreign = other.find_or_prepare(folder, kernels=False, show_progress=False)
    shutil.copy(foreign.path, with_kernels)
    plain.path.unlink()
    assert cache.lookup(folder, plain.key, kernels=False) is None
    assert cache.find_or_prepare(folder, kernels=False, show_progress=False).prepared


def test_preparation_reports_progress_for_every_phase(folder: Path, home: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import ignition.cli
    from ignition.progress import ProgressBars

    seen: dict[str, list[tuple[int, int]]] = {}

    class Recording(ProgressBars):
        def __call__(self, stage: str, done: int, total: int) -> None:
            seen.setdefault(stage, []).append((done, total))

    monkeypatch.setattr(ignition.cli, "ProgressBars", Recording)
    ignition.cli.prepare_core(str(folder), home / "tiny.core", kernels=False)
    for stage in (READING, RECORDING, WRITING):
        reports = seen[stage]
        assert reports[-1][0] == reports[-1][1] > 0, (stage, reports[-1])
        assert [done for done, _ in reports] == sorted(done for done, _ in reports), stage
    assert len(seen[RECORDING]) == seen[RECORDING][-1][1]      # one report per recorded program


@pytest.mark.slow
def test_kernel_compilation_runs_in_parallel_processes_and_reports_progress(tmp_path: Path) -> None:
    pytest.importorskip("triton")
    from ignition.gpu_kernels import compiler, targets
    from ignition.gpu_kernels.library import KernelLibrary

    library = KernelLibrary(cache_dir=tmp_path / "cubins", archs=["sm_90a"])
    target = targets.target("sm_90a")
    requests = [library._request(spec, target) for spec in library._specs()[:2]]
    reports: list[tuple[int, int]] = []
    compiled = compiler.compile_all(requests, library._cache, lambda done, total: reports.append((done, total)),
                                    workers=2)
    assert reports == [(0, 2), (1, 2), (2, 2)]
    assert [k.kernel_id for k in compiled] == [r.kernel_id for r in requests]
    cached: list[tuple[int, int]] = []
    again = compiler.compile_all(requests, library._cache, lambda done, total: cached.append((done, total)))
    assert cached == [(2, 2)] and [k.cubin for k in again] == [k.cubin for k in compiled]


def _serve(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    try:
        code = serve_main(argv)
    except SystemExit as exc:               # argparse's own usage errors
        code = int(exc.code or 0)
    return code, capsys.readouterr().err


def test_bad_folders_and_option_combinations_exit_non_zero_naming_the_option(
        folder: Path, home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _serve(["--model", str(tmp_path / "missing"), "--executor", "numpy"], capsys)
    assert code == 2 and "--model" in err and "no such directory" in err, err
    empty = tmp_path / "empty"
    empty.mkdir()
    code, err = _serve(["--model", str(empty), "--executor", "numpy"], capsys)
    assert code == 2 and "--model" in err and "config.json" in err, err
    (empty / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    (empty / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    code, err = _serve(["--model", str(empty), "--executor", "numpy"], capsys)
    assert code == 2 and "model_type 'mamba'" in err, err
    code, err = _serve(["--model", str(folder), "--core", str(tmp_path / "x.core")], capsys)
    assert code == 2 and "--core" in err and "not allowed with" in err, err
    code, err = _serve(["--executor", "numpy"], capsys)
    assert code == 2 and "--core" in err and "--model" in err, err
    code, err = _serve(["--core", str(tmp_path / "x.core"), "--no-kernels"], capsys)
    assert code == 2 and "--model only" in err, err
    with pytest.raises(ModelFolderError, match="config.json"):
        CoreCache().key(tmp_path)


@pytest.mark.triton
@pytest.mark.slow
def test_helios_serve_model_serves_a_chat_completion_and_reuses_the_core_on_restart(
        folder: Path, tmp_path: Path) -> None:
    import openai

    from tests.serve_process import ServeProcess

    env = {"HELIOS_HOME": str(tmp_path / "home"), "HELIOS_CORE_CACHE": str(tmp_path / "cores")}
    starts = []
    for _ in range(2):
        with ServeProcess(folder, tmp_path, "--executor", "numpy", "--max-active", "2", env=env,
                          source="--model") as serve:
            serve.wait_gateway_healthy(600)
            client = openai.OpenAI(base_url=serve.gateway_url + "/v1", api_key="unused", max_retries=0)
            [model] = client.models.list().data
            assert model.id == folder.name
            answer = client.chat.completions.create(model=model.id, max_tokens=4, temperature=0,
                                                    messages=[{"role": "user", "content": "Hi"}])
            assert answer.choices[0].finish_reason in ("length", "stop")
            assert answer.usage is not None and answer.usage.completion_tokens >= 1
            [core] = (tmp_path / "cores").glob("*.core")
            starts.append((serve.log(), _identity(core)))
    (first_log, first_core), (second_log, second_core) = starts
    assert "helios-serve: preparing" in first_log and "reusing the prepared core" not in first_log
    assert "reusing the prepared core" in second_log and "helios-serve: preparing" not in second_log
    assert second_core == first_core                       # the same file, not written again
