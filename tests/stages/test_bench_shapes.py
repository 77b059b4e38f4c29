"""bench/shapes.py: real models' shapes with random valid blocks, as both engines read them.

The real-width files are gigabytes: here their headers (metadata + tensor directory, no data) are
checked against the published configs, and a toy-width copy of each (same family, layer pattern
and block types) is written, run by moeray and loaded by llama.cpp where it is installed.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from shapes import _SCALES, SHAPES, Shape, random_blocks, shrink, write_shape  # noqa: E402

from moeray.stages.gguf.reader import GGUFFile, _shape_matches, expected_tensor_shapes, read_gguf_header  # noqa: E402
from moeray.stages.runtime.model import load_model  # noqa: E402

# config.json of each model on its hub page: layers, hidden, attention heads, experts, experts a
# token, expert FFN, shared FFN (all shared experts), vocabulary, dense leading layers.
PUBLISHED = {
    "qwen3-30b-a3b": (48, 2048, 32, 128, 8, 768, 0, 151936, 0),
    "qwen1.5-moe-a2.7b": (24, 2048, 16, 60, 4, 1408, 5632, 151936, 0),
    "qwen3.6-35b-a3b": (40, 2048, 16, 256, 8, 512, 512, 248320, 0),
    "qwen3-next-80b-a3b": (48, 2048, 16, 512, 10, 512, 512, 151936, 0),
    "gpt-oss-20b": (24, 2880, 64, 32, 4, 2880, 0, 201088, 0),
    "deepseek-v2-lite": (27, 2048, 16, 64, 6, 1408, 2 * 1408, 102400, 1),
    "deepseek-v3": (61, 7168, 128, 256, 8, 2048, 2048, 129280, 3),
    "kimi-k2": (61, 7168, 64, 384, 8, 2048, 2048, 163840, 1),
    "glm-4.5-air": (46, 4096, 96, 128, 8, 1408, 1408, 151552, 1),
}
# linear_num_key_heads, linear_num_value_heads, linear_key_head_dim, linear_conv_kernel_dim
DELTANET = {"qwen3.6-35b-a3b": (16, 32, 128, 4), "qwen3-next-80b-a3b": (16, 32, 128, 4)}
# q_lora_rank, kv_lora_rank, qk_nope + qk_rope, qk_rope, v_head_dim, scoring
MLA = {"deepseek-v2-lite": (0, 512, 192, 64, 128, "softmax"), "deepseek-v3": (1536, 512, 192, 64, 128, "sigmoid"),
       "kimi-k2": (1536, 512, 192, 64, 128, "sigmoid")}


@pytest.mark.parametrize("qtype", [*_SCALES, "MXFP4"], ids=lambda t: getattr(t, "name", t))
def test_random_blocks_dequantise_to_small_finite_weights(qtype):
    """Every block type's random pool (gguf's own dequantiser, not ours): finite weights whose
    spread keeps activations O(1) through the layers, centred near zero."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
    from gguf.quants import dequantize

    qtype = T[qtype] if isinstance(qtype, str) else qtype
    blocks = random_blocks(qtype, 2048, np.random.default_rng(0))
    w = dequantize(blocks.reshape(-1, GGML_QUANT_SIZES[qtype][1]), qtype).reshape(-1)
    assert np.isfinite(w).all()
    assert 0.01 < w.std() < 0.06 and abs(w.mean()) < w.std() / 4, (w.std(), w.mean())


@pytest.mark.parametrize("name", list(SHAPES))
def test_the_real_width_header_has_the_published_shape(tmp_path, name):
    """The full-width file's metadata and tensor directory (written without data): the published
    config's widths and counts, the layer pattern of the first `layers` layers, every tensor the
    family reads at its expected shape and nothing else, experts in the declared block type."""
    s = SHAPES[name]
    h = read_gguf_header(write_shape(name, shape=s, path=tmp_path / "h.gguf", header_only=True))
    cfg = h.config
    layers, hidden, heads, experts, used, ff, shared, vocab, dense = PUBLISHED[name]
    assert (s.full_layers or s.layers) == layers and cfg.n_layers == s.layers <= layers
    assert (cfg.hidden, cfg.n_heads, cfg.n_experts, cfg.n_experts_used, cfg.expert_ffn_dim, cfg.shared_expert_ffn_dim,
            cfg.vocab_size, cfg.n_dense_leading) == (hidden, heads, experts, used, ff, shared, vocab, dense)
    assert cfg.moe_layers == list(range(dense, s.layers))  # a cut keeps its dense leading layers
    if name in DELTANET:  # three DeltaNet layers to one full attention, as published
        k, v, dim, kernel = DELTANET[name]
        dn = cfg.deltanet
        assert (dn.n_k_heads, dn.n_v_heads, dn.head_k_dim, dn.head_v_dim, dn.conv_kernel) == (k, v, dim, dim, kernel)
        assert cfg.recurrent == tuple((i + 1) % 4 != 0 for i in range(s.layers))
        assert (cfg.n_kv_heads, cfg.head_dim, cfg.rope_dim) == (2, 256, 64)
    if name in MLA:
        q_lora, kv_lora, qk, rope, v, scoring = MLA[name]
        assert (cfg.attention, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.head_dim, cfg.rope_dim, cfg.v_head_dim,
                cfg.expert_gating, cfg.score_bias) == ("mla", q_lora, kv_lora, qk, rope, v, scoring, scoring == "sigmoid")
    expected = expected_tensor_shapes(cfg)
    assert set(h.tensors) == set(expected)
    bad = {n: (t.shape, expected[n]) for n, t in h.tensors.items() if not _shape_matches(t.shape, expected[n])}
    assert not bad
    last = cfg.moe_layers[-1]
    want = s.experts_type
    assert h.tensors[f"blk.{last}.ffn_gate_exps.weight"].ggml_type.name == want
    down = h.tensors[f"blk.{last}.ffn_down_exps.weight"].ggml_type.name
    assert down == want if ff % 32 == 0 and (want == "MXFP4" or ff % 256 == 0) else down != want
    assert h.tensors["output.weight"].ggml_type.name == (s.head_type or s.trunk_type if hidden % 256 == 0 else "Q8_0")


