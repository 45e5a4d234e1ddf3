"""bench.served's table from stored runs: partial or per-prompt-length runs merge into one
served.jsonl (the device runs are cut by a call's limit; their checkpoints must still count)."""
from __future__ import annotations

import json
from pathlib import Path

import importlib.util

import pytest

from bench import served as served_module
from bench.served import gateway_runtime, merged_reports, prompt_words, write_table


def _served(tok_s: float) -> dict:
    keys = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "tpot_p50_ms", "gateway_cpu_us_per_token",
            "backend_cpu_us_per_token", "ok", "requests", "tokens_per_request_min", "tokens_per_request_max")
    return {"tok_s": tok_s, **{k: 1.0 for k in keys}, "stack": {}}


def test_runs_of_each_prompt_length_merge_into_one_table(tmp_path: Path) -> None:
    short, long_ = prompt_words(32), prompt_words(1024)
    first = {"levels": [1, 64], "prompt_tokens": [32], "output_tokens": 128,
             "engine": {"32:1": 2000.0, "32:64": 50000.0},
             "served": {f"{short}:1": _served(1800.0), f"{short}:64": _served(25000.0)},
             "llama_server": {f"{short}:64": {"tok_s": 2000.0}}}
    cut_short = {"levels": [1, 64], "prompt_tokens": [1024], "output_tokens": 128,   # no llama phase: cut
                 "device": "NVIDIA H100 80GB HBM3",      # the first run predates the device field
                 "engine": {"1024:1": 800.0}, "served": {f"{long_}:1": _served(700.0)}}
    paths = []
    for name, report in (("a", first), ("b", cut_short)):
        path = tmp_path / name / "served.json"
        path.parent.mkdir()
        path.write_text(json.dumps(report))
        paths.append(path)
    write_table(merged_reports(paths), tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "served.jsonl").read_text().splitlines()]
    assert [(r["prompt_tokens"], r["concurrency"]) for r in rows] == [(32, 1), (32, 64), (1024, 1)]
    by = {(r["prompt_tokens"], r["concurrency"]): r for r in rows}
    assert by[(32, 64)]["served_over_engine"] == 0.5 and by[(32, 64)]["served_over_llama_server"] == 12.5
    assert by[(32, 1)]["llama_server_tok_s"] is None and by[(1024, 1)]["engine_tok_s"] == 800.0
    # every row names the device the merged runs measured (a later run fills an earlier one's gap)
    assert {r["device"] for r in rows} == {"NVIDIA H100 80GB HBM3"}


def test_rows_carry_the_host_phases_the_clients_and_the_long_prompt_bound(tmp_path: Path) -> None:
    long_ = prompt_words(1024)
    stack = {"tokens_per_round": 100.0, "prompt_tokens_per_round": 1000.0, "host_work_ms_per_round": 0.3,
             "worker_ms_per_round": {"schedule": 0.05, "launch": 0.1, "collect": 0.9, "complete": 0.1,
                                     "deliver": 0.05}}
    served = _served(30000.0) | {"stack": stack, "client_cpu_max": 0.2, "client_processes": 4, "layout": "qwen2.5-0.5b"}
    report = {"levels": [128], "prompt_tokens": [1024], "output_tokens": 128, "device": "NVIDIA H200",
              "gateway_runtime": {"event_loop": "asyncio", "http_parser": "h11"},
              # engine: 100 tokens a round take 1 ms at 100k tokens/s; 1,000 prompt tokens at 2 us each, 2 ms more
              "engine": {"1024:128": 100_000.0, "prefill:1024": 2.0}, "served": {f"{long_}:128": served}}
    write_table(report, tmp_path)
    [row] = [json.loads(line) for line in (tmp_path / "served.jsonl").read_text().splitlines()]
    assert (row["device"], row["layout"], row["prompt_tokens"], row["concurrency"]) == ("NVIDIA H200", "qwen2.5-0.5b",
                                                                                       1024, 128)
    assert row["gateway_runtime"] == {"event_loop": "asyncio", "http_parser": "h11"}
    assert row["client_cpu_max"] == 0.2 and row["client_processes"] == 4 and row["ttft_p50_ms"] == 1.0
    assert row["host_ms_per_round"]["launch"] == 0.1 and row["host_work_ms_per_round"] == 0.3
    assert abs(row["prompt_bound_tok_s"] - 100 / 3e-3) < 1e-6           # 100 tokens per 3 ms
    assert abs(row["served_over_prompt_bound"] - 30000.0 / (100 / 3e-3)) < 1e-9


@pytest.mark.parametrize("installed, expected", [({"uvloop", "httptools"}, ("uvloop", "httptools")),
                                                 (set(), ("asyncio", "h11")), ({"httptools"}, ("asyncio", "httptools"))])
def test_the_gateway_runtime_is_what_uvicorn_would_pick_here(monkeypatch, installed, expected) -> None:
    """A device image without uvloop served the gateway on asyncio's loop: the rows say which ran."""
    real = importlib.util.find_spec
    monkeypatch.setattr(served_module.importlib.util, "find_spec",
                        lambda name: object() if name in installed else None
                        if name in ("uvloop", "httptools") else real(name))
    runtime = gateway_runtime()
    assert (runtime["event_loop"], runtime["http_parser"]) == expected
