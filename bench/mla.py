"""MLA decode: the weight-absorbed form stages/blocks/mla.py runs vs decompressing the latent cache.

One DeepSeek-V3 layer's attention (128 heads, kv_lora 512, rope 64, nope 128, v 128) for one
decode token over a cached context of T tokens, float32 on the CPU, side by side in one run:
  absorbed    q_lat = k_b^T q_nope per head, attention over the [latent, rope key] rows as they are
              cached (one key head of 576 shared by all query heads, the heads laid out as query
              rows as stages/blocks/mla.py does), out = v_b (softmax . latent)
  decompress  k = [k_b c, k_pe] and v = v_b c for every cached token (what a cache of full keys
              would hold), then ordinary multi-head attention over 192-wide heads

    .venv/bin/python bench/mla.py --contexts 256,1024,4096 --reps 5
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from results import write_results  # noqa: E402

H, C, R, NOPE, V = 128, 512, 64, 128, 128


def absorbed(q, cache, k_b, v_b, scale):
    q_lat = torch.einsum("nhd,hcd->nhc", q[..., :NOPE], k_b)
    query = torch.cat((q_lat, q[..., NOPE:]), -1).view(1, 1, H, C + R)  # heads as query rows of one key head
    keys = cache.view(1, 1, -1, C + R)
    out = F.scaled_dot_product_attention(query, keys, keys[..., :C], scale=scale)
    return torch.einsum("nhc,hvc->nhv", out.view(1, H, C), v_b)


def decompress(q, cache, k_b, v_b, scale):
    latent, k_pe = cache[:, :C], cache[:, C:]
    k_nope = torch.einsum("tc,hcd->htd", latent, k_b)
    keys = torch.cat((k_nope, k_pe.unsqueeze(0).expand(H, -1, -1)), -1).unsqueeze(0)
    values = torch.einsum("tc,hvc->htv", latent, v_b).unsqueeze(0)
    out = F.scaled_dot_product_attention(q.view(1, H, 1, NOPE + R), keys, values, scale=scale)
    return out.view(1, H, V)


def median_ms(fn, reps):
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="256,1024,4096")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.manual_seed(0)
    k_b, v_b = torch.randn(H, C, NOPE) / C ** 0.5, torch.randn(H, V, C) / C ** 0.5
    q, scale = torch.randn(1, H, NOPE + R), (NOPE + R) ** -0.5
    rows = []
    print("| cached tokens | absorbed ms | decompress ms | decompress / absorbed | max |diff| |")
    print("|---|---|---|---|---|")
    with torch.inference_mode():
        for T in (int(x) for x in args.contexts.split(",")):
            cache = torch.randn(T, C + R)
            a = median_ms(lambda: absorbed(q, cache, k_b, v_b, scale), args.reps)
            d = median_ms(lambda: decompress(q, cache, k_b, v_b, scale), args.reps)
            diff = (absorbed(q, cache, k_b, v_b, scale) - decompress(q, cache, k_b, v_b, scale)).abs().max().item()
            rows.append({"tokens": T, "absorbed_ms": a, "decompress_ms": d, "ratio": d / a, "max_diff": diff})
            print(f"| {T} | {a:.2f} | {d:.2f} | {d / a:.1f}x | {diff:.1e} |")
    if args.json:
        write_results(args.json, rows)


if __name__ == "__main__":
    main()
