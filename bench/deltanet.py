"""The gated delta rule on the CPU: ggml's op (ggml_gated_delta_net, llama.cpp's kernel) against
moeray's torch rule (the recurrent step for decode, the chunked rule for prefill), side by side
in one run, at Qwen3-Next's head shape (32 value heads, 16 key heads, 128 dims) by default.

    python bench/deltanet.py [--threads 2] [--heads 32 16 128] [--repeat 5] [--json out.json]

Prints ms per call of each and the ratio torch / ggml; the ggml backend uses whichever is faster.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from results import write_results  # noqa: E402


def _time(fn, repeat: int) -> float:
    fn()  # warm: graph build, allocator
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t0) / repeat * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--heads", type=int, nargs=3, default=(32, 16, 128), metavar=("H_V", "H_K", "D"))
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", metavar="PATH", help="also write the rows here")
    args = ap.parse_args(argv)
    import torch

    from moeray.stages.kernels import threads
    from moeray.stages.blocks.deltanet import (DeltaNetShape, gated_delta_chunked, gated_delta_step, ggml_gated_delta,
                                        l2norm)

    threads.set_threads(args.threads)  # ggml's pool; torch then runs on one thread, as on the backend
    Hv, Hk, D = args.heads
    shape = DeltaNetShape(Hk, Hv, D, D, 4, "tiled")
    print(f"H_v={Hv} H_k={Hk} D={D}, ggml threads {args.threads}, torch threads {torch.get_num_threads()}")
    rows = []
    for B, T in ((1, 1), (16, 1), (1, 64), (1, 512)):
        q, k = l2norm(torch.randn(B, T, Hk, D)), l2norm(torch.randn(B, T, Hk, D))
        v, g, beta = torch.randn(B, T, Hv, D), -torch.rand(B, T, Hv), torch.rand(B, T, Hv)
        s0 = torch.randn(B, Hv, D, D) * 0.1
        qe, ke = shape.expand_qk(q) * D ** -0.5, shape.expand_qk(k)

        def with_torch():
            if T == 1:
                return gated_delta_step(qe[:, 0], ke[:, 0], v[:, 0], g[:, 0], beta[:, 0], s0)
            return [gated_delta_chunked(qe[b], ke[b], v[b], g[b], beta[b], s0[b]) for b in range(B)]

        t_ggml = _time(lambda: ggml_gated_delta(q, k, v, g, beta, s0), args.repeat)
        t_torch = _time(with_torch, args.repeat)
        kind = "decode" if T == 1 else "prefill"
        print(f"{kind:7s} B={B:2d} T={T:3d}: ggml {t_ggml:8.2f} ms  torch {t_torch:8.2f} ms  "
              f"torch/ggml {t_torch / t_ggml:5.2f}")
        rows.append({"kind": kind, "batch": B, "tokens": T, "ggml_ms": t_ggml, "torch_ms": t_torch})
    if args.json:
        write_results(args.json, {"heads": [Hv, Hk, D], "threads": args.threads, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
