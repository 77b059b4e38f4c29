"""The card's GGUF kernels (stages/kernels/triton_kernels.py) run on the CPU through Triton's interpreter
(TRITON_INTERPRET=1) against the torch dequantiser (stages/gguf/quant.py, itself equal to gguf's numpy
reference): dequantisation bit for bit, the decode GEMV, the small-batch tl.dot path, the prefill
backend (dequantise into the scratch, then a float matmul) and the grouped MoE hit path against a
per-expert loop. Shapes are tiny: the interpreter runs each program in Python (seconds in all).
Skipped, with the reason, where triton is not installed (it is in the `test` extra)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from moeray.stages.gguf.quant import dequantize

pytest.importorskip("triton", reason="triton is not installed (pip install '.[test]')")

from test_device_check import NO_CUDA, _blocks  # noqa: E402  random blocks with sane scales

KERNEL_TYPES = (T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K, T.Q5_K, T.Q6_K, T.MXFP4)

# Triton decides at decoration time, its own library included, whether a kernel is interpreted:
# TRITON_INTERPRET must be set before triton is first imported. So the kernel tests run in a
# child pytest over this file with it set (one child, seconds), and the parent reports its result.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.slow  # a child pytest through Triton's interpreter
def test_kernels_in_triton_interpreter():
    if INTERPRETED:
        pytest.skip("this is the child run: the tests below are the kernel checks")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__],
                          env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True,
                          timeout=600, cwd=Path(__file__).parent)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout


interpreted = pytest.mark.skipif(not INTERPRETED, reason="run by test_kernels_in_triton_interpreter")


@pytest.fixture(scope="module")
def tk():
    from moeray.stages.kernels import triton_kernels as mod

    old = mod.BLOCK_N
    mod.BLOCK_N = 64  # fewer programs: the interpreter's cost is per program
    yield mod
    mod.BLOCK_N = old


def _matrix(qtype: T, n: int, k: int, seed: int = 0) -> torch.Tensor:
    block, _ = GGML_QUANT_SIZES[qtype]
    return _blocks(qtype, n * k // block, seed=seed)


def _k(qtype: T) -> int:
    # a 32-block type gets a K that is not a multiple of 256 (the kernels' step): the tail is masked
    return 256 if GGML_QUANT_SIZES[qtype][0] == 256 else 96


@interpreted
@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
def test_dequantize_kernel_equals_torch_bit_for_bit(tk, qtype):
    N, K = 20, _k(qtype)  # N not a multiple of the programs' rows: masked rows
    raw = _matrix(qtype, N, K, seed=int(qtype))
    assert torch.equal(tk.dequantize(raw, int(qtype), (N, K)), dequantize(raw, qtype, (N, K)))


@interpreted
@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
def test_gemv_small_batch_and_prefill_routes_equal_float32(tk, qtype):
    N, K = 70, _k(qtype)  # 2 programs of 64 rows, the second part masked
    raw = _matrix(qtype, N, K, seed=7 + int(qtype))
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(1))
    want = x @ dequantize(raw, qtype, (N, K)).T
    scale = want.abs().max()
    gemv = tk.qlinear(raw, int(qtype), (N, K), x[:1])  # M = 1: the in-register GEMV
    small = tk.qlinear(raw, int(qtype), (N, K), x)  # M = 5: 16-row tiles through tl.dot (IEEE float32)
    prefill = tk.qlinear(raw, int(qtype), (N, K), x, gemv_max_m=0)  # dequantise into the scratch + matmul
    assert gemv.shape == (1, N) and small.shape == (5, N)
    assert (gemv - want[:1]).abs().max() <= 1e-5 * scale  # float32 sums in another order, nothing more
    assert (small - want).abs().max() <= 1e-5 * scale
    assert (prefill - want).abs().max() <= 1e-5 * scale


@interpreted
def test_prefill_scratch_in_row_blocks(tk, monkeypatch):
    """A weight larger than the scratch is expanded a block of rows at a time: the same product."""
    qtype, N, K = T.Q4_K, 40, 256
    raw = _matrix(qtype, N, K, seed=3)
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(2))
    monkeypatch.setattr(tk, "SCRATCH_BYTES", 16 * 4 * K)  # 16 rows at a time: 16 + 16 + 8
    got = tk.qlinear(raw, int(qtype), (N, K), x, gemv_max_m=0)
    want = x @ dequantize(raw, qtype, (N, K)).T
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


@interpreted
@pytest.mark.parametrize("qtype", (T.Q4_K, T.Q8_0), ids=lambda t: t.name)
def test_grouped_swiglu_equals_a_loop_over_experts(tk, qtype):
    """The MoE hit path of a layer in one call: 2 tokens' picks over 2 slots (a slot picked twice
    by one token and by the other too) against expert-by-expert float32. The slots are laid out
    as the experts path keeps them (cache/slot_store.py, issue 22): slot s is row s of one buffer,
    gate | up | down blocks back to back; each kind is a column slice of it (a strided view)."""
    H, Fd = (256, 256) if qtype == T.Q4_K else (64, 96)
    S, k, n = 2, 2, 2
    mats = {name: [_matrix(qtype, *shape, seed=10 * i + s) for s in range(S)]
            for i, (name, shape) in enumerate((("gate", (Fd, H)), ("up", (Fd, H)), ("down", (H, Fd))))}
    rows = torch.stack([torch.cat([mats["gate"][s], mats["up"][s], mats["down"][s]]) for s in range(S)])
    sizes = [mats[name][0].numel() for name in ("gate", "up", "down")]
    offs = [0, sizes[0], sizes[0] + sizes[1]]
    kinds = {name: rows[:, o:o + n_] for name, o, n_ in zip(("gate", "up", "down"), offs, sizes)}
    assert not kinds["up"].is_contiguous() and kinds["up"].stride(0) == rows.shape[1]
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(n, H, generator=gen) * 0.1
    slots = torch.tensor([[0, 1], [1, 1]])
    weights = torch.rand(n, k, generator=gen)
    got = tk.grouped_swiglu((kinds["gate"], int(qtype)), (kinds["up"], int(qtype)), (kinds["down"], int(qtype)),
                            Fd, H, x, slots, weights)
    deq = {name: [dequantize(t[s], qtype, (Fd, H) if name != "down" else (H, Fd)) for s in range(S)]
           for name, t in kinds.items()}
    want = torch.zeros(n, H)
    for t in range(n):
        for r in range(k):
            s = int(slots[t, r])
            h = F.silu(x[t] @ deq["gate"][s].T) * (x[t] @ deq["up"][s].T)
            want[t] += weights[t, r] * (h @ deq["down"][s].T)
    assert got.shape == (n, H)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


@interpreted
def test_grouped_qlinear_refuses_a_wrong_stack(tk):
    raw = torch.stack([_matrix(T.Q8_0, 4, 64)] * 2)
    with pytest.raises(ValueError, match=r"expected \[S, 136\]"):
        tk.grouped_qlinear(raw, int(T.Q8_0), (4, 32), torch.zeros(1, 32), torch.zeros(1, dtype=torch.int64))


@interpreted
def test_a_type_without_a_kernel_is_one_clear_error(tk):
    with pytest.raises(ValueError, match="no Triton kernel"):
        tk.qlinear(torch.zeros(64, dtype=torch.uint8), int(T.Q2_K), (1, 256), torch.zeros(1, 256))
    assert not tk.supports(int(T.Q2_K)) and all(tk.supports(int(t)) for t in KERNEL_TYPES)


@interpreted
def test_qmatrix_multiplies_through_the_kernels_where_enabled(tk, monkeypatch):
    """QMatrix's CUDA backend, run here on CPU tensors through the interpreter (triton "on" is
    the tests' switch; on a card "auto" turns it on): same product, and the backend line says so."""
    from moeray.stages.kernels import backend, settings
    from moeray.stages.kernels.backend import backend_line
    from moeray.stages.kernels.qmatmul import QMatrix

    raw = _matrix(T.Q6_K, 8, 256, seed=5)
    w = QMatrix(raw, T.Q6_K, (8, 256), "dequant")
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(6))
    calls = []
    monkeypatch.setattr(tk, "qlinear", lambda *a, **kw: calls.append(a[1]) or tk._launch_gemm(
        a[0], a[1], 8, 256, a[3], torch.empty(2, 8)))
    settings.update(triton="on")
    got = w(x)
    assert calls == [int(T.Q6_K)] and "triton" in backend_line("dequant", torch.device("cpu"))
    assert (got - x @ w.dequantize().T).abs().max() <= 1e-5 * got.abs().max()
    settings.update(triton="off")  # off: the torch dequantiser, as on a card without triton
    assert torch.allclose(w(x), got, rtol=1e-5, atol=1e-5) and len(calls) == 1
    assert "torch dequantise" in backend_line("dequant", torch.device("cpu")) and backend._card_kernels(
        torch.device("cpu")) is None


