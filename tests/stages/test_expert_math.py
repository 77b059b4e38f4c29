"""The expert-math options of gpt-oss on the per-expert path: the clamped SwiGLU
(cfg.expert_act = "swiglu_oai") and per-expert biases, against transformers' own GptOssExperts,
on every kernel backend; and their bytes charged to the expert's slot, not the trunk."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf.quants import quantize

from moeray.errors import MoerayError
from moeray.stages.gguf.reader import TensorInfo, expert_bytes, tensor_role, trunk_bytes
from moeray.stages.blocks.moe import ExpertWeights
from moeray.stages.kernels.backend import ggml_available
from moeray.stages.kernels.qmatmul import GLU, SILU, ExpertBias, QMatrix

H, F, E, K = 64, 96, 4, 2
needs_ggml = pytest.mark.skipif(not ggml_available(), reason="ggml-python is not installed (`make` builds it: docs/kernels.md#building-ggml)")


@pytest.fixture(scope="module")
def hf_experts():
    """transformers' GptOssExperts with weights large enough that the clamps at +-limit bite."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    cfg = GptOssConfig(hidden_size=H, intermediate_size=F, num_local_experts=E, num_experts_per_tok=K,
                       swiglu_limit=7.0)
    m = GptOssExperts(cfg).float()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        m.gate_up_proj.copy_(torch.randn(m.gate_up_proj.shape, generator=gen) * 1.5)
        m.gate_up_proj_bias.copy_(torch.randn(m.gate_up_proj_bias.shape, generator=gen))
        m.down_proj.copy_(torch.randn(m.down_proj.shape, generator=gen) / F ** 0.5)
        m.down_proj_bias.copy_(torch.randn(m.down_proj_bias.shape, generator=gen))
    return m


def moeray_experts(m, backend: str, qtype=QT.F32) -> list[ExpertWeights]:
    """Each expert as moeray holds it: gate/up split from the interleaved gate_up_proj (llama.cpp's
    converter: gate = columns ::2, up = 1::2), transposed to [F, H] / [H, F]."""
    act = GLU("swiglu_oai", float(m.alpha), float(m.limit))
    out = []
    for e in range(E):
        gu = m.gate_up_proj[e].detach().T  # [2F, H]
        mats = [gu[::2], gu[1::2], m.down_proj[e].detach().T]
        qs = []
        for w in mats:
            a = np.ascontiguousarray(w.numpy(), dtype=np.float32)
            raw = a.view(np.uint8) if qtype == QT.F32 else quantize(a, qtype)
            qs.append(QMatrix.from_raw(raw.reshape(-1), qtype, a.shape, backend))
        b = m.gate_up_proj_bias[e].detach()
        out.append(ExpertWeights(*qs, ExpertBias(b[::2].contiguous(), b[1::2].contiguous(),
                                                 m.down_proj_bias[e].detach().clone()), act))
    return out


def routed(experts: list[ExpertWeights], x, ids, weights):
    """sum_r weights[:, r] * expert_{ids[:, r]}(x), as Experts.forward defines it."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for r in range(ids.shape[1]):
            out[t] += weights[t, r] * experts[int(ids[t, r])](x[t:t + 1])[0]
    return out


def _inputs():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, H, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(5)])
    weights = torch.softmax(torch.randn(5, K, generator=gen), dim=-1)
    return x, ids, weights


def test_swiglu_oai_with_biases_matches_transformers(hf_experts):
    x, ids, weights = _inputs()
    with torch.no_grad():
        ref = hf_experts(x, ids, weights)
        gu = x @ hf_experts.gate_up_proj[0] + hf_experts.gate_up_proj_bias[0]
    assert (gu[:, ::2] > 7).any() and (gu[:, 1::2].abs() > 7).any()  # both clamps are exercised
    got = routed(moeray_experts(hf_experts, "exact"), x, ids, weights)
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()
    # without the clamp and the biases the numbers differ: the options are really applied
    plain = [w._replace(act=SILU, bias=None) for w in moeray_experts(hf_experts, "exact")]
    assert (routed(plain, x, ids, weights) - ref).abs().max() > 0.1 * ref.abs().max()


@needs_ggml
def test_ggml_route_swiglu_oai_with_biases_within_its_tolerance(hf_experts):
    """ggml's graph (ggml_swiglu_oai, bias adds) on Q8_0 blocks against the dequant backend on the
    same blocks (which is transformers' math on those weights): measured 1.6e-2 of max |y| (the
    8-bit activations of x and of the clamped product); Q8_0's own rounding 1.1e-2."""
    x, ids, weights = _inputs()
    deq = routed(moeray_experts(hf_experts, "dequant", QT.Q8_0), x, ids, weights)
    got = routed(moeray_experts(hf_experts, "ggml", QT.Q8_0), x, ids, weights)
    assert (got - deq).abs().max() <= 0.03 * deq.abs().max()
    with torch.no_grad():
        ref = hf_experts(x, ids, weights)
    assert (deq - ref).abs().max() <= 0.02 * ref.abs().max()  # Q8_0 rounding of the weights only


