"""The step price speculation plans with, against the steps it prices: predicted ms vs measured ms.

    python bench/spec_price.py [--model X.gguf] [--kinds code chat] [--clients 1 16] [--threads 2] \\
        [--max-tokens 64] [--mode auto] [--json out.json]

The engine `moeray serve --local` builds (its HTTP loop stopped) answers N requests of a kind at
once (N = each --clients), greedily, twice: the first answer builds the graph shapes, the second's
steps are the ones reported. Every step is recorded as the engine times it (cluster/engine.py
`_time`) together with what the fitted StepPrice (cluster/step_clock.py) predicted for a step of
its size just before it came back, and its shape: decode rows, drafted tokens, the longest row
(a step whose rows differ in length pads its attention queries to rows x longest), whether its
shape was new to this run (the stages build a graph per shape). Steps are grouped by decode rows
and drafted-or-not; measured / predicted per group shows where the price is wrong, and the
marginal ms of a drafted token (measured: a verify step against the plain steps of the same rows)
against the price's.
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


_BUILDS = {"n": 0, "ms": 0.0}


def graph_builds() -> dict:
    """Counts the ggml graphs the stages build (stages/runtime/trunk_graph.py MultiGraph) and the ms
    they take: a step of a shape not cached pays its graph's build."""
    from moeray.stages.runtime import trunk_graph

    if not getattr(trunk_graph.MultiGraph, "_counted", False):
        init = trunk_graph.MultiGraph.__init__

        def counted(self, *a, **k):
            t0 = time.perf_counter()
            init(self, *a, **k)
            _BUILDS["n"] += 1
            _BUILDS["ms"] += (time.perf_counter() - t0) * 1e3

        trunk_graph.MultiGraph.__init__ = counted
        builder = trunk_graph.TrunkGraphs._builder

        def timed_builder(self, *a, **k):
            t0 = time.perf_counter()
            try:
                return builder(self, *a, **k)
            finally:
                _BUILDS["ms"] += (time.perf_counter() - t0) * 1e3

        trunk_graph.TrunkGraphs._builder = timed_builder
        trunk_graph.MultiGraph._counted = True
    return _BUILDS


def run(eng, tok, prompts: list[str], clients: int, max_tokens: int) -> list[dict]:
    from moeray.stages.text.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens)
    ids = [tok.encode_chat([{"role": "user", "content": prompts[i % len(prompts)]}]) for i in range(clients)]
    steps: list[dict] = []
    seen: set = set()
    orig = eng._time
    builds = graph_builds()

    def timed(step, now: int, cold: bool = False) -> tuple[float, int]:
        spec = eng.speculation
        n = sum(len(r.tokens) for r in step.rows)
        price = spec.price if spec is not None else None
        drafted = sum(len(r.draft) for r in step.rows)
        pred = (price.ms(n) + drafted * getattr(price, "draft_ms", 0.0)
                + sum(1 for r in step.rows if r.draft) * getattr(price, "verify_row_ms", 0.0)) if price is not None else None
        built = (builds["n"], builds["ms"])
        got = orig(step, now, cold)
        ms = got[0]  # the engine's own charge: from its submission, or the result before it while busy
        built = (builds["n"] - built[0], builds["ms"] - built[1])
        builds["n"] = builds["ms"] = 0
        decode = [r for r in step.rows if r.sample and not (len(r.tokens) - len(r.draft) > 1)]
        t_max = max(len(r.tokens) for r in step.rows)
        shape = (len(step.rows), t_max, n)
        steps.append({"tokens": n, "rows": len(step.rows), "decode_rows": len(decode), "drafted": drafted,
                      "verify_rows": sum(1 for r in step.rows if r.draft), "t_max": t_max,
                      "prefill": any(not r.sample or len(r.tokens) - len(r.draft) > 1 for r in step.rows),
                      "new_shape": shape not in seen, "graphs_built": built[0], "build_ms": built[1], "ms": ms, "predicted_ms": pred})
        seen.add(shape)
        return got

    eng._time = timed
    try:
        eng.generate(ids, params)  # every shape this answer needs built once
        steps.clear()
        t0 = time.perf_counter()
        out = eng.generate(ids, params)
        wall = time.perf_counter() - t0
    finally:
        eng._time = orig
    return steps, wall, sum(len(r.output) for r in out)


