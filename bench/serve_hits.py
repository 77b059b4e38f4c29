"""Predicted vs measured vs Belady hit rate per stage, from a real `moeray serve` under load.

    python bench/serve_hits.py [--clients 16 --warmup 30 --duration 40] [--json out.json] [-- SERVE FLAGS...]

Starts `moeray serve` (its defaults: the embedded model on the default simulated cards, the
recorded profile, adaptive caches) with `--record-routing`, drives it with bench/load.py's
streaming clients for a warm-up and then a measured window, and reads `/v1/stages` at both ends.
Per stage it prints the plan's predicted hit rate, the hit rate the stage counted in the window
(the counters' difference), and Belady's offline optimum on the same lookups with the same slots
(the stage's own routing trace, the records of the window), so "how close is the live cache to
the best any policy could do with this room" is answered on served traffic, not on a replay of
prompts we chose.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from results import write_results  # noqa: E402

from serve_sweep import drive  # noqa: E402  (bench/load.py's clients, as the HTTP benches drive them)

from moeray.cache.replay import belady  # noqa: E402
from moeray.cache.residency import Slots  # noqa: E402
from moeray.cache.trace import Trace, read_trace  # noqa: E402
from moeray.stages.runtime.transport import free_port  # noqa: E402


def get_json(url: str, timeout: float = 30.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def start_server(port: int, trace_dir: str, extra: list[str], timeout_s: float) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "moeray.cluster.cli", "serve", "--port", str(port),
           "--metrics-export-port", str(free_port()), "--record-routing", trace_dir, *extra]
    print("$", " ".join(cmd[2:]), file=sys.stderr)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=sys.stderr)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"moeray serve exited with {proc.returncode} before it was ready")
        try:
            if get_json(f"http://127.0.0.1:{port}/health", 5).get("status") == "ok":
                return proc
        except OSError:
            pass
        time.sleep(1.0)
    proc.kill()
    raise SystemExit(f"moeray serve not ready in {timeout_s:.0f} s")


def window(trace: Trace, skip_lookups: int) -> Trace:
    """The trace's records after its first `skip_lookups` lookups (the warm-up)."""
    seen, keep = 0, []
    for rec in trace.records:
        if seen >= skip_lookups:
            keep.append(rec)
        seen += sum(len(row) for row in rec.ids)
    return Trace(trace.header, keep)


def stage_rows(before: dict, after: dict, trace_dir: str) -> list[dict]:
    rows = []
    for b, a in zip(before["stages"], after["stages"]):
        cb, ca = b.get("cache") or {}, a.get("cache") or {}
        if not ca:
            continue
        lookups, hits = ca["lookups"] - cb.get("lookups", 0), ca["hits"] - cb.get("hits", 0)
        trace = window(read_trace(os.path.join(trace_dir, f"stage{a['stage']}.trace")), cb.get("lookups", 0))
        slots = Slots(ca["layout"] == "per-layer", int(ca.get("quota", 0)), int(ca["slots"]))
        opt = belady(trace, slots)
        rows.append({"stage": a["stage"], "layers": ca["layers"], "slots": ca["slots"], "policy": ca["policy"],
                     "predicted": a.get("predicted_hit_rate"), "lookups": lookups, "hits": hits,
                     "measured": hits / lookups if lookups else 0.0,
                     "belady_lookups": int(opt.lookups.sum()), "belady_hits": int(opt.hits.sum()),
                     "belady": opt.hit_rate})
    return rows


def pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def print_table(rows: list[dict], load: dict) -> dict:
    print("| stage | layers | slots | policy | predicted | measured | Belady | measured / Belady | lookups |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        a, b = r["layers"][0], r["layers"][1] - 1
        ratio = r["measured"] / r["belady"] if r["belady"] else float("nan")
        print(f"| {r['stage']} | {a}–{b} | {r['slots']} | {r['policy']} | {pct(r['predicted'])} | "
              f"{pct(r['measured'])} | {pct(r['belady'])} | {ratio:.2f} | {r['lookups']} |")
    hits, lookups = sum(r["hits"] for r in rows), sum(r["lookups"] for r in rows)
    bh, bl = sum(r["belady_hits"] for r in rows), sum(r["belady_lookups"] for r in rows)
    agg = {"measured": hits / lookups if lookups else 0.0, "belady": bh / bl if bl else 0.0}
    agg["measured_over_belady"] = agg["measured"] / agg["belady"] if agg["belady"] else float("nan")
    print(f"| all | | | | | {pct(agg['measured'])} | {pct(agg['belady'])} | {agg['measured_over_belady']:.2f} | {lookups} |")
    worst = max((abs(r["measured"] - r["predicted"]) for r in rows if r["predicted"] is not None), default=0.0)
    print(f"largest |measured - predicted|: {100 * worst:.1f} points; window: {load['requests']} requests, "
          f"{load['tokens']} output tokens, {len(load['errors'])} errors")
    return {**agg, "max_abs_gap": worst}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--warmup", type=float, default=30.0, help="seconds of load before the measured window")
    p.add_argument("--duration", type=float, default=40.0, help="seconds of the measured window")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="moeray-traces-") as trace_dir:
        proc = start_server(port, trace_dir, extra, args.ready_timeout)
        try:
            warm = drive(url, args.clients, args.warmup, args.max_tokens)
            before = get_json(f"{url}/v1/stages")
            load = drive(url, args.clients, args.duration, args.max_tokens)
            after = get_json(f"{url}/v1/stages")  # this poll also flushes every stage's trace
            rows = stage_rows(before, after, trace_dir)
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    print(f"moeray serve {' '.join(extra)}: {args.clients} clients, {args.warmup:.0f} s warm-up "
          f"({warm['requests']} requests), {args.duration:.0f} s measured")
    agg = print_table(rows, load)
    if args.json:
        write_results(args.json, {"clients": args.clients, "stages": rows, "aggregate": agg, "load": {**load, "errors": load["errors"][:5]},
                                  "serve_flags": extra, "plan": after.get("plan")})
    return 0 if not load["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
