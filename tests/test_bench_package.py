"""The bench package: `python -m bench` (`make bench`) picks a benchmark, builds its command and
sends results where asked (one tiny real run of the CPU benchmark through the entry point), the
device folders' naming rule, and the results index against the stored files."""
from __future__ import annotations

import argparse
import fnmatch
import json
import pathlib
import re
import subprocess
import sys

import pytest

from bench import __main__ as entry
from bench import harness

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _args(*argv: str) -> argparse.Namespace:
    return entry.parser().parse_args(list(argv))


@pytest.mark.parametrize(("device", "usable", "chosen"), [("auto", True, "gpu"), ("auto", False, "cpu"),
                                                          ("cpu", True, "cpu"), ("gpu", True, "gpu")])
def test_auto_picks_the_gpu_only_where_the_cuda_executor_can_run(device: str, usable: bool, chosen: str) -> None:
    assert entry.choose(device, lambda: usable) == chosen


def test_each_processor_runs_its_first_benchmark_on_the_core() -> None:
    args = _args("--core", "c.core", "--", "--rounds", "1")
    gpu = entry.command("gpu", args, peer=False)
    cpu = entry.command("cpu", args, peer=True)
    assert gpu[1:] == ["-m", "bench.gpu_decode", "--core", "c.core", "--rounds", "1"]
    assert cpu[1:] == ["-m", "bench.cpu_executor", "--core", "c.core", "--rounds", "1"]


def test_the_cpu_benchmark_runs_without_its_peer_where_llama_cpp_is_missing_or_refused() -> None:
    assert "--no-peer" in entry.command("cpu", _args(), peer=False)
    assert "--no-peer" in entry.command("cpu", _args("--no-peer"), peer=True)
    assert "--no-peer" not in entry.command("cpu", _args(), peer=True)


def test_results_stay_untracked_unless_asked() -> None:
    assert not {"--out", "--results"} & set(entry.command("cpu", _args(), peer=True))
    assert entry.command("gpu", _args("--results"), peer=False)[-1] == "--results"
    assert entry.command("gpu", _args("--out", "x"), peer=False)[-2:] == ["--out", "x"]