def test_a_cut_keeps_the_pattern_and_the_whole_model_its_size(tmp_path):
    """--layers: Qwen3.6 cut to 8 layers is 6 DeltaNet + 2 attention; the whole Qwen3-Next has 48."""
    from shapes import shape_of

    cut = shape_of("qwen3.6-35b-a3b", 8)
    cfg = read_gguf_header(write_shape("cut", shape=cut, path=tmp_path / "c.gguf", header_only=True)).config
    assert cfg.recurrent == (True, True, True, False) * 2
    whole = shape_of("qwen3-next-80b-a3b", 48)
    assert (whole.layers, whole.full_layers) == (48, 0)
    with pytest.raises(SystemExit, match="has 48 layers"):
        shape_of("qwen3-next-80b-a3b", 49)


def _llama_cpp_loads(path) -> str:
    """'True' when llama.cpp (llama-cpp-python) loads the file; '' when it is not installed."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return ""
    # in a child: its libggml must not share this process with ggml-python's
    code = ("import llama_cpp as L, sys; L.llama_backend_init(); "
            "m = L.llama_model_load_from_file(sys.argv[1].encode(), L.llama_model_default_params()); "
            "print(L.llama_model_n_params(m) > 0 if m else 'none')")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120)
    return out.stdout.strip() or out.stderr[-800:]


@pytest.mark.parametrize("name", [n for n in SHAPES if n != "qwen1.5-moe-a2.7b"])
def test_a_toy_width_copy_runs_in_both_engines(tmp_path, name):
    """shrink(): the family, layer pattern and block types at toy widths; moeray loads and runs
    it to finite logits, and llama.cpp loads it (where installed)."""
    s = shrink(SHAPES[name])
    path = write_shape("tiny", shape=s, path=tmp_path / "tiny.gguf", pool_blocks=1024)
    g = GGUFFile(path)
    cfg, full = g.config, SHAPES[name]
    assert (cfg.arch, cfg.n_layers, cfg.n_experts, cfg.vocab_size) == (full.arch, s.layers, min(full.experts, 8), 49408)
    assert cfg.n_dense_leading == full.dense_lead and cfg.recurrent == tuple(
        (i + 1) % 4 != 0 for i in range(s.layers) if full.linear[0])
    assert g.info(f"blk.{s.layers - 1}.ffn_gate_exps.weight").ggml_type.name == full.experts_type
    if full.arch == "glm4moe":
        assert (cfg.expert_gating, cfg.score_bias, cfg.shared_expert_gate, cfg.rope_dim, cfg.qkv_bias) == (
            "sigmoid", True, False, 32, True)
    if full.arch == "gpt-oss":
        assert (cfg.rope_scaling, cfg.sliding_window, cfg.swa_layers[:2], cfg.attn_sinks, cfg.expert_bias,
                cfg.router_bias) == ("yarn", 8, (True, False), True, True, True)
    model = load_model(g)
    if not full.linear[0]:  # every family's layers run as trunk graphs (the hybrids': issue 34, item 3)
        assert model.trunk is not None or model.backend != "ggml"
    logits = model.step([[1, 2, 3, 4]], [0], model.new_kv_cache(1, 8))
    assert logits.shape == (1, 49408) and bool(torch.isfinite(logits).all())
    assert write_shape("tiny", shape=s, path=path, pool_blocks=1024).stat().st_mtime_ns == path.stat().st_mtime_ns
    loaded = _llama_cpp_loads(path)
    assert loaded in ("", "True"), loaded
