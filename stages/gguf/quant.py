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
from gguf import quants as gguf_quants

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


# --- codebook formats: MXFP4 and the IQ types ---------------------------------------------------
# A value is a table entry (4-bit codes into a 16-value table; 8-11-bit indices into grids of 4 or
# 8 values) times a block scale, with sign bits beside. The tables are ggml's, taken from gguf-py
# once (as float32 of the stored integers); every op after that is on the input's device. Each
# product is taken in ggml's order (scale * table value, then the sign), so results are bit-exact.

_MXFP4_VALUES = torch.tensor(gguf_quants.MXFP4.kvalues, dtype=torch.float32)  # e2m1, doubled
_IQ4_VALUES = torch.tensor(gguf_quants.IQ4_NL.kvalues, dtype=torch.float32)
_KSIGNS = torch.frombuffer(bytearray(gguf_quants.IQ2_XXS.ksigns), dtype=torch.uint8).to(torch.int32)  # 7 bits + parity
_SHIFT7 = torch.tensor([0, 7, 14, 21], dtype=torch.int64)  # four 7-bit sign indices in a uint32
_ARANGE8 = torch.arange(8, dtype=torch.int32)
_ARANGE4 = torch.arange(4, dtype=torch.int64)
_IQ1_DELTA = 0.125  # IQ1S_DELTA
_grids: dict[T, torch.Tensor] = {}


def _grid(qtype: T, device: torch.device) -> torch.Tensor:
    """ggml's codebook for `qtype` as float32 [entries, values per entry], on `device`."""
    if qtype not in _grids:
        cls = getattr(gguf_quants, qtype.name)
        cls.init_grid()
        _grids[qtype] = torch.from_numpy(np.array(cls.grid, dtype=np.float32).reshape(cls.grid_shape))
    return _on(_grids[qtype], device)


def _le(b: torch.Tensor) -> torch.Tensor:
    """[..., m] little-endian bytes -> int64 [...] (m = 2 or 4: uint16 / uint32 fields)."""
    out = b[..., 0].to(torch.int64)
    for i in range(1, b.shape[-1]):
        out = out | (b[..., i].to(torch.int64) << (8 * i))
    return out


