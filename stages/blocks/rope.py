"""Rotary position embeddings, the variants the architectures share: full or partial, "normal"
(adjacent pairs) or "neox" (halves), unscaled, linear or YaRN.

"normal" rotates (x[2j], x[2j+1]): llama.cpp's rope for llama, whose GGUF q/k rows the converter
permuted so that this equals HF's rotate-half (and DeepSeek's interleaved rope as stored).
"neox" rotates (x[j], x[j + d/2]) as HF does for qwen. A partial rope (GLM: rope.dimension_count
< head_dim) rotates the first `dim` values of each head and passes the rest through, as both
transformers and ggml's rope_ext do.

YaRN (DeepSeek-V3, Kimi-K2, gpt-oss) follows transformers' `_compute_yarn_parameters` and ggml's
rope_yarn, which agree: frequencies blend interpolated (theta / factor) and original ones by a
linear ramp between the correction dims of beta_fast and beta_slow rotations at the original
context, and cos/sin are scaled by an attention factor (`yarn_attn_factor`, from
stages/arch/base.py yarn_mscale).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moeray.stages.arch.config import ModelConfig


@dataclass(frozen=True)
class Yarn:
    factor: float
    original_context: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attn_factor: float = 1.0  # cos and sin are multiplied by it
    truncate: bool = True  # round the correction dims outwards (ggml always does; gpt-oss's HF config does not)

    def inv_freq(self, dim: int, theta: float, device="cpu") -> torch.Tensor:
        def corr_dim(rotations: float) -> float:
            return dim * math.log(self.original_context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = corr_dim(self.beta_fast), corr_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        base = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim))
        ramp = ((torch.arange(dim // 2, dtype=torch.float64, device=device) - low) / max(high - low, 0.001)).clamp(0, 1)
        keep = 1 - ramp  # 1: the original frequency (fast dims), 0: interpolated (slow dims)
        return base / self.factor * (1 - keep) + base * keep


class RoPE:
    """Rotary embedding over the first `dim` values of each head (all of them unless partial)."""

    def __init__(self, dim: int, theta: float, style: str, scale: float = 1.0, device="cpu",
                 yarn: Yarn | None = None):
        if style not in ("normal", "neox"):
            raise ValueError(f"unknown rope style {style!r}")
        self.style, self.dim = style, dim
        self.scale = 1.0 if yarn is not None else scale  # linear scaling divides positions
        self.mscale = yarn.attn_factor if yarn is not None else 1.0
        if yarn is not None:
            self.inv_freq = yarn.inv_freq(dim, theta, device)
        else:
            self.inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim))

    @classmethod
    def from_config(cls, cfg: ModelConfig, device="cpu") -> "RoPE":
        yarn = None
        if cfg.rope_scaling == "yarn":
            yarn = Yarn(cfg.rope_scale, cfg.rope_orig_context, cfg.yarn_beta_fast, cfg.yarn_beta_slow,
                        cfg.yarn_attn_factor, cfg.yarn_truncate)
        return cls(cfg.rope_dim or cfg.head_dim, cfg.rope_theta, cfg.rope_style, cfg.rope_scale, device, yarn)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """[N] positions -> cos, sin of shape [N, 1, dim/2] (broadcast over heads), and for the
        "normal" style the same rotation as complex numbers cos + i·sin (made once per step)."""
        angles = (positions.to(torch.float64) / self.scale).unsqueeze(-1) * self.inv_freq
        cos, sin = angles.cos(), angles.sin()
        if self.mscale != 1.0:
            cos, sin = cos * self.mscale, sin * self.mscale
        cos, sin = cos.float().unsqueeze(1), sin.float().unsqueeze(1)
        return cos, sin, torch.complex(cos, sin) if self.style == "normal" else None

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              rot: torch.Tensor | None = None) -> torch.Tensor:
        """x [N, heads, D] with D >= dim: the first `dim` values rotated, the rest passed through."""
        if x.shape[-1] != self.dim:
            return torch.cat((self.apply(x[..., :self.dim], cos, sin, rot), x[..., self.dim:]), dim=-1)
        if self.style == "normal":
            if rot is not None:  # adjacent pairs are complex numbers: one multiply rotates them all
                pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))  # [N, heads, dim/2]
                return torch.view_as_real(pairs * rot).flatten(-2)
            x0, x1 = x[..., 0::2], x[..., 1::2]
            return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)
        half = self.dim // 2
        x0, x1 = x[..., :half], x[..., half:]
        return torch.cat((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
