"""helios-generate: one chat reply from a core on the CPU (numpy executor).

    helios-generate var/cores/smollm2-135m-instruct.core --prompt "What is the capital of France?"

The prompt is rendered as one user message through the core's chat template and
encoded by the shared prompt path; generation is greedy unless --temperature is given
(then the core's sampling defaults fill top-p/top-k/min-p, explicit flags win).
--accept must equal the core's signed publisher namespace; without it the core's own
namespace is accepted and named on stderr (a local development convenience).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Callable, Optional

from helios_backend.engine.bootstrap import Bootstrap
from helios_backend.core import open_core
from helios_backend.frontend.prompt import encode_chat
from helios_backend.engine.model import ModelOptions, NativeModel
from helios_backend.sampling_parameters import SamplingParameters
from helios_backend.lockstep.generator import LockstepGenerator, GenerationRequest, GenerationResult


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="helios-generate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("core", help="the prepared core file")
    parser.add_argument("--prompt", required=True, help="the user message (required)")
    parser.add_argument("--max-tokens", type=int, default=None, help="output limit, in tokens (default: the core's)")
    parser.add_argument("--temperature", type=float, default=None, help="sampling temperature; 0 or absent: greedy (default: greedy)")
    parser.add_argument("--top-p", type=float, default=None,
                        help="nucleus sampling mass in (0, 1] (default: the core's sampling default)")
    parser.add_argument("--top-k", type=int, default=None,
                        help="sample among this many most likely tokens (default: the core's sampling default)")
    parser.add_argument("--min-p", type=float, default=None,
                        help="drop tokens below this share of the likeliest one's probability "
                             "(default: the core's sampling default)")
    parser.add_argument("--seed", type=int, default=0, help="64-bit seed of the counter-based RNG (default: %(default)s)")
    parser.add_argument("--accept", default=None, help="publisher namespace to accept (default: the core's own, named on stderr)")
    parser.add_argument("--cache-pages", type=int, default=None,
                        help="KV-cache pages to allocate, in pages of the core's page_tokens (default: the core's)")
    return parser


def sampling_from_args(args: argparse.Namespace, bootstrap: Bootstrap) -> SamplingParameters:
    """Greedy unless a temperature is given; then core defaults fill what the flags leave out."""
    if not args.temperature:
        return SamplingParameters()
    d = bootstrap.prepared.defaults.sampling
    defaults = SamplingParameters(temperature=d.temperature, top_p=d.top_p, top_k=d.top_k, min_p=d.min_p,
                                  presence_penalty=d.presence_penalty, frequency_penalty=d.frequency_penalty,
                                  repetition_penalty=d.repetition_penalty)
    explicit = {k: v for k, v in (("temperature", args.temperature), ("top_p", args.top_p),
                                  ("top_k", args.top_k), ("min_p", args.min_p)) if v is not None}
    return dataclasses.replace(defaults, **explicit)


def generate_reply(bootstrap: Bootstrap, model: NativeModel, prompt: str, max_tokens: int,
                   sampling: SamplingParameters, seed: int = 0,
                   on_text: Optional[Callable[[str], None]] = None) -> tuple[str, GenerationResult]:
    """The reply text (EOS ids dropped); `on_text` receives it piece by piece as tokens arrive."""
    ids = encode_chat(bootstrap.chat_template, bootstrap.tokenizer, [{"role": "user", "content": prompt}]).ids
    eos = set(bootstrap.eos_token_ids)
    decoder = bootstrap.tokenizer.incremental_decoder()
    pieces: list[str] = []

    def on_token(_: int, token: int) -> None:
        if token not in eos:
            pieces.append(decoder.feed_one(token))
            if on_text is not None and pieces[-1]:
                on_text(pieces[-1])

    [result] = LockstepGenerator(model, on_token=on_token).generate([GenerationRequest(ids, max_tokens, sampling, seed)])
    pieces.append(decoder.finish())
    if on_text is not None and pieces[-1]:
        on_text(pieces[-1])
    return "".join(pieces), result


def main(argv: Optional[list[str]] = None) -> int:
    args = _parser().parse_args(argv)
    acceptance = args.accept
    if acceptance is None:
        with open_core(args.core) as core:
            acceptance = core.namespace
        print(f"helios-generate: accepting publisher namespace {acceptance!r}", file=sys.stderr)
    bootstrap = Bootstrap.load(args.core, acceptance)
    try:
        model = NativeModel.load(bootstrap.contract, bootstrap.manifest, bootstrap.read_resource,
                                 ModelOptions(concurrency=1, cache_pages=args.cache_pages))
        max_tokens = args.max_tokens or bootstrap.prepared.defaults.max_output_tokens or 256
        generate_reply(bootstrap, model, args.prompt, max_tokens, sampling_from_args(args, bootstrap), args.seed,
                       on_text=lambda piece: print(piece, end="", flush=True))
        print()
        model.close()
    finally:
        bootstrap.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
