"""Pipeline benchmark: decode tokens/s for one in-process stage and for S Ray stages, and the
measured cost of one stage-to-stage hop (gloo process group vs chained Ray actor calls).

    .venv/bin/python bench/pipeline.py [MODEL.gguf] [--stages 4] [--batches 1,16] [--tokens 16] [--json out.json]

The one-stage baseline gets the sum of the stages' device budgets, so both hold the same
expert cache bytes in all. Numbers are wall-clock on whatever this machine is doing at the
time; the table says which host and how many cores.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from results import write_results  # noqa: E402

MiB = 1 << 20


def decode_tok_s(engine, batch: int, n_tokens: int, prompt_len: int = 8) -> dict:
    """Run `batch` prompts for `n_tokens` each; decode tok/s over the window where all decode."""
    from moeray.stages.text.sampling import SamplingParams

    prompts = [[1] + [(17 * i + 3 * j) % 4000 + 100 for j in range(prompt_len - 1)] for i in range(batch)]
    t0 = time.perf_counter()
    reqs = engine.generate(prompts, SamplingParams(max_tokens=n_tokens, ignore_eos=True), timeout_s=1800)
    start = max(r.t_first for r in reqs)
    end = max(r.t_done for r in reqs)
    # Tokens sampled after the last request's first token (the all-decoding window).
    toks = sum(sum(1 for _ in r.output) for r in reqs) - batch
    return {"batch": batch, "tokens": n_tokens, "decode_tok_s": toks / max(end - start, 1e-9),
            "wall_s": time.perf_counter() - t0, "ttft_s": start - t0}


def hop_costs(launched, hidden: int, reps: int) -> dict:
    """ms per hop: gloo send/recv of [rows, hidden] float32 through every link, and a chain of
    Ray actor calls carrying the same tensor (the alternative transport)."""
    import ray
    import torch

    S = launched.group.n_stages
    out = {}
    for rows in (1, 16):
        r = launched.group.link_check(rows, hidden, reps)
        out[f"gloo_ms_per_hop_rows{rows}"] = r["ms_per_pass"] / max(1, S - 1)
    actors = launched.group.actors
    x = torch.zeros(1, hidden)
    ray.get(actors[0].relay.remote(x, actors[1:]), timeout=60)
    times = []
    for _ in range(max(5, reps // 10)):
        t = time.perf_counter()
        ray.get(actors[0].relay.remote(x, actors[1:]), timeout=60)
        times.append((time.perf_counter() - t) * 1e3)
    single = []
    for _ in range(max(5, reps // 10)):
        t = time.perf_counter()
        ray.get(actors[-1].relay.remote(x, []), timeout=60)
        single.append((time.perf_counter() - t) * 1e3)
    out["ray_call_ms"] = statistics.median(single)
    # S calls in the chain (driver -> 0 -> 1 -> ... -> S-1): each stage-to-stage hop is one of them.
    out["ray_chain_ms_per_hop"] = (statistics.median(times) - statistics.median(single)) / max(1, S - 1)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?")
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--simulate-devices", default="256MiB,256MiB,192MiB,192MiB")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--tokens", type=int, default=16, help="tokens generated per sequence")
    p.add_argument("--hop-reps", type=int, default=200)
    p.add_argument("--skip-local", action="store_true", help="skip the one-stage in-process baseline")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)

    from moeray.cluster.config import EngineConfig, LaunchOptions, resolve_model, with_overrides
    from moeray.cluster.driver import launch
    from moeray.cluster.engine import Engine
    from moeray.cluster.local_pipeline import LocalPipeline
    from moeray.units import parse_sizes
    from moeray.stages.gguf.reader import read_gguf_header

    path = resolve_model(args.model)
    batches = [int(b) for b in args.batches.split(",")]
    sizes = parse_sizes(args.simulate_devices)[: args.stages]
    max_seqs, max_len = max(batches), 8 + args.tokens + 1
    hidden = read_gguf_header(path).config.hidden
    rows = []
    result = {"host": os.uname().nodename, "cpus": os.cpu_count(), "model": os.path.basename(path),
              "stages": args.stages, "devices": args.simulate_devices, "rows": rows}

    if not args.skip_local:
        local = LocalPipeline.from_file(path, max_seqs * -(-max_len // 16), simulated_budget=sum(sizes))
        for b in batches:
            eng = Engine(local, EngineConfig(max_seqs=max_seqs, max_len=max_len, token_budget=256,
                                             prefill_chunk=64, micro_batches=1))
            rows.append({"pipeline": "1 stage, in process", **decode_tok_s(eng, b, args.tokens)})
            print(rows[-1], file=sys.stderr)
        del local

    # the stages run this process's MOERAY_* debugging overrides only as part of the config they are sent
    launched = launch(path, with_overrides(LaunchOptions(args.stages, simulate=sizes, torch_threads=1, timeout_s=300)),
                      EngineConfig(max_seqs=max_seqs, max_len=max_len, micro_batches=1), log=lambda l: print(l, file=sys.stderr))
    try:
        result["plan"] = launched.plan.startup_line() if launched.plan is not None else launched.lines[-1]
        result["hops"] = hop_costs(launched, hidden, args.hop_reps)
        for b in batches:
            lanes = max(1, min(b, args.stages))
            eng = Engine(launched.pipeline(), EngineConfig(max_seqs=max_seqs, max_len=max_len, token_budget=256,
                                                           prefill_chunk=64, micro_batches=lanes))
            rows.append({"pipeline": f"{args.stages} Ray stages, {lanes} micro-batches",
                         **decode_tok_s(eng, b, args.tokens)})
            print(rows[-1], file=sys.stderr)
        result["stage_lines"] = launched.stage_stat_lines()
    finally:
        launched.shutdown()

    print(f"\nhost {result['host']} ({result['cpus']} cores), {result['model']}, devices {args.simulate_devices}")
    print(f"{'pipeline':<32} {'batch':>5} {'decode tok/s':>13} {'ttft s':>8}")
    for r in rows:
        print(f"{r['pipeline']:<32} {r['batch']:>5} {r['decode_tok_s']:>13.2f} {r['ttft_s']:>8.2f}")
    h = result["hops"]
    print(f"\nper hop: gloo {h['gloo_ms_per_hop_rows1']:.3f} ms ([1, {hidden}]), {h['gloo_ms_per_hop_rows16']:.3f} ms "
          f"([16, {hidden}]); chained Ray calls {h['ray_chain_ms_per_hop']:.3f} ms; one Ray call "
          f"{h['ray_call_ms']:.3f} ms")
    if args.json:
        write_results(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
