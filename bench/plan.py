"""How long the placement search takes (median of repeated runs, this machine).

  * the full 4-stage search at 48 layers x 512 experts (24,576 pairs, per-layer blob sizes):
    Strata's C++ search takes 14 ms for this (seed 001); moeray must be faster;
  * an 8-stage exact DP at 94 layers x 128 experts;
  * a 16-stage exact DP at 160 layers x 256 experts.
Each is timed with the trunk off (what Strata prices: free VRAM already net of the dense
weights) and with the trunk placed automatically (seed 003, priced inside every range).
Timing covers everything from (spec, devices, profile) to the finished Plan.

    .venv/bin/python bench/plan.py [--repeat 15] [--json out.json]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from results import write_results  # noqa: E402

from moeray.planner.devices import DeviceSpec  # noqa: E402
from moeray.planner.profile import Profile  # noqa: E402
from moeray.planner.search import plan_placement  # noqa: E402
from moeray.planner.spec import ModelSpec, TrunkBytes  # noqa: E402

GIB = 1 << 30
STRATA_MS = 14.0


def model(L, E, k, blob_scale=1.0, seed=0):
    rng = np.random.default_rng(seed)
    # Mixed quants: every fourth layer stored larger, the rest spread around 2 MB (times blob_scale).
    blob = [int(blob_scale * (2_329_000 if l % 4 == 0 else 1_900_000 + int(rng.integers(0, 200_000))))
            for l in range(L)]
    trunk = TrunkBytes(400_000_000, 600_000_000, [int(rng.integers(30_000_000, 50_000_000)) for _ in range(L)])
    base = 1.0 / np.arange(1, E + 1) ** 1.1  # zipf-like routing, hot experts anywhere
    counts = np.rint(np.stack([rng.permutation(base) for _ in range(L)]) * 1e6).astype(np.int64)
    return ModelSpec(L, E, k, blob, trunk), Profile.from_counts(counts)


def devices(sizes_gib):
    """Bigger cards are faster here (layer_ms 0.4 on the biggest, in proportion below it)."""
    big = max(sizes_gib)
    return [DeviceSpec(f"dev{i}", int(s * GIB), 0.4 * big / s, 0.5) for i, s in enumerate(sizes_gib)]


# (name, layers, experts, k, blob scale, free GiB per stage, method): the models do not fit, so the
# split matters (the 94x128 one is Qwen3-235B-shaped, its experts ~5x the 48x512 model's).
CASES = [
    ("4 stages, 48x512, enumerate", 48, 512, 10, 1.0, [12, 12, 8, 8], "enumeration"),
    ("4 stages, 48x512, DP", 48, 512, 10, 1.0, [12, 12, 8, 8], "dp"),
    ("8 stages, 94x128, DP", 94, 128, 8, 5.0, [24, 24, 16, 16, 12, 12, 8, 8], "dp"),
    ("16 stages, 160x256, DP", 160, 256, 8, 4.0, [24] * 4 + [16] * 4 + [12] * 4 + [8] * 4, "dp"),
]


def time_it(fn, repeat):
    """Median wall ms, min wall ms and median CPU ms of this process (numpy here is single-threaded,
    so CPU time is what the search costs even when other work shares the cores)."""
    fn()  # warm: imports, first-touch allocations
    wall, cpu = [], []
    for _ in range(repeat):
        t, c = time.perf_counter(), time.process_time()
        fn()
        wall.append((time.perf_counter() - t) * 1e3)
        cpu.append((time.process_time() - c) * 1e3)
    return statistics.median(wall), min(wall), statistics.median(cpu)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    rows = []
    print(f"{'search':31} {'trunk':5} {'placements':>12} {'median ms':>10} {'min ms':>8} {'cpu ms':>8}  split")
    for name, L, E, k, scale, sizes, method in CASES:
        spec, prof = model(L, E, k, scale)
        devs = devices(sizes)
        for trunk in ("off", "auto"):
            plan = plan_placement(spec, devs, prof, trunk=trunk, method=method)
            med, best, cpu = time_it(lambda: plan_placement(spec, devs, prof, trunk=trunk, method=method), args.repeat)
            rows.append({"search": name, "trunk": trunk, "layers": L, "experts": E, "stages": len(sizes),
                         "placements": plan.placements_scored, "median_ms": med, "min_ms": best, "cpu_median_ms": cpu,
                         "split": plan.boundaries, "predicted_ms": plan.predicted_ms})
            n = f"{plan.placements_scored:,}" if plan.placements_scored < 10**12 else f"{plan.placements_scored:.2e}"
            print(f"{name:31} {trunk:5} {n:>12} {med:>10.2f} {best:>8.2f} {cpu:>8.2f}  K={','.join(map(str, plan.boundaries))}")
    r = rows[0]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"\nStrata's C++ 4-way search (seed 001): {STRATA_MS:.0f} ms. moeray's full 4-stage enumeration "
          f"(trunk off, as Strata prices it): median {r['median_ms']:.2f} ms wall, {r['cpu_median_ms']:.2f} ms CPU "
          f"({STRATA_MS / r['cpu_median_ms']:.1f}x faster by CPU time)")
    print(f"machine: {os.cpu_count()} CPUs, load average {load:.1f} while measuring (wall time grows with the load; "
          "CPU time much less)")
    if args.json:
        write_results(args.json, {"strata_ms": STRATA_MS, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
