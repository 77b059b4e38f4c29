"""K/V rows in llama.cpp's cache types, on the torch side: writing a step's rows into a pool and
reading them back as floats, for the steps and backends that attend with torch ops.

The ggml trunk graph (stages/runtime/trunk_graph.py) writes a pool with ggml_set_rows and reads it
inside ggml_flash_attn_ext, as stored; this module writes the same bytes in the same layouts
(ggml's blocks: q8_0 a float16 scale then 32 int8 codes; q4_0 a float16 scale then 16 bytes of
4-bit pairs, value j in the low nibble of byte j and value j + 16 in its high nibble), with
ggml's CPU rounding (q8_0: codes rounded to nearest, ties to even, as its AVX2 quantiser; q4_0: its
reference, truncating x / d + 8.5), so either path can read what the other wrote, and it reads
them back by dequantising (stages/gguf/quant.py, equal to gguf.quants).
"""
from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as T

from moeray.stages.gguf.quant import dequantize

FLOAT = {"f32": torch.float32, "f16": torch.float16}
GGML_TYPE = {"f32": T.F32, "f16": T.F16, "q8_0": T.Q8_0, "q4_0": T.Q4_0}


def quantize(x: torch.Tensor, cache_type: str) -> torch.Tensor:
    """x [..., width] float -> rows of `cache_type`: float for f32 / f16, else uint8 [..., row bytes]."""
    if cache_type in FLOAT:
        return x.to(FLOAT[cache_type])
    lead, width = x.shape[:-1], x.shape[-1]
    b = x.float().reshape(-1, 32)
    if cache_type == "q8_0":
        amax = b.abs().amax(dim=1, keepdim=True)
        d = amax / 127
        inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
        codes = torch.round(b * inv).to(torch.int8).view(torch.uint8)
    elif cache_type == "q4_0":
        at = b.abs().argmax(dim=1, keepdim=True)  # the first value of the largest magnitude, its sign kept
        d = b.gather(1, at) / -8
        inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
        q = (b * inv + 8.5).to(torch.int8).clamp_(max=15).to(torch.uint8)  # truncation, as C's (int8_t)
        codes = q[:, :16] | (q[:, 16:] << 4)
    else:
        raise ValueError(f"no such cache type {cache_type!r}")
    scale = d.to(torch.float16).view(torch.uint8)  # [n, 2] little-endian float16
    return torch.cat((scale, codes), dim=1).reshape(*lead, -1)


def dequantize_rows(rows: torch.Tensor, cache_type: str, width: int) -> torch.Tensor:
    """Rows of `cache_type` [..., row bytes] (or floats) -> float32 [..., width]."""
    if cache_type in FLOAT:
        return rows.float()
    lead = rows.shape[:-1]
    return dequantize(rows.contiguous(), GGML_TYPE[cache_type], (*lead, width))