def test_bad_choices_name_the_flag(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    core = tmp_path / "c.core"
    cases = [(["--core", str(tmp_path / "missing.core")], "--core"),
             (["--core", "x", "--device", "gpu"], "--device gpu"),
             (["--core", "x", "--out", "o", "--results"], "--out and --results")]
    for argv, named in cases:
        with pytest.raises(SystemExit) as exit_:
            entry.main(argv + ["--dry-run"], usable=lambda: False, peer=lambda: False)
        assert exit_.value.code == 2 and named in capsys.readouterr().err
    core.write_bytes(b"")
    assert entry.main(["--core", str(core), "--dry-run"], usable=lambda: False, peer=lambda: False) == 0
    assert "bench.cpu_executor" in capsys.readouterr().out


def test_the_package_runs_as_a_module_and_lists_its_benchmarks(tmp_path: pathlib.Path) -> None:
    # as `make bench` runs it: a missing bench/__main__.py failed here at once
    core = tmp_path / "c.core"
    core.write_bytes(b"")
    done = subprocess.run([sys.executable, "-m", "bench", "--device", "cpu", "--core", str(core), "--dry-run"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"-m bench.cpu_executor --core {core}" in done.stdout
    listed = subprocess.run([sys.executable, "-m", "bench", "--list"], cwd=ROOT, capture_output=True, text=True,
                            timeout=120).stdout
    modules = {line.split()[2] for line in listed.splitlines()}
    assert {"bench.gpu_decode", "bench.cpu_executor", "bench.served", "bench.soak"} <= modules
    assert not {"bench.harness", "bench.sse", "bench.__main__"} & modules


@pytest.mark.parametrize(("name", "slug"), [("NVIDIA H100 80GB HBM3", "h100-80gb-hbm3"), ("NVIDIA H200", "h200"),
                                            ("AMD EPYC 7B13 64-Core Processor", "amd-epyc-7b13"),
                                            ("Intel(R) Xeon(R) CPU @ 2.20GHz", "intel-xeon"), ("AMD EPYC", "amd-epyc")])
def test_device_folders_are_named_from_the_device(name: str, slug: str) -> None:
    assert harness.device_slug(name) == slug


def test_output_folder_rule(tmp_path: pathlib.Path) -> None:
    assert harness.output_dir(tmp_path / "given", True, "cpu") == tmp_path / "given"
    assert (tmp_path / "given").is_dir()
    assert harness.folder_for(None, True, "gpu", "NVIDIA H200") == ROOT / "bench" / "results" / "h200"
    untracked = harness.folder_for(None, False, "cpu", "AMD EPYC")
    assert untracked == ROOT / "var" / "bench" / "amd-epyc"
    # var/ is ignored by git: the default never dirties the tree
    ignored = subprocess.run(["git", "check-ignore", "-q", str(untracked)], cwd=ROOT)
    assert ignored.returncode == 0


@pytest.mark.slow
def test_a_tiny_cpu_run_through_the_entry_point_writes_its_figures(smollm2_core: pathlib.Path,
                                                                    tmp_path: pathlib.Path) -> None:
    done = subprocess.run([sys.executable, "-m", "bench", "--device", "cpu", "--core", str(smollm2_core),
                           "--no-peer", "--out", str(tmp_path), "--", "--rounds", "1", "--repeats", "1",
                           "--threads", "1", "--prefill-tokens", "16", "--decode-prompt-tokens", "16",
                           "--new-tokens", "2", "--batches", "1", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    summary = json.loads((tmp_path / "cpu_ratios.json").read_text())
    [helios] = summary["helios"]
    assert helios["prefill_tokens"] == 16 and helios["prefill_tokens_per_s"] > 0
    assert sorted(helios["decode"]) == ["1", "2"] and all(d["tokens_per_s"] > 0 for d in helios["decode"].values())
    assert summary["llama_cpp"] == [] and summary["ratios"] == {}
    assert "no llama.cpp peer" in (tmp_path / "cpu_ratios.txt").read_text()


# ---- bench/results: every stored file backs a figure of the index, every index entry exists ----

def _expand(pattern: str) -> list[str]:
    match = re.search(r"\{([^{}]*)\}", pattern)
    if match is None:
        return [pattern]
    return [p for alt in match.group(1).split(",")
            for p in _expand(pattern[:match.start()] + alt + pattern[match.end():])]


def test_the_results_index_names_every_stored_file_and_nothing_missing() -> None:
    results = ROOT / "bench" / "results"
    index = (results / "README.md").read_text()
    patterns = [p for quoted in re.findall(r"`([^`]+)`", index) if "/" in quoted.rstrip("/") for p in _expand(quoted)]
    stored = {str(path.relative_to(results)) for path in results.rglob("*") if path.is_file()} - {"README.md"}
    assert patterns
    for pattern in patterns:
        assert fnmatch.filter(stored, pattern), f"the index names {pattern}, which matches no stored file"
    unindexed = {name for name in stored if not any(fnmatch.fnmatchcase(name, p) for p in patterns)}
    assert not unindexed, f"stored results no figure of the index uses: {sorted(unindexed)}"
    # every file in a device's folder, each folder a name the slug rule can give
    assert all("/" in name for name in stored)
    folders = {name.split("/")[0] for name in stored}
    assert {"h200", "h100-80gb-hbm3"} <= folders
    assert all(harness.device_slug(folder) == folder for folder in folders)


def test_a_figure_names_its_commit(monkeypatch: pytest.MonkeyPatch) -> None:
    # the device machine's copy has no git history: the caller names the commit there
    monkeypatch.setenv("HELIOS_COMMIT", "abc1234")
    assert harness.commit() == "abc1234"
    monkeypatch.delenv("HELIOS_COMMIT")
    named = harness.commit()
    assert named is not None and len(named.rstrip("+")) >= 7
