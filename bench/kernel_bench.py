"""GB/s of the quantised matmul kernels against the memory bandwidth measured in the same run.

On CUDA: the Triton kernels of stages/kernels/triton_kernels.py (GEMV at M=1, the 16-row tiles at
M=16, the prefill route at M=512) and, beside them, the torch dequantise-per-use route they
replace, on the issue's target shape [1, 4096] x [4096, 14336] for every block type with a
kernel; each timed by triton.testing.do_bench, which empties the L2 (60 MB on an H200, larger
than one 33 MB Q4_K matrix) before every repetition, so the bytes come from HBM. Bandwidth:
a device-to-device copy of 2 GiB, bytes read plus written. Each product is checked against
float32 (the torch dequantiser, then a matmul on the card) before it is timed.

On the CPU (--device cpu, the dry run) the same steps run at a small shape through QMatrix's
CPU route, timed by perf_counter: only to show the code path and the JSON, not a speed figure.
"""
from __future__ import annotations

import time

import numpy as np

SHAPE = (14336, 4096)  # W [N, K]: the target, a Mixtral/Llama-3-8B FFN matrix
TYPES = ("Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0", "Q4_1", "MXFP4")
TARGET_FRACTION = 0.5  # Q4_K GEMV at >= 50% of the measured bandwidth


def _random_blocks(qtype, n_blocks: int, rng) -> np.ndarray:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from quant_blocks import random_blocks  # valid float16 scales, random codes

    return random_blocks(qtype, n_blocks, rng, scale=0.01)


def _time(fn, device: str, reps: int = 50) -> float:
    """Median ms of fn()."""
    if device.startswith("cuda"):
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=10, rep=reps, return_mode="median"))
    fn()
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return 1e3 * float(np.median(ts))


