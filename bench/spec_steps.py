"""Where a speculative step's time goes: a step's wall time by its token count, as the engine times it.

    python bench/spec_steps.py [--model X.gguf] [--kind code] [--threads 1] [--max-tokens 64] [--mode auto]
    # beside it, llama.cpp's cost of a batch of n tokens on the same file:
    llama-bench -m X.gguf -t 1 -p 1,2,4,8,12 -n 0

The engine `moeray serve --local` builds (the same options, in this process, its HTTP loop stopped)
answers one bundled prompt of bench/spec_prompts.json greedily, twice; the second answer's steps
(every graph shape already built by the first) are grouped by tokens per step: a verify row of k
drafted tokens is a step of k + 1. T(n) / T(1) is what a drafted token must win back: a row of n
tokens pays only where more than T(n) / T(1) tokens of it are kept on average. The fitted step
price the speculation plans with (cluster/step_clock.py) and the acceptance are printed with it.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from results import write_results  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="GGUF file (default: the embedded default model)")
    p.add_argument("--kind", default="code", choices=("code", "quotes", "json", "chat"))
    p.add_argument("--prompt", type=int, default=0, help="which of the kind's prompts (0-based)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--mode", default="auto", help="--speculative of the engine")
    p.add_argument("--trace", action="store_true",
                   help="also print every step of the second answer: its tokens, draft, match length, kept")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args(argv)
    from moeray.cluster.cli import build_parser
    from moeray.cluster.commands.serve import options_from_args
    from moeray.cluster.service import Service
    from moeray.stages.text.sampling import SamplingParams

    if args.model is None:
        from moeray.stages.gguf.default_model import default_model_path

        args.model = str(default_model_path())
    serve = ["serve", "--local", args.model, "--no-metrics", "--threads", str(args.threads), "--max-seqs", "1",
             "--micro-batches", "1", "--speculative", args.mode]
    svc = Service(options_from_args(build_parser(serve)[0].parse_args(serve)), log=lambda *a: None)
    svc.loop.stop()  # this script steps the engine itself
    eng, tok = svc.engine, svc.tokenizer
    if eng.clock is None:
        raise SystemExit(f"--mode {args.mode}: this engine does not speculate, so it times no steps")
    prompt = json.loads((HERE / "spec_prompts.json").read_text())[args.kind][args.prompt]
    ids = tok.encode_chat([{"role": "user", "content": prompt}])
    params = SamplingParams(max_tokens=args.max_tokens)
    eng.generate([ids], params)  # builds the graph shapes the answer needs
    eng.clock.steps.clear()
    verdicts = []  # per verify row: the drafter's match length, drafted, accepted (in step order)
    observe = eng.speculation.observe

    def traced(seq, drafted, accepted, emitted):
        verdicts.append((seq.draft.match if seq.kind == "ngram" and seq.draft is not None else -1, drafted, accepted))
        observe(seq, drafted, accepted, emitted)

    eng.speculation.observe = traced
    timed = []  # every step, cold ones too (the clock keeps only the priced): tokens, drafted, ms, cold
    time_step = eng._time

    def timing(step, now, cold=False):
        ms, start = time_step(step, now, cold)
        timed.append((sum(len(r.tokens) for r in step.rows), sum(len(r.draft) for r in step.rows), ms, cold))
        return ms, start

    eng._time = timing
    t0 = time.perf_counter()
    out = eng.generate([ids], params)[0]
    wall = time.perf_counter() - t0
    by = defaultdict(list)
    for n, _, _, _, ms in eng.clock.steps:
        by[n].append(ms)
    one = statistics.median(by[1]) if by.get(1) else None
    rows = [{"tokens": n, "steps": len(v), "median_ms": statistics.median(v)} for n, v in sorted(by.items())]
    print(f"\n{Path(args.model).name}, {args.kind} prompt, {args.threads} thread(s), --speculative {args.mode}: "
          f"{len(out.output)} tokens in {wall:.2f} s (prefill included)\n")
    print("| tokens in the step | steps | median ms | / a 1-token step |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['tokens']} | {r['steps']} | {r['median_ms']:.1f} | "
              f"{r['median_ms'] / one:.2f}× |" if one else f"| {r['tokens']} | {r['steps']} | {r['median_ms']:.1f} | |")
    if args.trace:  # one sequence: each step is one row, a verify row's verdict in the same order
        print("\n| step | tokens | ms | match | drafted | kept |")
        print("|---|---|---|---|---|---|")
        v = iter(verdicts)
        for i, (n, drafted, ms, cold) in enumerate(timed):
            m, d, a = next(v) if drafted else ("", "", "")
            print(f"| {i} | {n} | {ms:.1f}{' cold' if cold else ''} | {m} | {d} | {a} |")
    price, stats = eng.speculation.price, eng.speculation.stats.as_dict()
    if price is not None:
        print(f"\nfitted step price: fixed {price.fixed_ms:.1f} ms + {price.token_ms:.1f} ms a token + {price.draft_ms:.1f} ms "
              f"a drafted token + {price.verify_row_ms:.1f} ms a verify row (+ the experts' union, weighted {price.expert_scale:.2f})")
    print(f"acceptance: {stats['accepted_tokens']} of {stats['drafted_tokens']} drafted tokens in "
          f"{stats['verify_rows']} verify rows ({stats['tokens_per_verify_row']:.2f} tokens a row)")
    if args.json:
        write_results(args.json, {"kind": args.kind, "threads": args.threads, "rows": rows, "speculation": stats})
    svc.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
