"""deepseek2 beyond logit parity (tests/stages/test_parity_transformers.py): what the file says, the
latent KV layout and its price, and stages chained over the dense and MoE layers."""
from __future__ import annotations

import pytest
import torch

from moeray.stages.gguf.reader import GGUFFile, read_gguf_header
from moeray.stages.gguf.writer import write_gguf
from moeray.stages.blocks.kv_cache import BLOCK_SIZE, kv_block_bytes, kv_token_bytes
from moeray.stages.runtime.model import StageModel, load_model
from tiny_models import tiny_deepseek3, token_ids


@pytest.fixture(scope="module")
def ds_file(tmp_path_factory):
    return write_gguf(tiny_deepseek3(), tmp_path_factory.mktemp("ds") / "ds.gguf", "Q8_0")


def test_the_header_reads_as_deepseek3_and_prices_the_latent_kv(ds_file):
    from moeray.cluster.placement import held_spec
    from moeray.stages.blocks.kv_cache import kv_bytes_by_layer

    h = read_gguf_header(ds_file)
    c = h.config
    assert (c.arch, c.attention, c.n_heads, c.head_dim, c.rope_dim, c.v_head_dim) == ("deepseek2", "mla", 4, 48, 16, 32)
    assert (c.q_lora_rank, c.kv_lora_rank, c.n_dense_leading, c.moe_layers) == (64, 64, 1, [1, 2])
    assert (c.expert_gating, c.expert_groups, c.expert_groups_used, c.expert_weights_scale) == ("sigmoid", 4, 2, 2.5)
    assert c.score_bias and c.norm_topk_prob and not c.shared_expert_gate and c.shared_expert_ffn_dim == 64
    assert c.rope_scaling == "yarn" and c.yarn_attn_factor == 1.0
    assert c.attn_scale == pytest.approx((0.1 * torch.log(torch.tensor(4.0)).item() + 1) ** 2 / 48 ** 0.5)
    # The KV: the latent and the rope key, 64 + 16 values per token per layer (not 2 * 4 * 48 = 384)
    assert kv_token_bytes(c, 3) == 3 * 80 * 4 and kv_block_bytes(c, range(1, 3), 2) == BLOCK_SIZE * 2 * 80 * 2
    pool = StageModel(GGUFFile(ds_file), 0, 3).new_kv_pool(5)
    assert pool.nbytes() == 5 * kv_block_bytes(c, 3) and pool.v == [None] * 3 and pool.k[0].shape == (1, 80, 80)
    spec = held_spec(h, kv_bytes_by_layer(c, 7))
    assert [t - k for t, k in zip(spec.trunk_bytes.layers, [7 * BLOCK_SIZE * 80 * 4] * 3)] == held_spec(h).trunk_bytes.layers
    assert spec.expert_bytes[0] == 0 and spec.expert_bytes[1] == h.expert_bytes(1) > 0


@pytest.mark.parametrize("backend", ["exact", "dequant"])
def test_chained_stages_and_decode_equal_the_full_model(ds_file, backend):
    ids = token_ids(12)
    full = load_model(ds_file, backend=backend).logits_all(ids)
    g = GGUFFile(ds_file)
    stages = [StageModel(g, a, b, backend=backend) for a, b in ((0, 1), (1, 2), (2, 3))]  # dense | MoE | MoE
    kvs = [s.new_kv_cache(1, 16) for s in stages]
    out = []
    for chunk in (ids[:7], *[[t] for t in ids[7:]]):  # a prefill, then single-token decode steps
        x = stages[0].embed([chunk])
        for s, kv in zip(stages, kvs):
            x = s.run_layers(x, s.batch_meta([len(chunk)], [0], kv), kv)
        out.append(stages[-1].head(x[-1:]))
    torch.testing.assert_close(torch.cat(out), full[6:], rtol=0, atol=1e-4 * full.abs().max().item())


def _llama_cpp_tensor_names(arch_name: str) -> set[str]:
    import gguf

    arch = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch_name]
    return {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[arch]}


def test_the_writer_uses_llama_cpps_names_and_reads_back_exactly(tmp_path):
    import gguf

    from moeray.stages.gguf.writer import dequantized_state_dict

    model = tiny_deepseek3()
    path = write_gguf(model, tmp_path / "ds.gguf", "F32")
    names = {t.name for t in gguf.GGUFReader(path).tensors}
    allowed = _llama_cpp_tensor_names("deepseek2")
    for n in names:
        generic = n.rsplit(".", 1)[0]
        generic = "blk.{bid}." + generic.split(".", 2)[2] if generic.startswith("blk.") else generic
        assert generic in allowed, n
    assert "blk.1.attn_k_b.weight" in names and "blk.1.attn_kv_b.weight" not in names  # the current split
    back = dequantized_state_dict(path, model)  # the kv_b_proj split undone, names mapped back
    for key, ref in model.state_dict().items():
        assert torch.equal(back[key], ref), key