def copy_bandwidth(device: str) -> float:
    """GB/s of a device-to-device copy, bytes read + written (the ceiling a GEMV can reach)."""
    import torch

    n = (2 << 30) if device.startswith("cuda") else (64 << 20)
    a = torch.empty(n // 4, dtype=torch.float32, device=device)
    b = torch.empty_like(a)
    ms = _time(lambda: b.copy_(a), device, reps=20)
    return 2 * n / (ms * 1e-3) / 1e9


def run(device: str, quick: bool, say=print) -> dict:
    import torch
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

    from moeray.stages.kernels import triton_kernels as tk
    from moeray.stages.kernels.qmatmul import QMatrix, _dequant_linear
    from moeray.stages.gguf.quant import dequantize

    cuda = device.startswith("cuda")
    N, K = SHAPE if (cuda and not quick) else (512, 512)
    bw = copy_bandwidth(device)
    out = {"device": device, "shape_NK": [N, K], "copy_GBps": bw, "rows": []}
    say(f"copy bandwidth: {bw:.0f} GB/s (read + written)")
    rng = np.random.default_rng(0)
    types = TYPES if not quick else ("Q4_K", "Q8_0")
    for name in types:
        qtype = T[name]
        if cuda and not tk.supports(int(qtype)):
            continue
        block, size = GGML_QUANT_SIZES[qtype]
        raw = torch.from_numpy(_random_blocks(qtype, N * K // block, rng).reshape(-1)).to(device)
        wbytes = raw.numel()
        w = QMatrix(raw, qtype, (N, K), "dequant")
        want_w = dequantize(raw, qtype, (N, K))
        for m in ((1, 16, 512) if name == "Q4_K" else (1,)):
            x = torch.randn(m, K, device=device, generator=None)
            want = x @ want_w.T
            routes = {"kernel": (lambda: tk.qlinear(raw, int(qtype), (N, K), x)) if cuda else (lambda: w(x)),
                      "torch dequant per use": lambda: _dequant_linear(w, x, 16 << 20)}
            for route, fn in routes.items():
                got = fn()
                err = float((got - want).abs().max() / want.abs().max())
                ms = _time(fn, device)
                gbps = wbytes / (ms * 1e-3) / 1e9
                row = {"type": name, "M": m, "route": route, "ms": ms, "weight_bytes": wbytes,
                       "weight_GBps": gbps, "fraction_of_copy": gbps / bw, "rel_err": err}
                out["rows"].append(row)
                say(f"  {name} [{m}, {K}] x [{K}, {N}] {route:>22}: {ms:8.3f} ms, {gbps:7.0f} GB/s of weights "
                    f"({100 * gbps / bw:5.1f}% of the copy), rel err {err:.1e}")
    if cuda:
        out["sweep"] = sweep(device, rng, say)
    return out


def sweep(device: str, rng, say) -> list[dict]:
    """Q4_K GEMV at M=1 over rows per program and warps: what to set BLOCK_N / NUM_WARPS to."""
    import torch
    from gguf import GGMLQuantizationType as T

    from moeray.stages.kernels import triton_kernels as tk

    N, K = SHAPE
    raw = torch.from_numpy(_random_blocks(T.Q4_K, N * K // 256, rng).reshape(-1)).to(device)
    x = torch.randn(1, K, device=device)
    rows = []
    for bn in (8, 16, 32, 64):
        for warps in (1, 2, 4, 8):
            ms = _time(lambda: tk.qlinear(raw, int(T.Q4_K), (N, K), x, block_n=bn, num_warps=warps), device)
            rows.append({"block_n": bn, "num_warps": warps, "ms": ms, "weight_GBps": raw.numel() / (ms * 1e-3) / 1e9})
    best = min(rows, key=lambda r: r["ms"])
    say(f"  Q4_K GEMV sweep: best BLOCK_N={best['block_n']} NUM_WARPS={best['num_warps']}: {best['ms']:.3f} ms, "
        f"{best['weight_GBps']:.0f} GB/s (default {tk.BLOCK_N}/{tk.NUM_WARPS})")
    return rows


def grouped(device: str, quick: bool, say=print) -> dict:
    """The MoE hit path of one Qwen3-30B-A3B layer on the card (128 experts in slots, top-8;
    gate / up Q4_K [768, 2048], down Q6_K [2048, 768]) at 1 and 16 tokens: a loop over the picked
    experts through QMatrix (what a CUDA stage runs today: 3 launches per expert), one
    `grouped_swiglu` call, and that call replayed from a CUDA graph. Each against the loop's result."""
    import torch
    import torch.nn.functional as F
    from gguf import GGMLQuantizationType as T

    from moeray.stages.kernels import triton_kernels as tk
    from moeray.stages.kernels.qmatmul import QMatrix

    H, Fd, S, k = (2048, 768, 128, 8) if not quick else (256, 256, 8, 2)
    rng = np.random.default_rng(1)
    kinds = {"gate": (T.Q4_K, (Fd, H)), "up": (T.Q4_K, (Fd, H)), "down": (T.Q6_K, (H, Fd))}
    stacks = {}
    for name, (qt, (n, kk)) in kinds.items():
        b = _random_blocks(qt, S * n * kk // 256, rng).reshape(S, -1)
        stacks[name] = torch.from_numpy(b).to(device)
    per_expert = [[QMatrix(stacks[name][s], kinds[name][0], kinds[name][1], "dequant") for name in kinds]
                  for s in range(S)]
    args = tuple((stacks[name], int(kinds[name][0])) for name in kinds)
    out = {"shape": {"hidden": H, "ffn": Fd, "slots": S, "k": k}, "rows": []}
    if not tk.enabled_for(torch.device(device)):
        out["note"] = "the grouped kernels run on CUDA (or under TRITON_INTERPRET=1 MOERAY_TRITON=1): only the loop here"
        say(f"  {out['note']}")
    slot_bytes = sum(int(t.shape[1]) for t in stacks.values())
    for tokens in (1, 16) if not quick else (1, 4):
        gen = torch.Generator().manual_seed(tokens)
        x = torch.randn(tokens, H, generator=gen).to(device) * 0.1
        slots = torch.stack([torch.randperm(S, generator=gen)[:k] for _ in range(tokens)]).to(device)
        weights = torch.softmax(torch.randn(tokens, k, generator=gen), -1).to(device)

        def loop():
            y = torch.zeros(tokens, H, device=device)
            for t, row in enumerate(slots.tolist()):
                for r, s in enumerate(row):
                    g, u, d = per_expert[s]
                    y[t] += weights[t, r] * d(F.silu(g(x[t:t + 1])) * u(x[t:t + 1]))[0]
            return y

        want = loop()
        fns = {"loop over experts (today)": loop}
        if tk.enabled_for(torch.device(device)):  # CUDA, or the interpreter on the CPU (tests)
            fns["grouped_swiglu"] = lambda: tk.grouped_swiglu(*args, Fd, H, x, slots, weights)
        if device.startswith("cuda"):
            graphed = tk.GraphedGroupedSwiglu(*args, Fd, H, tokens, k, device)
            fns["grouped_swiglu, CUDA graph"] = lambda: graphed(x, slots, weights)
        distinct = len(set(slots.reshape(-1).tolist()))
        for route, fn in fns.items():
            got = fn()
            err = float((got - want).abs().max() / want.abs().max())
            ms = _time(fn, device)
            gbps = distinct * slot_bytes / (ms * 1e-3) / 1e9
            out["rows"].append({"tokens": tokens, "route": route, "ms": ms, "experts_read": distinct,
                                "weight_GBps": gbps, "rel_err": err})
            say(f"  MoE layer, {tokens} token(s) x top-{k}: {route:>28}: {ms:8.3f} ms, {gbps:6.0f} GB/s of "
                f"{distinct} experts' blocks, rel err {err:.1e}")
    return out
