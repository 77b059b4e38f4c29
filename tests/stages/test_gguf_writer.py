"""moeray's GGUF writer produces files laid out as llama.cpp's converter lays them out.

References nobody here wrote: gguf-py's TensorNameMap (llama.cpp's own HF -> GGUF name table),
gguf's GGUFReader, and transformers' GGUF loader (which undoes llama.cpp's q/k permutation itself).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import gguf
from gguf import GGMLQuantizationType as QT
from moeray.stages.gguf.writer import (
    dequantized_state_dict,
    gguf_tensors_from_hf,
    llama_permute,
    llama_unpermute,
    write_gguf,
)
from tiny_models import BUILDERS, EXPERT_FFN, HEAD_DIM, HIDDEN, N_LAYERS, SHARED_FFN, VOCAB, token_ids

GGUF_ARCH = {"llama": "llama", "mixtral": "llama", "qwen2moe": "qwen2moe", "qwen3moe": "qwen3moe"}


@pytest.fixture(scope="module")
def models():
    return {name: build() for name, build in BUILDERS.items()}


def _fields(path):
    reader = gguf.GGUFReader(path)
    meta = {name: f.contents() for name, f in reader.fields.items() if not name.startswith("GGUF.")}
    tensors = {t.name: t for t in reader.tensors}
    return meta, tensors


@pytest.mark.parametrize("name", list(BUILDERS))
def test_metadata_has_every_key_llama_cpp_reads(models, name, tmp_path):
    model = models[name]
    path = write_gguf(model, tmp_path / f"{name}.gguf", "F32")
    meta, tensors = _fields(path)
    a = GGUF_ARCH[name]
    assert meta["general.architecture"] == a
    assert meta[f"{a}.block_count"] == N_LAYERS
    assert meta[f"{a}.embedding_length"] == HIDDEN
    assert meta[f"{a}.context_length"] == model.config.max_position_embeddings
    assert meta[f"{a}.attention.head_count"] == model.config.num_attention_heads
    assert meta[f"{a}.attention.head_count_kv"] == model.config.num_key_value_heads
    assert meta[f"{a}.attention.key_length"] == meta[f"{a}.attention.value_length"] == HEAD_DIM
    assert meta[f"{a}.rope.dimension_count"] == HEAD_DIM
    assert meta[f"{a}.rope.freq_base"] == pytest.approx(model.config.rope_parameters["rope_theta"])
    assert meta[f"{a}.attention.layer_norm_rms_epsilon"] == pytest.approx(model.config.rms_norm_eps)
    assert meta["general.file_type"] == gguf.LlamaFileType.ALL_F32
    if name == "llama":
        assert f"{a}.expert_count" not in meta
        assert meta[f"{a}.feed_forward_length"] == model.config.intermediate_size
    else:
        assert meta[f"{a}.expert_count"] == (6 if name == "mixtral" else 8)
        assert meta[f"{a}.expert_used_count"] == 2
        assert meta[f"{a}.expert_feed_forward_length"] == EXPERT_FFN
        assert tensors["blk.0.ffn_gate_exps.weight"].shape.tolist()[1] == EXPERT_FFN  # ggml ne[1]
    if name == "qwen2moe":
        assert meta[f"{a}.expert_shared_feed_forward_length"] == SHARED_FFN
        assert meta[f"{a}.expert_weights_norm"] is False
    if name == "qwen3moe":
        assert meta[f"{a}.expert_weights_norm"] is True


@pytest.mark.parametrize("name", list(BUILDERS))
def test_tensor_names_agree_with_gguf_py_name_map(models, name, tmp_path):
    """Every tensor name is the one llama.cpp's TensorNameMap gives the HF tensor, shapes in ggml order."""
    model = models[name]
    arch = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[GGUF_ARCH[name]]
    name_map = gguf.get_tensor_name_map(arch, N_LAYERS)
    tensors = gguf_tensors_from_hf(model.state_dict(), model.config)
    expected = set()
    for key in model.state_dict():
        if key.endswith("mlp.experts.gate_up_proj"):  # transformers 5's fused tensor: no single name
            bid = key.split(".")[2]
            expected |= {f"blk.{bid}.ffn_gate_exps.weight", f"blk.{bid}.ffn_up_exps.weight"}
            continue
        base, _, suffix = key.rpartition(".") if key.endswith((".weight", ".bias")) else (key, "", "weight")
        mapped = name_map.get_name(base)
        assert mapped is not None, key
        expected.add(f"{mapped}.{suffix}")
    assert set(tensors) == expected
    allowed = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[arch]}
    for tname in tensors:
        generic = tname.rsplit(".", 1)[0]
        if generic.startswith("blk."):
            generic = "blk.{bid}." + generic.split(".", 2)[2]
        assert generic in allowed, f"{tname} is not a tensor of {GGUF_ARCH[name]} in llama.cpp"
    if name != "llama":
        e = 6 if name == "mixtral" else 8
        assert tensors["blk.1.ffn_gate_exps.weight"].shape == (e, EXPERT_FFN, HIDDEN)
        assert tensors["blk.1.ffn_up_exps.weight"].shape == (e, EXPERT_FFN, HIDDEN)
        assert tensors["blk.1.ffn_down_exps.weight"].shape == (e, HIDDEN, EXPERT_FFN)
        assert tensors["blk.1.ffn_gate_inp.weight"].shape == (e, HIDDEN)
    if name == "qwen2moe":
        assert tensors["blk.1.ffn_gate_inp_shexp.weight"].shape == (HIDDEN,)
        assert tensors["blk.1.ffn_gate_shexp.weight"].shape == (SHARED_FFN, HIDDEN)