def test_expert_act_comes_from_the_config():
    from moeray.stages.arch.config import ModelConfig
    cfg = ModelConfig("gpt-oss", 2, H, 4, 2, 16, 100, 128, 1e4, 1e-5, "neox", 0, E, K, F, 0, False, False, False)
    assert GLU.of(cfg) == SILU
    oai = dataclasses.replace(cfg, expert_act="swiglu_oai", swiglu_limit=5.5)
    assert GLU.of(oai) == GLU("swiglu_oai", 1.702, 5.5)
    g, u = torch.tensor([9.0, -3.0]), torch.tensor([-9.0, 2.0])
    want = (torch.tensor([-5.5, 2.0]) + 1) * torch.tensor([5.5, -3.0]) * torch.sigmoid(1.702 * torch.tensor([5.5, -3.0]))
    assert torch.allclose(GLU.of(oai)(g, u), want)
    with pytest.raises(MoerayError, match="gelu.*silu and swiglu_oai"):
        GLU.of(dataclasses.replace(cfg, expert_act="gelu"))


def test_per_expert_biases_are_priced_with_the_expert_not_the_trunk():
    def info(name, shape, qtype=QT.F32, n_bytes=None):
        n = int(np.prod(shape))
        return TensorInfo(name, shape, qtype, 0, n_bytes if n_bytes is not None else 4 * n)
    t = {n.name: n for n in (
        info("blk.0.ffn_gate_exps.weight", (E, F, H), QT.MXFP4, E * F * H // 32 * 17),
        info("blk.0.ffn_up_exps.weight", (E, F, H), QT.MXFP4, E * F * H // 32 * 17),
        info("blk.0.ffn_down_exps.weight", (E, H, F), QT.MXFP4, E * H * F // 32 * 17),
        info("blk.0.ffn_gate_exps.bias", (E, F)), info("blk.0.ffn_up_exps.bias", (E, F)),
        info("blk.0.ffn_down_exps.bias", (E, H)), info("blk.0.attn_norm.weight", (H,)))}
    weights = 3 * F * H // 32 * 17
    assert expert_bytes(t, 0) == expert_bytes(t, 0, "ggml") == weights + 4 * (F + F + H)
    assert tensor_role("blk.0.ffn_up_exps.bias") == ("expert", 0)
    cfg = type("Cfg", (), {"n_layers": 1, "tie_embeddings": False})()
    assert trunk_bytes(t, cfg)["layers"] == [4 * H]  # the norm only
    x = torch.randn(2, H)
    m = QMatrix.from_raw(np.zeros((F, H), np.float32).view(np.uint8).reshape(-1), QT.F32, (F, H), "exact")
    d = QMatrix.from_raw(np.zeros((H, F), np.float32).view(np.uint8).reshape(-1), QT.F32, (H, F), "exact")
    w = ExpertWeights(m, m, d, ExpertBias(torch.zeros(F), torch.zeros(F), torch.arange(H, dtype=torch.float32)))
    assert w.nbytes == 3 * 4 * F * H + 4 * (2 * F + H)
    assert torch.equal(w(x), torch.arange(H, dtype=torch.float32).expand(2, H))  # zero weights: the down bias
