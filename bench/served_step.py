"""What a served decode step costs beyond `bench/decode.py`'s, in one process, no HTTP.

    python bench/served_step.py [--model X.gguf] [--rounds 5] [--prefill 8 32]

`bench/decode.py` decodes sequences that never end: every step full, equal lengths, each
sequence's keys in one run of blocks (attention reads the pool as one view). Served traffic
differs in two ways that cost the engine, measured here in turns (A B A B, so a drifting load
hits every case alike; medians over the rounds):

- **prefill inside a decode step:** 15 decoding sequences, then a new prompt of P tokens joins
  their step (chunked prefill). Compared with the decode step alone plus the same P-token prefill
  run alone: near 1.0 means a prompt token costs about what it costs on its own (no saving from
  sharing the step's weight reads, no loss from the padding either).
- **keys by gather vs one view:** 16 (and 1) sequences whose block tables were reserved whole
  (consecutive: one view of the pool, what the engine alone gets) against tables that grew
  block by block behind a shared prompt prefix (what a server's prefix reuse gives: a gather).
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from moeray.cluster.config import EngineConfig
from moeray.cluster.engine import Engine
from moeray.cluster.local_pipeline import LocalPipeline
from moeray.cluster.service import local_stage_options
from moeray.stages.text.sampling import SamplingParams

KV_BLOCKS = 1024


def load(model: str | None) -> LocalPipeline:
    """The model as `moeray serve --local` holds it (its ggml thread settings, every expert resident)."""
    from moeray.stages.gguf.default_model import FILE_NAME, cache_dir
    from moeray.stages.gguf.reader import read_gguf_header
    from moeray.stages.kernels import settings
    from moeray.stages.runtime.default_profile import resolve_profile

    path = model or str(cache_dir() / FILE_NAME)
    stage = local_stage_options(settings.current(), read_gguf_header(path).token_bytes())  # with MOERAY_* overrides
    return LocalPipeline.from_file(path, KV_BLOCKS, 4 << 30, resolve_profile(None, path), "static", 32, stage)


def engine(pipe: LocalPipeline, prefix_reuse: bool) -> Engine:
    return Engine(pipe, EngineConfig(max_seqs=16, max_len=2048, micro_batches=1, kv_blocks=KV_BLOCKS,
                                     prefix_reuse=prefix_reuse))


def timed(e: Engine) -> float:
    t = time.perf_counter()
    e.step()
    return (time.perf_counter() - t) * 1e3


def prefill_in_decode(pipe, rnd, P: int, steps: int = 4) -> dict[str, float]:
    """Median ms of: the 15-row decode step, that step with a P-token prompt joining, P alone."""
    tok = lambda n: [rnd.randrange(100, 40000) for _ in range(n)]  # noqa: E731
    e, alone = engine(pipe, False), engine(pipe, False)
    reqs = [e.add(tok(40), SamplingParams(max_tokens=200, ignore_eos=True)) for _ in range(15)]
    while any(r.t_first is None for r in reqs):
        e.step()
    e.step()
    out = {"decode": [], "mixed": [], "alone": []}
    for _ in range(steps):
        out["decode"].append(timed(e))
        e.add(tok(P), SamplingParams(max_tokens=1, ignore_eos=True))
        out["mixed"].append(timed(e))
        # A second engine on the same pool: its sequences write blocks the first one holds, which
        # garbles their text but not the step's cost (only timings are read here).
        alone.add(tok(P), SamplingParams(max_tokens=1, ignore_eos=True))
        out["alone"].append(timed(alone))
    for r in reqs:
        e.abort(r)
    e.step()
    return {k: statistics.median(v) for k, v in out.items()}


def decode_step(pipe, rnd, B: int, gather: bool, steps: int = 16) -> float:
    """Median ms of a decode step of B sequences: tables reserved whole (view) or grown behind a
    shared 32-token prefix (gather)."""
    tok = lambda n: [rnd.randrange(100, 40000) for _ in range(n)]  # noqa: E731
    e = engine(pipe, prefix_reuse=gather)
    e.scheduler.reserve_output = not gather
    shared = tok(32)
    if gather and B > 1:  # the prefix computed once, as a server's first request does
        e.generate([shared + tok(4)], SamplingParams(max_tokens=1))
    reqs = [e.add((shared if gather else tok(32)) + tok(8), SamplingParams(max_tokens=steps, ignore_eos=True))
            for _ in range(B)]
    while any(r.t_first is None for r in reqs):
        e.step()
    times = []
    while not all(r.done for r in reqs):
        times.append(timed(e))
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="GGUF file (default: the embedded default model)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--prefill", type=int, nargs="+", default=[8, 32], help="prompt tokens joining the step")
    args = p.parse_args(argv)
    pipe, rnd = load(args.model), random.Random(0)
    mixed: dict[int, list[dict]] = {P: [] for P in args.prefill}
    layout: dict[tuple[int, bool], list[float]] = {(B, g): [] for B in (16, 1) for g in (False, True)}
    for _ in range(args.rounds):
        for P in args.prefill:
            mixed[P].append(prefill_in_decode(pipe, rnd, P))
        for B, g in layout:
            layout[B, g].append(decode_step(pipe, rnd, B, g))
    print("| prefill inside a 15-row decode step | decode step | with the chunk | chunk alone | with / (decode + alone) |")
    print("|---|---|---|---|---|")
    for P, rows in mixed.items():
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        ratio = statistics.median(r["mixed"] / (r["decode"] + r["alone"]) for r in rows)
        print(f"| {P} tokens | {med['decode']:.1f} ms | {med['mixed']:.1f} ms | {med['alone']:.1f} ms | {ratio:.2f} |")
    print("\n| decode step | keys as one view | keys by gather | gather / view |")
    print("|---|---|---|---|")
    for B in (16, 1):
        view, gather = layout[B, False], layout[B, True]
        ratio = statistics.median(g / v for g, v in zip(gather, view))
        print(f"| {B} sequence{'s' if B > 1 else ''} | {statistics.median(view):.1f} ms | {statistics.median(gather):.1f} ms | {ratio:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