# ---------------------------------------------------------------- on a GPU (the compiled kernels)


@pytest.mark.cuda
@pytest.mark.skipif(INTERPRETED or not torch.cuda.is_available(), reason=NO_CUDA)
@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
def test_cuda_kernels_equal_the_cpu_dequantiser(qtype):
    from moeray.stages.kernels import triton_kernels as tk

    N, K = 300, 2 * _k(qtype) + (32 if GGML_QUANT_SIZES[qtype][0] == 32 else 0)
    raw = _matrix(qtype, N, K, seed=int(qtype))
    want_w = dequantize(raw, qtype, (N, K))
    assert torch.equal(tk.dequantize(raw.cuda(), int(qtype), (N, K)).cpu(), want_w)
    for m in (1, 5, 16, 100):
        x = torch.randn(m, K, generator=torch.Generator().manual_seed(m))
        want = x.double() @ want_w.double().T
        got = tk.qlinear(raw.cuda(), int(qtype), (N, K), x.cuda()).cpu().double()
        assert (got - want).abs().max() <= 1e-5 * want.abs().max(), m


@pytest.mark.cuda
@pytest.mark.skipif(INTERPRETED or not torch.cuda.is_available(), reason=NO_CUDA)
def test_cuda_graph_of_the_grouped_hit_path_equals_the_eager_call():
    from moeray.stages.kernels import triton_kernels as tk

    H, Fd, S, k, n = 512, 256, 4, 2, 3
    stacks = [(torch.stack([_matrix(T.Q4_K, *shape, seed=10 * i + s) for s in range(S)]).cuda(), int(T.Q4_K))
              for i, shape in enumerate(((Fd, H), (Fd, H), (H, Fd)))]
    graphed = tk.GraphedGroupedSwiglu(*stacks, Fd, H, n, k, "cuda")
    for seed in (1, 2):  # replayed with new inputs each time
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(n, H, generator=gen).cuda()
        slots = torch.randint(0, S, (n, k), generator=gen).cuda()
        w = torch.rand(n, k, generator=gen).cuda()
        eager = tk.grouped_swiglu(*stacks, Fd, H, x, slots, w)
        assert torch.equal(graphed(x, slots, w), eager)