def report(steps: list[dict], label: str) -> None:
    groups = defaultdict(list)
    for s in steps:
        if s["prefill"]:
            continue
        groups[(s["decode_rows"], s["drafted"] > 0)].append(s)
    print(f"\n{label}")
    print("| decode rows | drafted | steps | graphs built (ms) | median tokens | median ms | median predicted | measured / predicted |")
    print("|---|---|---|---|---|---|---|---|")
    for (rows, d), v in sorted(groups.items()):
        ms = statistics.median(x["ms"] for x in v)
        preds = [x["predicted_ms"] for x in v if x["predicted_ms"]]
        ratio = statistics.median(x["ms"] / x["predicted_ms"] for x in v if x["predicted_ms"]) if preds else None
        print(f"| {rows} | {'yes' if d else 'no'} | {len(v)} | {sum(x['graphs_built'] for x in v)} ({sum(x['build_ms'] for x in v):.0f}) | "
              f"{statistics.median(x['tokens'] for x in v):.0f} | {ms:.1f} | "
              f"{statistics.median(preds) if preds else float('nan'):.1f} | {ratio if ratio else float('nan'):.2f} |")
    # the marginal ms of a drafted token at each width: verify steps against plain steps of the same rows
    for rows in sorted({k[0] for k in groups}):
        plain, ver = groups.get((rows, False), []), groups.get((rows, True), [])
        if not plain or not ver:
            continue
        base = statistics.median(x["ms"] for x in plain)
        per = [(x["ms"] - base) / x["drafted"] for x in ver]
        pbase = statistics.median(x["predicted_ms"] for x in plain if x["predicted_ms"]) if any(
            x["predicted_ms"] for x in plain) else None
        pper = [(x["predicted_ms"] - pbase) / x["drafted"] for x in ver if x["predicted_ms"] and pbase]
        print(f"{rows} decode rows: a drafted token costs {statistics.median(per):.2f} ms measured "
              f"({statistics.median(per) / base:.2f} of a plain step), "
              + (f"{statistics.median(pper):.2f} ms predicted" if pper else "no prediction"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="GGUF file (default: the embedded default model)")
    p.add_argument("--kinds", nargs="+", default=["code", "chat"], choices=("code", "quotes", "json", "chat"))
    p.add_argument("--clients", type=int, nargs="+", default=[1, 16])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--mode", default="auto", help="--speculative of the engine")
    p.add_argument("--json", help="also write every step here")
    args = p.parse_args(argv)
    from moeray.cluster.cli import build_parser
    from moeray.cluster.commands.serve import options_from_args
    from moeray.cluster.service import Service

    if args.model is None:
        from moeray.stages.gguf.default_model import default_model_path

        args.model = str(default_model_path())
    prompts = json.loads((HERE / "spec_prompts.json").read_text())
    out = {}
    for n in args.clients:
        serve = ["serve", "--local", args.model, "--no-metrics", "--threads", str(args.threads), "--max-seqs", str(n),
                 "--micro-batches", "1", "--speculative", args.mode]
        svc = Service(options_from_args(build_parser(serve)[0].parse_args(serve)), log=lambda *a: None)
        svc.loop.stop()  # this script steps the engine itself
        try:
            for kind in args.kinds:
                eng = svc.engine
                before = eng.speculation.stats.as_dict() if eng.speculation else None
                steps, wall, toks = run(eng, svc.tokenizer, prompts[kind], n, args.max_tokens)
                after = eng.speculation.stats.as_dict() if eng.speculation else None
                acc = ""
                if before and after:
                    acc = (f", accepted {after['accepted_tokens'] - before['accepted_tokens']} of "
                           f"{after['drafted_tokens'] - before['drafted_tokens']} drafted")
                price = eng.speculation.price if eng.speculation else None
                fit = (f"; price fixed {price.fixed_ms:.1f} + {price.token_ms:.2f} ms a token + "
                       f"{getattr(price, 'draft_ms', 0.0):.2f} a drafted one + "
                       f"{getattr(price, 'verify_row_ms', 0.0):.2f} a verify row, experts x{getattr(price, 'expert_scale', 1.0):.2f}"
                       if price else "")
                stats = eng.speculation.stats.as_dict() if eng.speculation else {}
                if "pauses" in stats:
                    fit += f"; paused {stats['pauses']} times, {stats['paused_steps']} steps"
                report(steps, f"{kind}, {n} client(s), --speculative {args.mode}: {toks} tokens in {wall:.2f} s "
                       f"({toks / wall:.1f} tok/s, prefill included){acc}{fit}")
                out[f"{kind}/{n}"] = steps
        finally:
            svc.close()
    if args.json:
        write_results(args.json, {"steps": out})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
