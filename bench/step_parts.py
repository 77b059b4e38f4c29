"""One sequence's decode step in process: how much of it is ggml and how much the Python around it.

    python bench/step_parts.py [--model X.gguf] [--tokens 256] [--rounds 4] [--sample 0.8,0.95]
        [--vs DIR] [--json out.json]

The engine over the model as `serve --local` holds it (bench/served_step.py's), no server: one
sequence after a 40-token prompt decodes `--tokens` tokens, three times; per step the wall time,
the time inside ggml's graph computes (GraphPlans.compute, timed around every call) and the rest
(the scheduler, the step's inputs, sampling, the experts' counting, torch between the graphs).
Each round is a fresh process. `--vs DIR`: another checkout of moeray (e.g. `git worktree add
/tmp/before <commit>`), measured in turn with this one (A B A B), its own code imported in its
own processes (this file and bench/served_step.py run from here), for a before / after in one
sitting. `--sample T,TOP_P`: sampled tokens (seed 1)
instead of greedy ones.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PACKAGES = ("cache", "cluster", "planner", "stages")  # the folders that install as moeray.<name>


def one_round(model: str | None, tokens: int, sample: str | None) -> dict:
    """In this process: three decodes of `tokens` tokens; medians of their per-step figures."""
    import random

    sys.path.insert(0, str(HERE))
    from served_step import engine, load

    from moeray.stages.kernels import threads
    from moeray.stages.text.sampling import SamplingParams

    inside = [0.0]
    compute = threads.GraphPlans.compute

    def timed(self, graph):
        t = time.perf_counter()
        try:
            return compute(self, graph)
        finally:
            inside[0] += time.perf_counter() - t

    threads.GraphPlans.compute = timed
    e = engine(load(model), True)
    rnd = random.Random(0)
    fields = {}
    if sample:
        t, top_p = (float(x) for x in sample.split(","))
        fields = dict(temperature=t, top_p=top_p, seed=1)

    def decode(n: int) -> tuple[float, float]:
        r = e.add([rnd.randrange(100, 40000) for _ in range(40)],
                  SamplingParams(max_tokens=n, ignore_eos=True, **fields))
        while r.t_first is None:
            e.step()
        inside[0], steps, t0 = 0.0, 0, time.perf_counter()
        while not r.done:
            e.step()
            steps += 1
        return (time.perf_counter() - t0) / steps * 1e3, inside[0] / steps * 1e3

    decode(64)  # every graph shape built
    runs = [decode(tokens) for _ in range(3)]
    step, ggml = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
    return {"step_ms": step, "ggml_ms": ggml, "other_ms": step - ggml}


def child(checkout: Path | None, args) -> dict:
    """one_round in a fresh process, importing moeray from `checkout` (None: this one)."""
    env = dict(os.environ)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_one", "--tokens", str(args.tokens)]
    cmd += ["--model", args.model] if args.model else []
    cmd += ["--sample", args.sample] if args.sample else []
    with tempfile.TemporaryDirectory() as tmp:
        if checkout is not None:
            # A `moeray` package whose parts are the other checkout's folders, first on the path:
            # found before the editable install's mapping to this one.
            pkg = Path(tmp) / "moeray"
            pkg.mkdir()
            for f in (checkout / "moeray").iterdir():
                (pkg / f.name).symlink_to(f)
            for name in PACKAGES:
                (pkg / name).symlink_to(checkout / name)
            env["PYTHONPATH"] = tmp + os.pathsep + env.get("PYTHONPATH", "")
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"a round failed ({checkout or ROOT}):\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="GGUF file (default: the embedded default model)")
    p.add_argument("--tokens", type=int, default=256, help="tokens a decode, after the prompt")
    p.add_argument("--rounds", type=int, default=4, help="processes per checkout")
    p.add_argument("--sample", metavar="T,TOP_P", help="sampled tokens with these (seed 1); default greedy")
    p.add_argument("--vs", metavar="DIR", help="another moeray checkout, measured in turn with this one")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--_one", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._one:
        print(json.dumps(one_round(args.model, args.tokens, args.sample)))
        return 0
    sides = [("this checkout", None)] + ([(f"--vs {args.vs}", Path(args.vs).resolve())] if args.vs else [])
    got: dict[str, list[dict]] = {label: [] for label, _ in sides}
    for _ in range(args.rounds):
        for label, checkout in sides:
            got[label].append(child(checkout, args))
    kind = f"sampled ({args.sample})" if args.sample else "greedy"
    print(f"one sequence, {kind}, {args.tokens} tokens a decode, {args.rounds} processes each (A B A B)")
    print("| checkout | step ms | inside ggml ms | outside ggml ms (each round) |")
    print("|---|---|---|---|")
    rows = []
    for label, rounds in got.items():
        row = {"checkout": label, **{k: statistics.median(r[k] for r in rounds) for k in rounds[0]},
               "other_ms_rounds": [r["other_ms"] for r in rounds]}
        rows.append(row)
        each = ", ".join(f"{x:.2f}" for x in row["other_ms_rounds"])
        print(f"| {label} | {row['step_ms']:.2f} | {row['ggml_ms']:.2f} | {row['other_ms']:.2f} ({each}) |")
    if args.json:
        sys.path.insert(0, str(HERE))
        from results import write_results

        write_results(args.json, {"tokens": args.tokens, "sample": args.sample, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
