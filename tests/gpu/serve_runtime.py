"""Device script: the backend's serving loop (Engine: bootstrap, NativeModel.load with
the chosen executor, scheduler, worker, response hub) on a core written from the model bundle.

    python tests/gpu/serve_runtime.py [--executor cuda] [--requests 8] [--max-tokens 64]

The core is written here (signed with a fresh key, namespace = acceptance) from the bundle's
contract, manifest and resources, then served exactly as helios-serve would, without Triton.
Prints each reply's text and the aggregate generated tokens/s.
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "gpu"))

from model_bundle import load_bundle  # noqa: E402

NAMESPACE = "helios.local/device-check"
PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "What is 12 times 12?",
           "List three primary colors.", "def fibonacci(n):", "Explain photosynthesis in one sentence.",
           "Translate 'good morning' to Spanish.", "Name the largest planet."]


class Sender:
    def __init__(self) -> None:
        import threading
        self.arrays: list[dict] = []
        self.done = threading.Event()

    def send(self, arrays: dict, final: bool) -> None:
        self.arrays.append(arrays)
        if final:
            self.done.set()

    def is_cancelled(self) -> bool:
        return False


def write_core(path: pathlib.Path) -> None:
    from model_bundle import write_core as write_bundle_core

    contract, manifest, read = load_bundle()
    write_bundle_core(path, contract, manifest, read.__self__, NAMESPACE)   # read.__self__: id -> bytes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--executor", default="cuda")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--page-capacity", type=int, default=None)
    args = parser.parse_args()
    from tokenizers import Tokenizer

    from helios_backend.scheduler.request import RequestSpec, SamplingSettings
    from helios_backend.engine.responses import Stream
    from helios_backend.engine.engine import Engine
    from helios_backend.engine.settings import StartupOptions
    from helios_backend.exchange import OUT_TOKENS

    import dataclasses

    from helios_backend.engine.model import ModelOptions
    from helios_backend.engine import engine as runtime_module

    if "executor=" not in pathlib.Path(runtime_module.__file__).read_text():
        # Engine.start builds ModelOptions without StartupOptions.executor (reported to
        # the server part); until it passes it through, bind it here
        runtime_module.ModelOptions = dataclasses.make_dataclass(
            "ModelOptions", [("executor", str, dataclasses.field(default=args.executor))],
            bases=(ModelOptions,), frozen=True)
    path = pathlib.Path(tempfile.mkdtemp()) / "device.core"
    started = time.perf_counter()
    write_core(path)
    print(f"core written: {path.stat().st_size / 1e6:.0f} MB in {time.perf_counter() - started:.1f} s", flush=True)
    started = time.perf_counter()
    runtime = Engine.start(StartupOptions(path, NAMESPACE, executor=args.executor,
                                                 page_capacity=args.page_capacity))
    print(f"runtime ready in {time.perf_counter() - started:.1f} s: executor {type(runtime.model.executor).__name__}, "
          f"{runtime.model.manifests[0].cache_pages} cache pages", flush=True)
    tokenizer = Tokenizer.from_str(runtime.bootstrap.read_resource("tokenizer.json").decode())
    senders = []
    started = time.perf_counter()
    for serial in range(args.requests):
        prompt = tokenizer.encode(PROMPTS[serial % len(PROMPTS)]).ids
        sender = Sender()
        senders.append(sender)
        runtime.add_request(RequestSpec(tuple(prompt), args.max_tokens, SamplingSettings()), Stream(serial + 1, sender))
    for sender in senders:
        sender.done.wait(120)
    elapsed = time.perf_counter() - started
    total = 0
    for serial, sender in enumerate(senders):
        tokens = [t for a in sender.arrays if OUT_TOKENS in a for t in a[OUT_TOKENS].tolist()]
        total += len(tokens)
        text = tokenizer.decode(tokens).replace("\n", " ")[:100]
        print(f"[{serial}] {PROMPTS[serial % len(PROMPTS)]!r} -> {len(tokens)} tokens: {text!r}", flush=True)
    print(f"served {args.requests} requests, {total} tokens in {elapsed:.2f} s ({total / elapsed:.0f} tokens/s "
          f"incl. prefill and admission)", flush=True)
    runtime.stop(drain=True)


if __name__ == "__main__":
    main()
