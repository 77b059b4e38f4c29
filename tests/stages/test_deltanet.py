"""Gated DeltaNet compute against transformers' torch reference (qwen3_next's own functions):
the chunked rule, the recurrent step, the causal conv with its state, the norm-gated output,
and ggml's op on the ggml backend; chunked prefill carried across pieces resumes exactly."""
import pytest
import torch

from moeray.stages.kernels import backend
from moeray.stages.blocks.deltanet import (DeltaNetShape, causal_conv, causal_conv_step, gated_delta_chunked,
                                    gated_delta_step, gated_norm, ggml_gated_delta, l2norm)

M = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
TOL = 1e-4


def _inputs(T, Hk=2, Hv=4, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(1, T, Hk, D, generator=g), torch.randn(1, T, Hk, D, generator=g)
    v = torch.randn(1, T, Hv, D, generator=g)
    decay = -torch.rand(1, T, Hv, generator=g) * 2
    beta = torch.rand(1, T, Hv, generator=g)
    s0 = torch.randn(1, Hv, D, D, generator=g) * 0.3
    return q, k, v, decay, beta, s0


def _ours(q, k, shape):
    """What our rule takes: normalised, q scaled, both expanded to the v heads (grouped order)."""
    D = q.shape[-1]
    return shape.expand_qk(l2norm(q[0])) * D ** -0.5, shape.expand_qk(l2norm(k[0]))


def test_chunked_rule_equals_transformers_and_resumes_across_pieces():
    T = 150  # two full chunks and a ragged third
    q, k, v, g, beta, s0 = _inputs(T)
    ref, ref_s = M.torch_chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                                use_qk_l2norm_in_kernel=True)
    rec, rec_s = M.torch_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                                    use_qk_l2norm_in_kernel=True)
    shape = DeltaNetShape(2, 4, 16, 16, 4)
    qn, kn = _ours(q, k, shape)
    o, s = gated_delta_chunked(qn, kn, v[0], g[0], beta[0], s0[0])
    assert (o - ref[0]).abs().max() <= TOL and (s - ref_s[0]).abs().max() <= TOL
    assert (o - rec[0]).abs().max() <= TOL and (s - rec_s[0]).abs().max() <= TOL
    # the same prompt in three pieces (cut inside chunks), the state carried between them
    outs, state = [], s0[0]
    for lo, hi in ((0, 37), (37, 101), (101, T)):
        o_i, state = gated_delta_chunked(qn[lo:hi], kn[lo:hi], v[0, lo:hi], g[0, lo:hi], beta[0, lo:hi], state)
        outs.append(o_i)
    assert (torch.cat(outs) - ref[0]).abs().max() <= TOL and (state - ref_s[0]).abs().max() <= TOL


def test_recurrent_step_equals_transformers_decode():
    T = 12
    q, k, v, g, beta, s0 = _inputs(T, seed=1)
    ref, ref_s = M.torch_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                                    use_qk_l2norm_in_kernel=True)
    shape = DeltaNetShape(2, 4, 16, 16, 4)
    qn, kn = _ours(q, k, shape)
    state, outs = s0, []
    for t in range(T):  # one token at a time, as decode runs it
        o, state = gated_delta_step(qn[t:t + 1], kn[t:t + 1], v[0, t:t + 1], g[0, t:t + 1], beta[0, t:t + 1], state)
        outs.append(o)
    assert (torch.cat(outs) - ref[0]).abs().max() <= TOL and (state - ref_s).abs().max() <= TOL


def test_tiled_v_order_reads_k_heads_modulo():
    """llama.cpp's qwen35moe order: v head h reads k head h % H_k (grouped: h // r)."""
    x = torch.arange(2.0).view(2, 1).expand(2, 3).reshape(1, 2, 3)  # [.., H_k=2, D=3]: head id per row
    tiled = DeltaNetShape(2, 6, 3, 3, 4, "tiled").expand_qk(x)[0, :, 0].tolist()
    grouped = DeltaNetShape(2, 6, 3, 3, 4, "grouped").expand_qk(x)[0, :, 0].tolist()
    assert tiled == [0, 1, 0, 1, 0, 1] and grouped == [0, 0, 0, 1, 1, 1]


def test_causal_conv_with_state_equals_transformers():
    C, K, T = 10, 4, 9
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(1, C, T, generator=g), torch.randn(C, K, generator=g)
    ref = M.causal_conv1d_fn(x, w, None, activation="silu")[0].t()  # [T, C], from zero history
    y1, st = causal_conv(x[0, :, :5].t(), torch.zeros(C, K - 1), w)
    y2, st = causal_conv(x[0, :, 5:8].t(), st, w)
    outs = [y1, y2]
    y3, st = causal_conv_step(x[0, :, 8:9].t(), st.unsqueeze(0), w)  # the decode form
    outs.append(y3)
    assert (torch.cat(outs) - ref).abs().max() <= TOL
    # transformers' decode update keeps the last K inputs; ours the last K-1: same history
    assert torch.equal(st[0], x[0, :, -(K - 1):])


def test_gated_norm_equals_transformers():
    g = torch.Generator().manual_seed(3)
    o, z, w = torch.randn(5, 4, 16, generator=g), torch.randn(5, 4, 16, generator=g), torch.randn(16, generator=g)
    ref = M.Qwen3NextRMSNormGated(16, eps=1e-6)
    ref.weight.data.copy_(w)
    assert (gated_norm(o, z, w, 1e-6) - ref(o.reshape(-1, 16), z.reshape(-1, 16)).view(5, 4, 16)).abs().max() <= 1e-5


@pytest.mark.skipif(not backend.ggml_available(), reason="ggml-python is not installed")
@pytest.mark.parametrize("v_order", ["grouped", "tiled"])
def test_ggml_gated_delta_net_equals_torch(v_order):
    """ggml_gated_delta_net (the ggml backend) against our torch rule: one prefill piece and a decode batch."""
    shape = DeltaNetShape(2, 6, 16, 16, 4, v_order)
    T = 70
    g = torch.Generator().manual_seed(4)
    q, k = l2norm(torch.randn(T, 2, 16, generator=g)), l2norm(torch.randn(T, 2, 16, generator=g))
    v, decay, beta = torch.randn(T, 6, 16, generator=g), -torch.rand(T, 6, generator=g), torch.rand(T, 6, generator=g)
    s0 = torch.randn(6, 16, 16, generator=g)
    o, s = gated_delta_chunked(shape.expand_qk(q) * 0.25, shape.expand_qk(k), v, decay, beta, s0)
    # the op broadcasts q/k heads tiled; grouped files pass them expanded
    qq, kk = (q, k) if v_order == "tiled" else (shape.expand_qk(q), shape.expand_qk(k))
    og, sg = ggml_gated_delta(qq[None], kk[None], v[None], decay[None], beta[None], s0[None])
    assert (o - og[0]).abs().max() <= 1e-5 and (s - sg[0]).abs().max() <= 1e-5
    # decode: T sequences of one token each in one call
    od, sd = ggml_gated_delta(qq[:, None], kk[:, None], v[:, None], decay[:, None], beta[:, None],
                              s0.expand(T, -1, -1, -1))
    ot, st = gated_delta_step(shape.expand_qk(q) * 0.25, shape.expand_qk(k), v, decay, beta, s0.expand(T, -1, -1, -1))
    assert (od[:, 0] - ot).abs().max() <= 1e-5 and (sd - st).abs().max() <= 1e-5
