"""GB/s of the quantised matmul kernels against the memory bandwidth measured in the same run.

On CUDA: the Triton kernels of stages/triton_kernels.py (GEMV at M=1, the 16-row tiles at
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

    from moeray.stages import triton_kernels as tk
    from moeray.stages.qmatmul import QMatrix, _dequant_linear
    from moeray.stages.quant import dequantize

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

    from moeray.stages import triton_kernels as tk

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
