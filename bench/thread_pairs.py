"""ggml thread settings compared in one process, in turns: the engine's decode under each.

    python bench/thread_pairs.py [--model X.gguf] [--batch 16 1] [--rounds 5] [--decode-tokens 32]

Loads the model once (every expert resident, as `moeray serve --local` holds the default model)
and runs A B C A B C ... (a few decode steps each, after a warm-up that builds the graphs), so a
drifting load on a shared machine hits every setting alike. Prints, per batch size, each setting's
median decode tok/s over the rounds and its median ratio to the first setting within a round.
The settings are stages/kernels/threads.ThreadSettings (poll, parallel_bytes, adapt) with a thread count.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from decode import prompt_ids  # noqa: E402

SETTINGS = {  # name: (threads, ThreadSettings fields)
    "1 thread": (1, {}),
    "2 adaptive, poll 1": (2, dict(poll=1, parallel_bytes=1 << 20, adapt=True)),
    "2 adaptive, poll 0": (2, dict(poll=0, parallel_bytes=1 << 20, adapt=True)),
    "2 from 1 MB, poll 1": (2, dict(poll=1, parallel_bytes=1 << 20, adapt=False)),
    "2 every graph, poll 100": (2, dict(poll=100, parallel_bytes=0, adapt=False)),
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--batch", type=int, nargs="+", default=[16, 1])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--settings", nargs="+", default=list(SETTINGS)[:3], choices=list(SETTINGS))
    p.add_argument("--caches", default="all", help="all: every expert resident; 0: every expert on the host path")
    args = p.parse_args(argv)

    from moeray.cluster.config import EngineConfig
    from moeray.cluster.generator import Generator
    from moeray.stages.kernels import threads
    from moeray.stages.gguf.default_model import FILE_NAME, cache_dir
    from moeray.stages.gguf.reader import GGUFFile
    from moeray.stages.runtime.model import load_cached, load_model
    from moeray.stages.text.sampling import SamplingParams
    from moeray.stages.text.tokenizer import Tokenizer

    path = args.model or str(cache_dir() / FILE_NAME)
    threads.set_threads(1)
    cfg = GGUFFile(path).config
    if args.caches == "all" and cfg.is_moe:
        model, _ = load_cached(path, n_slots=cfg.n_layers * cfg.n_experts)
    else:
        model = load_model(path)
    tokenizer = Tokenizer.from_gguf(path)
    config = EngineConfig(max_seqs=max(args.batch), max_len=args.prompt_tokens + args.decode_tokens + 8,
                          token_budget=512, prefill_chunk=args.prompt_tokens, micro_batches=1)
    gen = Generator(model, tokenizer, config)
    params = SamplingParams(max_tokens=args.decode_tokens + 1, ignore_eos=True)
    results: dict[tuple[str, int], list[float]] = {}
    for r in range(args.rounds):
        for name in args.settings:
            n, fields = SETTINGS[name]
            threads.set_threads(n, threads.ThreadSettings(**fields))
            for b in args.batch:
                prompts = [prompt_ids(tokenizer, args.prompt_tokens, i) for i in range(b)]
                gen.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))  # graphs built, choices made
                gen.generate(prompts, params)
                results.setdefault((name, b), []).append(gen.stats.decode_tok_s)
                print(f"#   {name}, batch {b}: {gen.stats.decode_tok_s:.1f} tok/s", file=sys.stderr, flush=True)
        print(f"# round {r + 1}/{args.rounds} done, load {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)

    first = args.settings[0]
    print(f"{Path(path).name}, experts {'resident' if args.caches == 'all' else 'host path'}, "
          f"{args.decode_tokens} decode tokens, {args.rounds} rounds, load {os.getloadavg()[0]:.1f} at the end")
    print("| setting | batch | decode tok/s (median) | min–max | vs " + first + " (median of rounds) |")
    print("|---|---|---|---|---|")
    for b in args.batch:
        for name in args.settings:
            xs = results[(name, b)]
            ratio = statistics.median(x / y for x, y in zip(xs, results[(first, b)]))
            print(f"| {name} | {b} | {statistics.median(xs):.1f} | {min(xs):.1f}–{max(xs):.1f} | {ratio:.2f}× |")
    return 0


if __name__ == "__main__":
    t0 = time.perf_counter()
    rc = main()
    print(f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    sys.exit(rc)
