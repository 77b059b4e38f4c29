"""The Hadamard rotation llama.cpp gives K and V rows before it quantises them (its attn_rot_k /
attn_rot_v, llama-kv-cache.cpp, ggml-org/llama.cpp PR 21038), so that a row kept as q8_0 / q4_0
loses what llama.cpp's loses.

A quantised block keeps 32 values at one scale: one large value (an outlier channel, common in
keys) leaves the rest of its block a few codes. Rotating each head's row by an orthonormal
Walsh-Hadamard matrix H first spreads every value over all of them, so the blocks quantise with
far less error (on the default model, q4_0 K+V perplexity +23% of f16 unturned, +9% turned, as
llama.cpp's: docs/kv-cache.md). Attention is unchanged by it: H is symmetric and H H = I, so
q.k = (H q).(H k), and sum p_j H v_j = H o, turned back by H after attention.

The rule is llama.cpp's, so both engines store the same rows:

- K: rotated where its type is quantised and its rows are a multiple of 64 wide, in blocks of the
  largest power of two (from 64) that divides the row: a head of 64 -> 64, 128 -> 128, 256 -> 256;
  MLA's latent row of 576 (512 + 64) -> 64. The query is rotated the same way.
- V: rotated where its type is quantised and its rows are a multiple of 64 wide, in blocks of 64
  (llama.cpp found smaller blocks better for V); attention's output is rotated back.
- f32 / f16 rows are never rotated (a float row loses nothing to a large value).

The trunk graph rotates with ggml's mul_mat under GGML_HINT_SRC0_IS_HADAMARD (a fast
Walsh-Hadamard transform, as llama.cpp does); the torch path rotates a row before it quantises it
and after it dequantises it (`rotate`), so it attends over the rows unrotated and both paths read
what the other wrote. MLA's value (the latent's first 512) is a whole number of 64-blocks of the
rotated row, so it comes out rotated too, and is turned back the same way.
"""
from __future__ import annotations

import functools

import torch

QUANTISED = ("q8_0", "q4_0")
MIN_BLOCK = 64


def rotation(cache_type: str, width: int, kind: str) -> int:
    """The Hadamard block a row of `width` values in `cache_type` is rotated by before it is
    stored (kind "k": keys, also MLA's latent; "v": values), or 0: stored as it is."""
    if cache_type not in QUANTISED or width % MIN_BLOCK:
        return 0
    if kind == "v":
        return MIN_BLOCK
    n = MIN_BLOCK
    while width % (2 * n) == 0:
        n *= 2
    return n


@functools.lru_cache(maxsize=None)
def hadamard(n: int) -> torch.Tensor:
    """The orthonormal Walsh-Hadamard matrix of order n (a power of two), float32 [n, n], in
    Sylvester's order (llama.cpp's ggml_gen_hadamard; ggml's fast transform computes x H): symmetric,
    its own inverse. One tensor per order for the process: the trunk graph points at it."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Hadamard matrix needs a power-of-two order, not {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return (h / n ** 0.5).float().contiguous()


def rotate(x: torch.Tensor, n: int) -> torch.Tensor:
    """x [..., width] with each run of n values turned by H (n = 0: x itself). Its own inverse."""
    if not n:
        return x
    shape = x.shape
    h = hadamard(n).to(device=x.device, dtype=torch.float32)
    return (x.float().reshape(-1, n) @ h).reshape(shape)
