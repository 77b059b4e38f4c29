"""Triton kernels that read GGUF blocks on the card: y = x @ W.T without a float copy of W.

The CUDA path used to expand each weight to float32 on every use and then multiply (~15x the
bytes of a Q4_K matrix through memory for a decode GEMV). Here each program dequantises its
tile of blocks in registers and multiplies it at once:

- `qlinear(data, qtype, (N, K), x)`: M <= GEMV_MAX_M rows (decode): the in-register kernel,
  one program per BLOCK_N rows of W (and per 16 rows of x when M > 1: a float32 `tl.dot` with
  IEEE products, so the result matches float32 on the CPU to rounding). Larger M (prefill): the
  same dequantiser writes a float32 tile of rows into one reused scratch buffer per device and
  cuBLAS multiplies it (the work is compute-bound there; the scratch stays bounded).
- `grouped_qlinear(stacked, qtype, (N, K), x, slots)`: row t of x times the expert held in slot
  `slots[t]` of a stacked per-layer slot tensor [S, N * row_bytes]: every (token, expert) pair of
  a decode step in one launch, grouped by expert on the card (no host loop over experts).
- `grouped_swiglu(...)`: the MoE hit path of one layer in three such launches plus the weighted
  sum: sum_r weights[:, r] * down(silu(gate x) * up x) of expert slots[:, r].

Block layouts follow ggml-quants.c (and stages/gguf/quant.py, the torch dequantiser these are tested
against through Triton's interpreter, TRITON_INTERPRET=1, on CPU tensors). Every block type is
read in 32-element segments; a program walks K 256 elements (8 segments) at a time.
Types: Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K, MXFP4 (GGML type ids 2, 3, 8, 12, 13, 14, 39).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from moeray import environment
from moeray.stages.kernels import settings

try:
    import triton
    import triton.language as tl
    TRITON_ERROR = None
except Exception as exc:  # ImportError on a CPU install without the test extra
    triton = tl = None
    TRITON_ERROR = f"{type(exc).__name__}: {exc}"

# GGML type id -> (elements per block, bytes per block). Plain ints: no gguf import needed here.
BLOCKS = {2: (32, 18), 3: (32, 20), 8: (32, 34), 12: (256, 144), 13: (256, 176), 14: (256, 210), 39: (32, 17)}
NAMES = {2: "Q4_0", 3: "Q4_1", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 39: "MXFP4"}
GEMV_MAX_M = 64  # rows of x up to which the in-register kernel runs; above: dequantise + cuBLAS
BLOCK_N = 32  # rows of W per program (decode); the device check sweeps it
NUM_WARPS = 4
SCRATCH_BYTES = 64 << 20  # the float32 tile the prefill path expands W into, per device


def available() -> bool:
    """Triton imports and a CUDA device is there (or the interpreter is on, for CPU tests)."""
    if triton is None:
        return False
    return interpreting() or torch.cuda.is_available()


def interpreting() -> bool:
    return environment.triton_interpreted()


def supports(qtype: int) -> bool:
    return int(qtype) in BLOCKS


def enabled_for(device: torch.device) -> bool:
    """Whether QMatrix on `device` multiplies through these kernels: on CUDA when triton imports
    (StageOptions.triton "off" turns it off: the torch dequantise-per-use backend); on the CPU only
    under the interpreter with "on" (the tests' way to run the wiring without a card)."""
    flag = settings.current().triton
    if triton is None or flag == "off":
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and flag == "on" and interpreting()


if triton is not None:

    @triton.jit
    def _f16(p, mask):
        """Little-endian float16 at byte pointers p -> float32."""
        lo = tl.load(p, mask=mask, other=0).to(tl.uint16)
        hi = tl.load(p + 1, mask=mask, other=0).to(tl.uint16)
        return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _u2f(q, bias: tl.constexpr):
        """Small non-negative integers q (< 2^23) as float32, minus `bias`, exactly, without the
        int-to-float conversion instruction (a quarter-rate one on the card: it would cap a 4-bit
        GEMV near half the memory bandwidth): q's bits under the exponent of 2^23, then - 2^23."""
        return (q.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + bias)

    @triton.jit
    def _k_scale_min(blk, j: tl.constexpr, mask):
        """Q4_K / Q5_K: the 6-bit scale and min of sub-block j from the 12 packed bytes at blk + 4."""
        if j < 4:
            sc = tl.load(blk + 4 + j, mask=mask, other=0) & 63
            mn = tl.load(blk + 8 + j, mask=mask, other=0) & 63
        else:
            lo = tl.load(blk + 8 + j, mask=mask, other=0)
            sc = (lo & 15) | ((tl.load(blk + j, mask=mask, other=0) >> 6) << 4)
            mn = (lo >> 4) | ((tl.load(blk + 4 + j, mask=mask, other=0) >> 6) << 4)
        return _u2f(sc, 0.0), _u2f(mn, 0.0)

    @triton.jit
    def _segment(QT: tl.constexpr, blk, s: tl.constexpr, l, mask):
        """Float32 values of segment s (elements 32s .. 32s+31) of the blocks at blk [BN, 1]; l is
        arange(32)[None, :]. Returns [BN, 32]."""
        if QT == 8:  # Q8_0: d, 32 x int8
            d = _f16(blk, mask)
            q = _u2f(tl.load(blk + 2 + l, mask=mask, other=0) ^ 0x80, 128.0)  # int8 as (q + 128) - 128
            w = q * d
        elif QT == 2:  # Q4_0: d, 16 bytes; element l < 16 is byte l's low nibble, else byte l-16's high
            d = _f16(blk, mask)
            b = tl.load(blk + 2 + (l % 16), mask=mask, other=0)
            w = _u2f(tl.where(l < 16, b & 15, b >> 4), 8.0) * d
        elif QT == 3:  # Q4_1: d, m, 16 bytes
            d = _f16(blk, mask)
            m = _f16(blk + 2, mask)
            b = tl.load(blk + 4 + (l % 16), mask=mask, other=0)
            w = _u2f(tl.where(l < 16, b & 15, b >> 4), 0.0) * d + m
        elif QT == 12:  # Q4_K: d, dmin, 12 scale bytes, 128 bytes: sub-blocks 2c, 2c+1 share bytes 32c..
            d = _f16(blk, mask)
            dmin = _f16(blk + 2, mask)
            sc, mn = _k_scale_min(blk, s, mask)
            b = tl.load(blk + 16 + (s // 2) * 32 + l, mask=mask, other=0)
            if s % 2 == 0:
                q = _u2f(b & 15, 0.0)
            else:
                q = _u2f(b >> 4, 0.0)
            w = q * (d * sc) - dmin * mn
        elif QT == 13:  # Q5_K: as Q4_K, plus bit s of qh[l] (bytes 16..48) as the 5th bit
            d = _f16(blk, mask)
            dmin = _f16(blk + 2, mask)
            sc, mn = _k_scale_min(blk, s, mask)
            b = tl.load(blk + 48 + (s // 2) * 32 + l, mask=mask, other=0)
            if s % 2 == 0:
                q = b & 15
            else:
                q = b >> 4
            h = (tl.load(blk + 16 + l, mask=mask, other=0) >> s) & 1
            w = _u2f(q | (h << 4), 0.0) * (d * sc) - dmin * mn
        elif QT == 39:  # MXFP4: an E8M0 exponent, 16 bytes of e2m1 codes (ggml's table: doubled values)
            e = tl.load(blk, mask=mask, other=0).to(tl.int32)
            # ggml_e8m0_to_fp32_half: 2^(e-128) as float32 bits (denormal for e < 2)
            d = tl.where(e < 2, 0x00200000 * (e + 1), (e - 1) << 23).to(tl.float32, bitcast=True)
            b = tl.load(blk + 1 + (l % 16), mask=mask, other=0)
            c = tl.where(l < 16, b & 15, b >> 4).to(tl.int32)
            m = c & 7  # 0, 1, 2, 3, 4, 6, 8, 12 for m = 0..7
            v = _u2f(tl.where(m < 4, m, (2 + (m & 1)) << ((m >> 1) - 1)), 0.0)
            w = tl.where(c >= 8, -v, v) * d
        else:  # Q6_K (14): ql 128, qh 64, 16 int8 scales, d at 208; segment s: half s // 4, quarter s % 4
            b = tl.load(blk + (s // 4) * 64 + (s % 2) * 32 + l, mask=mask, other=0)
            if s % 4 < 2:
                lo = b & 15
            else:
                lo = b >> 4
            hi = (tl.load(blk + 128 + (s // 4) * 32 + l, mask=mask, other=0) >> (2 * (s % 4))) & 3
            q = _u2f(lo | (hi << 4), 32.0)
            sc = _u2f(tl.load(blk + 192 + 2 * s + l // 16, mask=mask, other=0) ^ 0x80, 128.0)  # int8 scales
            d = _f16(blk + 208, mask)
            w = q * (d * sc)
        return w

    @triton.jit
    def _qmm_kernel(w_ptr, x_ptr, y_ptr, slot_ptr, M, N, K, row_bytes, slot_bytes, stride_xm, stride_ym,
                    QT: tl.constexpr, QK: tl.constexpr, TS: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr,
                    GROUPED: tl.constexpr):
        """y[m, n] = sum_k x[m, k] W[n, k]. BM == 1: one row of x per program (GEMV; GROUPED: W is
        the slot slots[m] of a stacked tensor). BM > 1: BM rows of x per program through tl.dot."""
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        rn = pid_n * BN + tl.arange(0, BN)
        nmask = (rn < N)[:, None]
        base = w_ptr
        if GROUPED:
            base = w_ptr + tl.load(slot_ptr + pid_m).to(tl.int64) * slot_bytes
        rows = base + rn.to(tl.int64)[:, None] * row_bytes  # [BN, 1] byte pointers
        l = tl.arange(0, 32)[None, :]
        if BM == 1:
            acc = tl.zeros((BN, 32), dtype=tl.float32)  # reduced once at the end, not per segment
            xrow = x_ptr + pid_m.to(tl.int64) * stride_xm
        else:
            rm = pid_m * BM + tl.arange(0, BM)
            mmask = (rm < M)[:, None]
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            xrows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
        for it in range(0, tl.cdiv(K, 256)):
            for s in tl.static_range(8):
                k0 = it * 256 + s * 32
                # a 32-block type's K need not be a multiple of 256 (a tensor, not a scalar: the
                # interpreter refuses a scalar mask and a tensor mixed)
                kok = (rn * 0 + k0 < K)[:, None]
                blk = rows + (k0 // QK) * TS
                w = _segment(QT, blk, s % (QK // 32), l, nmask & kok)
                kx = k0 + l < K
                if BM == 1:
                    xv = tl.load(xrow + k0 + l, mask=kx, other=0.0)  # [1, 32]
                    acc += w * xv
                else:
                    xv = tl.load(xrows + k0 + l, mask=mmask & kx, other=0.0)  # [BM, 32]
                    acc += tl.dot(xv, tl.trans(w), input_precision="ieee")
        if BM == 1:
            tl.store(y_ptr + pid_m.to(tl.int64) * stride_ym + rn, tl.sum(acc, axis=1), mask=rn < N)
        else:
            tl.store(y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :], acc, mask=mmask & (rn < N)[None, :])

    @triton.jit
    def _dequant_kernel(w_ptr, out_ptr, N, K, row_bytes, QT: tl.constexpr, QK: tl.constexpr, TS: tl.constexpr,
                        BN: tl.constexpr):
        """out[n, k] = W[n, k] as float32, BN rows x 256 columns per program."""
        rn = tl.program_id(0) * BN + tl.arange(0, BN)
        nmask = (rn < N)[:, None]
        it = tl.program_id(1)
        rows = w_ptr + rn.to(tl.int64)[:, None] * row_bytes
        l = tl.arange(0, 32)[None, :]
        out_rows = out_ptr + rn.to(tl.int64)[:, None] * K
        for s in tl.static_range(8):
            k0 = it * 256 + s * 32
            kok = (rn * 0 + k0 < K)[:, None]
            w = _segment(QT, rows + (k0 // QK) * TS, s % (QK // 32), l, nmask & kok)
            tl.store(out_rows + k0 + l, w, mask=nmask & (k0 + l < K))


def row_bytes(qtype: int, k: int) -> int:
    block, size = BLOCKS[int(qtype)]
    return k // block * size


def _check(data: torch.Tensor, qtype: int, shape: tuple[int, int]) -> tuple[int, int, int]:
    if triton is None:
        raise RuntimeError(f"triton is not importable here ({TRITON_ERROR})")
    qtype = int(qtype)
    if qtype not in BLOCKS:
        raise ValueError(f"GGML type {qtype}: no Triton kernel (have {', '.join(NAMES.values())})")
    N, K = int(shape[0]), int(shape[1])
    if K % BLOCKS[qtype][0]:
        raise ValueError(f"{NAMES[qtype]} [{N}, {K}]: K is not a multiple of the block size {BLOCKS[qtype][0]}")
    return qtype, N, K


def _launch_gemm(data, qtype, N, K, x, y, slots=None, slot_bytes=0, block_n=None, num_warps=None):
    QK, TS = BLOCKS[qtype]
    M = x.shape[0]
    bn = block_n or BLOCK_N
    grouped = slots is not None
    bm = 1 if (M == 1 or grouped) else 16
    grid = (triton.cdiv(N, bn), M if bm == 1 else triton.cdiv(M, bm))
    _qmm_kernel[grid](data, x, y, slots if grouped else data, M, N, K, row_bytes(qtype, K), slot_bytes,
                      x.stride(0), y.stride(0), QT=qtype, QK=QK, TS=TS, BN=bn, BM=bm, GROUPED=grouped,
                      num_warps=num_warps or NUM_WARPS)
    return y


def dequantize(data: torch.Tensor, qtype: int, shape: tuple[int, int], out: torch.Tensor | None = None) -> torch.Tensor:
    """W as float32 [N, K] (into `out` when given: a view of a reused scratch buffer)."""
    qtype, N, K = _check(data, qtype, shape)
    QK, TS = BLOCKS[qtype]
    out = torch.empty(N, K, dtype=torch.float32, device=data.device) if out is None else out
    bn = 16
    # No FMA contraction: the products and sums round as the torch dequantiser's do (bit for bit)
    _dequant_kernel[(triton.cdiv(N, bn), triton.cdiv(K, 256))](data, out, N, K, row_bytes(qtype, K),
                                                              QT=qtype, QK=QK, TS=TS, BN=bn, num_warps=4,
                                                              enable_fp_fusion=False)
    return out


_scratch: dict[torch.device, torch.Tensor] = {}


def _scratch_for(device: torch.device, n: int) -> torch.Tensor:
    buf = _scratch.get(device)
    if buf is None or buf.numel() < n:
        buf = _scratch[device] = torch.empty(n, dtype=torch.float32, device=device)
    return buf


def qlinear(data: torch.Tensor, qtype: int, shape: tuple[int, int], x: torch.Tensor, *,
            gemv_max_m: int | None = None, block_n: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """x [M, K] float32 @ W.T -> [M, N] float32, W the GGUF blocks `data` (uint8, N * row_bytes)."""
    qtype, N, K = _check(data, qtype, shape)
    x = x.contiguous()
    if x.dtype != torch.float32:
        x = x.float()
    M = x.shape[0]
    y = torch.empty(M, N, dtype=torch.float32, device=x.device)
    if M == 0:
        return y
    if M <= (GEMV_MAX_M if gemv_max_m is None else gemv_max_m):
        return _launch_gemm(data, qtype, N, K, x, y, block_n=block_n, num_warps=num_warps)
    # Prefill: expand a block of rows at a time into the reused scratch, then cuBLAS.
    rows = max(16, min(N, SCRATCH_BYTES // (4 * K)) // 16 * 16)
    buf = _scratch_for(x.device, rows * K)
    per_row = data.view(N, -1)
    for r in range(0, N, rows):
        n = min(rows, N - r)
        w = dequantize(per_row[r:r + n], qtype, (n, K), out=buf[:n * K].view(n, K))
        if n == N:
            torch.matmul(x, w.T, out=y)
        else:
            y[:, r:r + n] = F.linear(x, w)
    return y


def grouped_qlinear(stacked: torch.Tensor, qtype: int, shape: tuple[int, int], x: torch.Tensor,
                    slots: torch.Tensor) -> torch.Tensor:
    """Row t of x [T, K] times W_{slots[t]}: stacked uint8 [S, N * row_bytes] (one slot a row; a
    column slice of a wider buffer works as it is, its row stride is the slots' stride: the
    experts path keeps a slot's gate | up | down back to back in one row, cache/slot_store.py);
    -> [T, N] float32, one launch for every row whatever expert it needs."""
    qtype, N, K = _check(stacked, qtype, shape)
    if stacked.dim() != 2 or stacked.shape[1] != N * row_bytes(qtype, K) or stacked.stride(1) != 1:
        raise ValueError(f"stacked slots {tuple(stacked.shape)}: expected [S, {N * row_bytes(qtype, K)}] "
                         f"for {NAMES[qtype]} [{N}, {K}]")
    x = x.contiguous().float()
    y = torch.empty(x.shape[0], N, dtype=torch.float32, device=x.device)
    if x.shape[0] == 0:
        return y
    slots = slots.to(device=x.device, dtype=torch.int32).contiguous()
    return _launch_gemm(stacked, qtype, N, K, x, y, slots=slots, slot_bytes=stacked.stride(0))


def grouped_swiglu(gate: tuple[torch.Tensor, int], up: tuple[torch.Tensor, int], down: tuple[torch.Tensor, int],
                   ffn: int, hidden: int, x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The MoE hit path of one layer on the card: x [T, H], slots / weights [T, k] (slot index of
    each pick in the layer's stacked slot tensors, its routing weight) ->
    sum_r weights[:, r] * down_s(silu(gate_s x) * up_s x), s = slots[:, r]. Each of gate / up /
    down is (stacked uint8 [S, bytes per expert matrix], GGML type); gate / up are [ffn, hidden],
    down [hidden, ffn]. Three kernel launches for every pick of the layer, no host loop, no host
    sync: the experts path (one stacked slot tensor per layer and kind) calls it once per layer."""
    T, k = slots.shape
    flat = slots.reshape(-1).to(x.device)
    # Picks sorted by slot: consecutive programs read the same expert's blocks (from L2 after the
    # first), and the result is put back in pick order before the weighted sum.
    order = torch.argsort(flat, stable=True)
    xs, fs = x[order // k], flat[order]
    g = grouped_qlinear(gate[0], gate[1], (ffn, hidden), xs, fs)
    u = grouped_qlinear(up[0], up[1], (ffn, hidden), xs, fs)
    ys = grouped_qlinear(down[0], down[1], (hidden, ffn), F.silu(g) * u, fs)  # [T * k, H], sorted
    y = torch.empty_like(ys)
    y[order] = ys
    return torch.bmm(weights.to(y.dtype).view(T, 1, k), y.view(T, k, hidden)).view(T, hidden)


class GraphedGroupedSwiglu:
    """`grouped_swiglu` of one layer captured once into a CUDA graph for a fixed number of tokens
    and picks (a decode step's shapes repeat): a call copies x, slots and weights into the graph's
    static inputs and replays its launches (sort, 3 grouped GEMVs, SiLU, scatter, weighted sum) in
    one go, without Python or launch overhead per kernel. CUDA only. The device check measures it
    against the eager call; the stage's decode step does not use it yet (it routes on the host)."""

    def __init__(self, gate, up, down, ffn: int, hidden: int, tokens: int, k: int, device):
        self.args = (gate, up, down, ffn, hidden)
        self.x = torch.zeros(tokens, hidden, dtype=torch.float32, device=device)
        self.slots = torch.zeros(tokens, k, dtype=torch.int64, device=device)  # slot 0: always valid
        self.weights = torch.zeros(tokens, k, dtype=torch.float32, device=device)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # compile and warm up outside the capture
            grouped_swiglu(*self.args, self.x, self.slots, self.weights)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = grouped_swiglu(*self.args, self.x, self.slots, self.weights)

    def __call__(self, x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        self.x.copy_(x)
        self.slots.copy_(slots)
        self.weights.copy_(weights)
        self.graph.replay()
        return self.out  # the graph's output buffer: overwritten by the next call
