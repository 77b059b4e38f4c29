"""Vectorised torch dequantisation of GGML weight formats.

Each format is a few whole-tensor integer ops (no Python loop over blocks); formats without a
fast path fall back to gguf.quants (numpy), which is the reference these match bit for bit.
Layouts follow ggml-quants.c; blocks are rows of `type_size` bytes holding `block_size` values.
Every buffer is made on the input's device: a CUDA stage dequantises its slots and trunk on the card.
"""
from __future__ import annotations

import warnings

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

QK_K = 256


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[n, 2] uint8 -> [n, 1] float32 (little-endian float16)."""
    return b.contiguous().view(torch.float16).to(torch.float32)


def _unpack_nibbles(qs: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """[n, ..., k] packed bytes -> out [n, ..., 2, k]: low nibbles, then high nibbles (ggml order).
    Writing straight into a float buffer fuses the uint8 -> float conversion into the unpacking."""
    out[..., 0, :] = qs & 0x0F
    out[..., 1, :] = qs >> 4
    return out


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, :2])
    return b[:, 2:].contiguous().view(torch.int8).to(torch.float32).mul_(d)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = _f16(b[:, :2])
    q = _unpack_nibbles(b[:, 2:], torch.empty(n, 2, 16, device=b.device)).view(n, 32)
    return q.sub_(8.0).mul_(d)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    q = _unpack_nibbles(b[:, 4:], torch.empty(n, 2, 16, device=b.device)).view(n, 32)
    return q.mul_(d).add_(m)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 packed bytes of Q4_K/Q5_K -> 8 six-bit scales and 8 six-bit mins per block."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc.to(torch.float32), mn.to(torch.float32)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    q = _unpack_nibbles(b[:, 16:].reshape(n, 4, 32), torch.empty(n, 4, 2, 32, device=b.device)).view(n, 8, 32)
    return q.mul_((d * sc).unsqueeze(-1)).sub_((dmin * mn).unsqueeze(-1)).view(n, QK_K)


_BIT_SHIFTS = torch.arange(8, dtype=torch.uint8).reshape(1, 8, 1)
_consts: dict[tuple[int, torch.device], torch.Tensor] = {}


def _on(const: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small constant on `device`, copied there once (not a host-to-device copy per call)."""
    if device.type == "cpu":
        return const
    key = (id(const), device)
    if key not in _consts:
        _consts[key] = const.to(device)
    return _consts[key]


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    qh = b[:, 16:48].reshape(n, 1, 32)
    u = _unpack_nibbles(b[:, 48:].reshape(n, 4, 32), torch.empty(n, 4, 2, 32, dtype=torch.uint8, device=b.device)).view(n, 8, 32)
    u |= ((qh >> _on(_BIT_SHIFTS, b.device)) & 1) << 4  # sub-block j takes bit j of each qh byte as its 5th bit
    q = u.to(torch.float32)
    return q.mul_((d * sc).unsqueeze(-1)).sub_((dmin * mn).unsqueeze(-1)).view(n, QK_K)


_Q6_SHIFTS = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    qh = b[:, 128:192].reshape(n, 2, 1, 32)
    scales = b[:, 192:208].contiguous().view(torch.int8).to(torch.float32)
    d = _f16(b[:, 208:210])
    u = _unpack_nibbles(b[:, :128].reshape(n, 2, 64), torch.empty(n, 2, 2, 64, dtype=torch.uint8, device=b.device)).view(n, 2, 4, 32)
    u |= ((qh >> _on(_Q6_SHIFTS, b.device)) & 3) << 4
    q = u.view(torch.int8).to(torch.float32).sub_(32.0).view(n, 16, 16)
    return q.mul_((d * scales).unsqueeze(-1)).view(n, QK_K)


_FAST = {T.Q8_0: _q8_0, T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q6_K: _q6_k}


def as_uint8_tensor(raw) -> torch.Tensor:
    if isinstance(raw, torch.Tensor):
        return raw
    with warnings.catch_warnings():
        # mmap views are read-only; we never write through them
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.asarray(raw))


def dequantize(raw: np.ndarray | torch.Tensor, ggml_type: T, shape: tuple[int, ...]) -> torch.Tensor:
    """Quantised bytes -> float32 tensor of `shape` (numpy order). Equal to gguf.quants.dequantize."""
    ggml_type = T(ggml_type)
    b = as_uint8_tensor(raw)
    if ggml_type == T.F32:
        return b.view(torch.float32).reshape(shape)
    if ggml_type == T.F16:
        return b.view(torch.float16).to(torch.float32).reshape(shape)
    if ggml_type == T.BF16:
        return b.view(torch.bfloat16).to(torch.float32).reshape(shape)
    fast = _FAST.get(ggml_type)
    block, type_size = GGML_QUANT_SIZES[ggml_type]
    if fast is not None:
        return fast(b.reshape(-1, type_size)).reshape(shape)
    from gguf.quants import dequantize as gguf_dequantize
    host = b.cpu().numpy()  # the numpy reference runs on the host; the result goes back to b's device
    if ggml_type == T.F64:
        arr = host.view(np.float64).astype(np.float32)
    else:
        arr = gguf_dequantize(host.reshape(-1, type_size), ggml_type)
    return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32)).reshape(shape).to(b.device)
