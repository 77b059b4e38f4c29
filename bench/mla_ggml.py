"""MLA decode attention in ggml, one layer: what a float16 latent pool or two matrix products would
change against the float32 flash attention the stage graph runs (stages/runtime/trunk_graph.py).

One decode token's query heads (already absorbed into the latent: 512 latent + 64 RoPE = 576 per
head, DeepSeek-V2/V3's ranks) over T cached rows of one shared key head, the value being the
rows' first 512 values, in ggml's own graph with the venv's ggml, side by side in one run:
  fa f32   ggml_flash_attn_ext over float32 rows (the KV pool today)
  fa f16   the same over float16 rows (llama.cpp's default cache type)
  mm f32   mul_mat (scores), soft_max_ext, mul_mat over the transposed latent

    .venv/bin/python bench/mla_ggml.py --heads 16 --contexts 64,512,2048 --threads 2 [--json out.json]

--heads 16 is DeepSeek-V2-Lite's, 128 DeepSeek-V3's and Kimi-K2's. Times are the best of --reps
graph computes after one warm-up; max |diff| is against fa f32.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from results import write_results  # noqa: E402

C, R = 512, 64  # latent rank, RoPE key width
D = C + R


class OneLayer:
    """One variant's graph, built once: `compute()` times one run (ms), `out()` is its [heads, C]."""

    def __init__(self, G, heads: int, keys: int, variant: str, threads: int):
        import ggml.utils as U

        self.G, self.threads, self.heads = G, threads, heads
        mem = (256 << 20) + 3 * keys * D * 4 + 4 * keys * heads * 4 + 4 * heads * D * 4  # + k, its transpose, scores
        self.ctx = ctx = G.ggml_init(G.ggml_init_params(mem_size=mem, mem_buffer=None, no_alloc=False))
        kv_type = G.GGML_TYPE_F16 if variant == "fa f16" else G.GGML_TYPE_F32
        q = G.ggml_new_tensor_4d(ctx, G.GGML_TYPE_F32, D, 1, heads, 1)
        k = G.ggml_new_tensor_4d(ctx, kv_type, D, keys, 1, 1)
        mask = G.ggml_new_tensor_2d(ctx, G.GGML_TYPE_F16, keys, 64)  # flash attention pads the query rows
        rng = np.random.default_rng(0)
        U.to_numpy(q)[:] = (rng.standard_normal(U.to_numpy(q).shape) * 0.1).astype(np.float32)
        U.to_numpy(k)[:] = rng.standard_normal(U.to_numpy(k).shape).astype(U.to_numpy(k).dtype)
        U.to_numpy(mask)[:] = 0
        v = G.ggml_view_4d(ctx, k, C, keys, 1, 1, k.contents.nb[1], k.contents.nb[2], k.contents.nb[3], 0)
        scale = 1 / np.sqrt(192.0)
        if variant.startswith("fa"):
            o = G.ggml_flash_attn_ext(ctx, q, k, v, mask, scale, 0.0, 0.0)  # [C, heads, 1, 1]
            G.ggml_flash_attn_ext_set_prec(o, G.GGML_PREC_F32)
            o = G.ggml_cont(ctx, o)
        else:
            kq = G.ggml_mul_mat(ctx, k, q)  # [keys, 1, heads, 1]
            kq = G.ggml_soft_max_ext(ctx, kq, G.ggml_view_2d(ctx, mask, keys, 1, mask.contents.nb[1], 0), scale, 0.0)
            vt = G.ggml_cont(ctx, G.ggml_transpose(ctx, G.ggml_view_2d(ctx, k, C, keys, k.contents.nb[1], 0)))
            o = G.ggml_cont(ctx, G.ggml_permute(ctx, G.ggml_mul_mat(ctx, vt, kq), 0, 2, 1, 3))  # [C, heads, 1, 1]
        self.o = o
        self.graph = G.ggml_new_graph(ctx)
        G.ggml_build_forward_expand(self.graph, o)
        self.compute()  # warm-up

    def compute(self) -> float:
        t = time.perf_counter()
        self.G.ggml_graph_compute_with_ctx(self.ctx, self.graph, self.threads)
        return (time.perf_counter() - t) * 1e3

    def out(self) -> np.ndarray:
        import ggml.utils as U

        return U.to_numpy(self.o).reshape(self.heads, C).copy()

    def free(self) -> None:
        self.G.ggml_free(self.ctx)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--contexts", default="64,512,2048")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--json")
    args = ap.parse_args()
    from moeray.stages.kernels.backend import ggml_lib

    G = ggml_lib()
    variants = ("fa f32", "fa f16", "mm f32")
    rows = []
    print(f"MLA decode attention, one layer, {args.heads} heads of {D}, {args.threads} threads (ms, best of {args.reps})")
    print("| cached rows | " + " | ".join(variants) + " | fa f32 / fa f16 | max |diff| f16, mm |")
    print("|---|" + "---|" * (len(variants) + 2))
    for keys in (int(x) for x in args.contexts.split(",")):
        layers = {v: OneLayer(G, args.heads, keys, v, args.threads) for v in variants}
        best = dict.fromkeys(variants, float("inf"))
        for _ in range(args.reps):  # the variants in turn, so drifting load hits all alike
            for v, layer in layers.items():
                best[v] = min(best[v], layer.compute())
        ref = layers["fa f32"].out()
        diffs = [float(np.abs(layers[v].out() - ref).max()) for v in ("fa f16", "mm f32")]
        for layer in layers.values():
            layer.free()
        rows.append({"keys": keys, "heads": args.heads, **best, "max_diff_f16": diffs[0], "max_diff_mm": diffs[1]})
        print(f"| {keys} | " + " | ".join(f"{best[v]:.3f}" for v in variants)
              + f" | {best['fa f32'] / best['fa f16']:.2f}x | {diffs[0]:.1e}, {diffs[1]:.1e} |")
    if args.json:
        write_results(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