def _signed(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """x [..., 8] with element j negated where bit j of signs [...] is set."""
    bits = (signs.to(torch.int32).unsqueeze(-1) >> _on(_ARANGE8, x.device)) & 1
    return torch.where(bits.bool(), -x, x)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, ..., k] bytes -> int64 [n, ..., 2k]: low nibbles, then high (ggml's order)."""
    return torch.stack((qs & 0x0F, qs >> 4), dim=-2).flatten(-2).to(torch.int64)


def _mxfp4(b: torch.Tensor) -> torch.Tensor:
    # The shared scale is E8M0 halved (ggml_e8m0_to_fp32_half): 2^(e-128) as float32 bits.
    e = b[:, :1].to(torch.int32)
    d = torch.where(e < 2, 0x00200000 * (e + 1), (e - 1) << 23).view(torch.float32)
    return _on(_MXFP4_VALUES, b.device)[_nibbles(b[:, 1:])].mul_(d)


def _iq4_nl(b: torch.Tensor) -> torch.Tensor:
    return _on(_IQ4_VALUES, b.device)[_nibbles(b[:, 2:])].mul_(_f16(b[:, :2]))


def _iq4_xs(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = _f16(b[:, :2])
    lo = _nibbles(b[:, 4:8]).view(n, 2, 4).transpose(1, 2).reshape(n, 8)  # sub-block 2i low, 2i+1 high nibble
    hi = (_le(b[:, 2:4]).unsqueeze(-1) >> (2 * _on(_ARANGE8, b.device))) & 3
    dl = d * ((lo | (hi << 4)) - 32).to(torch.float32)  # [n, 8]
    q = _on(_IQ4_VALUES, b.device)[_nibbles(b[:, 8:].reshape(n, 8, 16))]  # [n, 8, 32]
    return q.mul_(dl.unsqueeze(-1)).view(n, QK_K)


def _half_scale(d: torch.Tensor, s: torch.Tensor, mul: float) -> torch.Tensor:
    """d * (0.5 + s) * mul, ggml's IQ2/IQ3_XXS sub-block scale."""
    return d * (s.to(torch.float32) + 0.5) * mul


def _iq2_xxs(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    q = b[:, 2:].reshape(n, 8, 8)  # per 32 values: 4 grid indices, then a uint32 of 4x7 sign bits + 4-bit scale
    aux = _le(q[:, :, 4:])
    db = _half_scale(_f16(b[:, :2]), aux >> 28, 0.25)  # [n, 8]
    signs = _on(_KSIGNS, b.device)[(aux.unsqueeze(-1) >> _on(_SHIFT7, b.device)) & 127]  # [n, 8, 4]
    grid = _grid(T.IQ2_XXS, b.device)[q[:, :, :4].to(torch.int64)]  # [n, 8, 4, 8]
    return _signed(grid * db[..., None, None], signs).view(n, QK_K)


def _iq2_xs(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    q = _le(b[:, 2:66].reshape(n, 8, 4, 2))  # uint16: 9-bit grid index, 7-bit sign index
    sc = _nibbles(b[:, 66:74].reshape(n, 8, 1)).view(n, 8, 2)
    db = _half_scale(_f16(b[:, :2]).view(n, 1, 1), sc, 0.25).repeat_interleave(2, dim=-1)  # [n, 8, 4]
    grid = _grid(T.IQ2_XS, b.device)[q & 511]
    return _signed(grid * db.unsqueeze(-1), _on(_KSIGNS, b.device)[q >> 9]).view(n, QK_K)


def _iq2_s(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    qs, signs = b[:, 2:34].reshape(n, 8, 4), b[:, 34:66].reshape(n, 8, 4)
    qh = b[:, 66:74].to(torch.int64).unsqueeze(-1)  # two high index bits per 8 values
    idx = qs.to(torch.int64) | (((qh >> (2 * _on(_ARANGE4, b.device))) & 3) << 8)
    sc = _nibbles(b[:, 74:82].reshape(n, 8, 1)).view(n, 8, 2)
    db = _half_scale(_f16(b[:, :2]).view(n, 1, 1), sc, 0.25).repeat_interleave(2, dim=-1)
    grid = _grid(T.IQ2_S, b.device)[idx]
    return _signed(grid * db.unsqueeze(-1), signs).view(n, QK_K)


def _iq3_xxs(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    qs = b[:, 2:66].reshape(n, 8, 8).to(torch.int64)  # 8 grid indices (4 values each) per 32 values
    aux = _le(b[:, 66:98].reshape(n, 8, 4))
    db = _half_scale(_f16(b[:, :2]), aux >> 28, 0.5)
    signs = _on(_KSIGNS, b.device)[(aux.unsqueeze(-1) >> _on(_SHIFT7, b.device)) & 127]
    grid = _grid(T.IQ3_XXS, b.device)[qs].view(n, 8, 4, 8)
    return _signed(grid * db[..., None, None], signs).view(n, QK_K)


def _iq3_s(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    qs, qh = b[:, 2:66].reshape(n, 8, 8), b[:, 66:74].to(torch.int64).unsqueeze(-1)
    signs = b[:, 74:106].reshape(n, 8, 4)
    idx = qs.to(torch.int64) | (((qh >> _on(_ARANGE8, b.device)) & 1) << 8)  # 9th index bit from qh
    sc = _nibbles(b[:, 106:110].reshape(n, 4, 1)).view(n, 8)
    db = _f16(b[:, :2]) * (1 + 2 * sc).to(torch.float32)
    grid = _grid(T.IQ3_S, b.device)[idx].view(n, 8, 4, 8)
    return _signed(grid * db[..., None, None], signs).view(n, QK_K)


def _iq1(grid_idx: torch.Tensor, dl: torch.Tensor, neg: torch.Tensor, device) -> torch.Tensor:
    """dl * (grid + delta) with delta = -/+ IQ1S_DELTA; grid_idx [n, 8, 4], dl/neg broadcastable."""
    delta = torch.where(neg, -_IQ1_DELTA, _IQ1_DELTA).to(torch.float32)
    return dl.unsqueeze(-1) * (_grid(T.IQ1_S, device)[grid_idx] + delta.unsqueeze(-1))


def _iq1_s(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    qs, qh = b[:, 2:34].reshape(n, 8, 4), _le(b[:, 34:50].reshape(n, 8, 2))
    dl = _f16(b[:, :2]) * (2 * ((qh >> 12) & 7) + 1).to(torch.float32)  # [n, 8]
    idx = qs.to(torch.int64) | (((qh.unsqueeze(-1) >> (3 * _on(_ARANGE4, b.device))) & 7) << 8)
    return _iq1(idx, dl.unsqueeze(-1), (qh & 0x8000).bool().unsqueeze(-1), b.device).view(n, QK_K)


_IQ1M_SHIFTS = torch.tensor([[0, 0, 3, 3], [6, 6, 9, 9]], dtype=torch.int64)  # 3-bit scale of each 8 values


def _iq1_m(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    qs, qh = b[:, :32].reshape(n, 8, 4), b[:, 32:48].reshape(n, 8, 2)
    sc = _le(b[:, 48:56].reshape(n, 4, 2))  # four uint16: 3-bit scales, the fp16 scale in their top nibbles
    d16 = (sc[:, 0] >> 12) | ((sc[:, 1] >> 8) & 0x00F0) | ((sc[:, 2] >> 4) & 0x0F00) | (sc[:, 3] & 0xF000)
    d = _f16(torch.stack((d16 & 0xFF, d16 >> 8), dim=-1).to(torch.uint8)).view(n, 1, 1)
    s = (sc.repeat_interleave(2, dim=1).unsqueeze(-1) >> _on(_IQ1M_SHIFTS, b.device).repeat(4, 1)) & 7  # [n, 8, 4]
    nib = _nibbles(qh.unsqueeze(-1)).view(n, 8, 4)  # qh0 lo, qh0 hi, qh1 lo, qh1 hi
    idx = qs.to(torch.int64) | ((nib & 7) << 8)
    return _iq1(idx, d * (2 * s + 1).to(torch.float32), (nib & 8).bool(), b.device).view(n, QK_K)


_FAST = {T.Q8_0: _q8_0, T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q6_K: _q6_k,
         T.MXFP4: _mxfp4, T.IQ4_NL: _iq4_nl, T.IQ4_XS: _iq4_xs, T.IQ2_XXS: _iq2_xxs, T.IQ2_XS: _iq2_xs,
         T.IQ2_S: _iq2_s, T.IQ3_XXS: _iq3_xxs, T.IQ3_S: _iq3_s, T.IQ1_S: _iq1_s, T.IQ1_M: _iq1_m}


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