# ---------------------------------------------------------------- compiled for Hopper, no GPU needed


def _compile_for_sm90(tk, qtype: T, bm: int) -> str:
    """PTX of the matmul kernel for an H100/H200 (sm_90), built ahead of time with the integer
    arguments marked divisible by 16 as Triton marks them at launch for these shapes."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import triton

    qk, ts = tk.BLOCKS[int(qtype)]
    sig = {"w_ptr": "*u8", "x_ptr": "*fp32", "y_ptr": "*fp32", "slot_ptr": "*i32", "M": "i32", "N": "i32",
           "K": "i32", "row_bytes": "i32", "slot_bytes": "i32", "stride_xm": "i32", "stride_ym": "i32",
           **{k: "constexpr" for k in ("QT", "QK", "TS", "BN", "BM", "GROUPED")}}
    src = ASTSource(fn=tk._qmm_kernel, signature=sig,
                    constexprs={"QT": int(qtype), "QK": qk, "TS": ts, "BN": 32, "BM": bm, "GROUPED": False},
                    attrs={(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 6, 7, 9, 10)})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]


@pytest.mark.skipif(INTERPRETED, reason="compiles the kernels: the parent run does it")
def test_kernels_compile_for_hopper_without_int_to_float_conversions():
    """Built for sm_90 here (Triton's bundled ptxas, no GPU): the Q4_K GEMV reads its 4-bit codes
    in 16-byte loads and no kernel converts codes with cvt (a quarter-rate instruction on the
    card; the kernels build floats from the codes' bits instead); the 16-row tiles compile too."""
    from moeray.stages.kernels import triton_kernels as tk

    gemv = _compile_for_sm90(tk, T.Q4_K, 1)
    assert "ld.global.v4.b32" in gemv  # the 128 code bytes of a block: 16-byte vector loads
    tiles = _compile_for_sm90(tk, T.Q6_K, 16)
    for ptx in (gemv, tiles):
        assert "cvt.rn.f32.u" not in ptx and "cvt.rn.f32.s" not in ptx