def test_experts_split_gate_then_up(models):
    """transformers' fused gate_up_proj holds gate rows first: expert j's gate is rows [:F]."""
    model = models["mixtral"]
    fused = model.model.layers[2].mlp.experts.gate_up_proj.detach().numpy()
    tensors = gguf_tensors_from_hf(model.state_dict(), model.config)
    np.testing.assert_array_equal(tensors["blk.2.ffn_gate_exps.weight"][4], fused[4, :EXPERT_FFN])
    np.testing.assert_array_equal(tensors["blk.2.ffn_up_exps.weight"][4], fused[4, EXPERT_FFN:])


def test_permutation_is_llama_cpps():
    """Row r of head h moves so that RoPE's pair (i, i + d/2) becomes adjacent (2i, 2i + 1)."""
    d, heads = 8, 2
    w = np.arange(heads * d, dtype=np.float32)[:, None]
    p = llama_permute(w, heads, heads)[:, 0]
    assert p[:d].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    assert p[d:].tolist() == [8, 12, 9, 13, 10, 14, 11, 15]
    np.testing.assert_array_equal(llama_unpermute(llama_permute(w, 6, 2), 6, 2), w)


@pytest.mark.parametrize("file_type,matrix_type", [("F32", QT.F32), ("F16", QT.F16), ("Q8_0", QT.Q8_0)])
def test_types_follow_llama_cpp(models, file_type, matrix_type, tmp_path):
    """Norms, biases and routers stay F32; every other matrix takes the requested type."""
    path = write_gguf(models["qwen2moe"], tmp_path / "m.gguf", file_type)
    meta, tensors = _fields(path)
    assert meta["general.file_type"] == FILE_TYPE_IDS[file_type]
    for tname, t in tensors.items():
        keep_f32 = (len(t.shape) == 1 or tname.endswith("_norm.weight") or tname.endswith(".bias")
                    or "ffn_gate_inp" in tname)
        assert t.tensor_type == (QT.F32 if keep_f32 else matrix_type), tname


FILE_TYPE_IDS = {"F32": 0, "F16": 1, "Q8_0": 7}


@pytest.mark.parametrize("name", list(BUILDERS))
def test_f32_round_trip_is_exact(models, name, tmp_path):
    """Reading an F32 file back gives the transformers weights bit for bit (layout undone exactly)."""
    model = models[name]
    path = write_gguf(model, tmp_path / "m.gguf", "F32")
    back = dequantized_state_dict(path, model)
    for key, ref in model.state_dict().items():
        assert torch.equal(back[key], ref), key


def test_q8_0_round_trip_is_close_but_not_exact(models, tmp_path):
    model = models["qwen3moe"]
    path = write_gguf(model, tmp_path / "m.gguf", "Q8_0")
    back = dequantized_state_dict(path, model)
    ref = model.model.layers[1].mlp.experts.down_proj
    got = back["model.layers.1.mlp.experts.down_proj"]
    err = (got - ref).abs().max().item()
    # Q8_0: one scale per 32 weights, |error| <= scale / 2 = max|block| / 254
    assert 0 < err <= ref.abs().max().item() / 254 * 1.01
    assert torch.equal(back["model.norm.weight"], model.model.norm.weight)  # F32 stays exact


def test_transformers_gguf_loader_undoes_our_llama_permutation(models, tmp_path):
    """transformers reverses llama.cpp's q/k permutation on load; its logits equal the original's."""
    from transformers import AutoModelForCausalLM

    model = models["llama"]
    path = write_gguf(model, tmp_path / "llama.gguf", "F32")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32,
                                                  attn_implementation="eager").eval()
    assert loaded.config.head_dim == HEAD_DIM
    ids = torch.tensor([token_ids()])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=1e-5)


def test_tokenizer_round_trips_through_transformers(models, tmp_path):
    """A byte-level BPE written as tokenizer.ggml.* encodes and decodes as the original does."""
    from tokenizers import Tokenizer, decoders, models as tok_models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok = Tokenizer(tok_models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["The quick brown fox jumps over the lazy dog. " * 3,
                             "Mixture of experts models route tokens to experts."], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    path = write_gguf(models["qwen3moe"], tmp_path / "t.gguf", "F32", tokenizer=fast)
    meta, _ = _fields(path)
    assert meta["tokenizer.ggml.model"] == "gpt2"
    assert meta["tokenizer.ggml.eos_token_id"] == fast.eos_token_id
    loaded = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    text = "the lazy experts route a fox"
    assert loaded.encode(text) == fast.encode(text)
    assert loaded.decode(fast.encode(text)) == text


def test_refuses_an_architecture_it_cannot_write(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50, n_positions=16))
    with pytest.raises(ValueError, match="cannot write 'gpt2'"):
        write_gguf(model, tmp_path / "x.gguf")


def test_rows_that_do_not_fill_q8_0_blocks_fall_back_to_f16():
    """As llama.cpp's converter does on QuantError: a 72-wide row cannot be cut into 32-blocks."""
    from moeray.stages.gguf.writer import tensor_type

    assert tensor_type("blk.0.attn_q.weight", np.zeros((64, 72), np.float32), QT.Q8_0) == QT.F16
    assert tensor_type("blk.0.attn_q.weight", np.zeros((72, 64), np.float32), QT.Q8_0) == QT.Q8_0
