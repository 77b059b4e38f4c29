"""The shared RoPE variants against transformers' own rope code: YaRN frequencies and attention
factor (DeepSeek-V3's and gpt-oss's settings), from GGUF metadata as llama.cpp's converter writes it,
and a partial rope that passes the unrotated tail through."""
from __future__ import annotations

import math

import pytest
import torch

from moeray.stages.arch import get_arch
from moeray.stages.blocks.rope import RoPE, Yarn


def _hf_yarn(rope_parameters: dict, head_dim: int, max_pos: int):
    from transformers import PretrainedConfig
    from transformers.modeling_rope_utils import _compute_yarn_parameters

    cfg = PretrainedConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                           max_position_embeddings=max_pos, rope_parameters=rope_parameters)
    return _compute_yarn_parameters(cfg)


def _meta(arch: str, **rope) -> dict:
    m = {"general.architecture": arch, f"{arch}.block_count": 2, f"{arch}.embedding_length": 256,
         f"{arch}.attention.head_count": 4, f"{arch}.attention.key_length": 64,
         f"{arch}.attention.value_length": 64, f"{arch}.rope.dimension_count": 64,
         f"{arch}.expert_count": 4, f"{arch}.expert_used_count": 2, f"{arch}.expert_feed_forward_length": 32}
    m.update({f"{arch}.rope.{k}": v for k, v in rope.items()})
    return m


@pytest.mark.parametrize("name,params,truncate", [
    ("gpt-oss-like", dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0,
                          original_max_position_embeddings=4096, truncate=False), False),
    ("truncated", dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, beta_fast=32.0, beta_slow=1.0,
                       original_max_position_embeddings=4096), True),
])
def test_yarn_frequencies_and_attention_factor_match_transformers(name, params, truncate):
    want_freq, want_attn = _hf_yarn(params, 64, 131072)
    meta = _meta("qwen3moe", **{"freq_base": params["rope_theta"], "scaling.type": "yarn",
                                "scaling.factor": params["factor"],
                                "scaling.original_context_length": params["original_max_position_embeddings"],
                                "scaling.yarn_beta_fast": params["beta_fast"],
                                "scaling.yarn_beta_slow": params["beta_slow"]})
    cfg = get_arch("qwen3moe").config(meta, {}, "<test>")
    assert cfg.rope_scaling == "yarn" and cfg.rope_scale == params["factor"]
    assert cfg.yarn_attn_factor == pytest.approx(want_attn, rel=1e-6)
    cfg = type(cfg)(**{**cfg.__dict__, "yarn_truncate": truncate})
    rope = RoPE.from_config(cfg)
    torch.testing.assert_close(rope.inv_freq.float(), want_freq.float(), rtol=1e-5, atol=0)
    # the blend really differs from plain rope at the slow end and equals it at the fast end
    plain = RoPE(64, params["rope_theta"], "neox").inv_freq
    assert rope.inv_freq[0] == pytest.approx(float(plain[0])) and rope.inv_freq[-1] < plain[-1] / 10


def test_yarn_scales_cos_and_sin_by_its_attention_factor():
    yarn = Yarn(factor=32.0, original_context=4096, attn_factor=1.0 + 0.1 * math.log(32.0))
    rope = RoPE(64, 150000.0, "neox", yarn=yarn)
    cos, sin, _ = rope.cos_sin(torch.tensor([0, 7]))
    assert cos[0].max().item() == pytest.approx(yarn.attn_factor)
    torch.testing.assert_close(cos ** 2 + sin ** 2, torch.full_like(cos, yarn.attn_factor ** 2))


@pytest.mark.parametrize("style", ["neox", "normal"])
def test_partial_rope_rotates_the_first_dims_and_passes_the_rest(style):
    full, part = RoPE(16, 10000.0, style), RoPE(16, 10000.0, style)
    x = torch.randn(3, 2, 32)
    pos = torch.tensor([0, 5, 9])
    got = part.apply(x, *part.cos_sin(pos))
    torch.testing.assert_close(got[..., 16:], x[..., 16:], rtol=0, atol=0)
    torch.testing.assert_close(got[..., :16], full.apply(x[..., :16].contiguous(), *full.cos_sin(pos)))
    assert not torch.allclose(got[1:, :, :16], x[1:, :, :16])
