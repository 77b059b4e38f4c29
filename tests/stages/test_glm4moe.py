"""glm4moe beyond logit parity (tests/stages/test_parity_transformers.py): the MTP layer llama.cpp's
converter appends is in the file but neither loaded nor priced, and reading it says so once."""
from __future__ import annotations

import logging

import pytest

from moeray.stages.gguf.reader import GGUFFile, read_gguf_header
from moeray.stages.gguf.writer import write_gguf
from moeray.stages.runtime.model import load_model
from tiny_models import N_LAYERS, tiny_glm4moe


@pytest.fixture(scope="module")
def glm_file(tmp_path_factory):
    return write_gguf(tiny_glm4moe(), tmp_path_factory.mktemp("glm") / "glm.gguf", "Q8_0")


def test_the_mtp_layer_is_in_the_file_but_not_loaded_nor_priced(glm_file, caplog):
    from moeray.cluster.commands.plan import spec_from_gguf

    with caplog.at_level(logging.INFO, logger="moeray.arch"):
        h = read_gguf_header(glm_file)
        read_gguf_header(glm_file)
    assert sum("MTP" in r.getMessage() for r in caplog.records) == 1  # one line per file
    c = h.config
    assert h.metadata["glm4moe.block_count"] == N_LAYERS + 1 and h.metadata["glm4moe.nextn_predict_layers"] == 1
    assert c.n_layers == N_LAYERS and f"blk.{N_LAYERS}.nextn.eh_proj.weight" in h.tensors
    assert (c.rope_dim, c.head_dim, c.qk_norm, c.qkv_bias, c.n_dense_leading) == (16, 32, True, True, 1)
    assert (c.expert_gating, c.score_bias, c.expert_weights_scale, c.shared_expert_gate) == ("sigmoid", True, 2.5, False)
    spec = spec_from_gguf(str(glm_file))
    assert spec.n_layers == N_LAYERS and len(spec.trunk_bytes.layers) == N_LAYERS and spec.expert_bytes[0] == 0
    g = GGUFFile(glm_file)
    load_model(g)
    assert not any(n.startswith(f"blk.{N_LAYERS}.") for n in g.touched)


def test_the_writer_uses_llama_cpps_names_and_reads_back_exactly(tmp_path):
    import gguf
    import torch

    from moeray.stages.gguf.writer import dequantized_state_dict

    model = tiny_glm4moe()
    path = write_gguf(model, tmp_path / "glm.gguf", "F32")
    arch = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}["glm4moe"]
    allowed = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[arch]}
    for t in gguf.GGUFReader(path).tensors:
        generic = t.name.rsplit(".", 1)[0]
        generic = "blk.{bid}." + generic.split(".", 2)[2] if generic.startswith("blk.") else generic
        assert generic in allowed, t.name
    back = dequantized_state_dict(path, model)
    for key, ref in model.state_dict().items():
        assert torch.equal(back[key], ref), key
