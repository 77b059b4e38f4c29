"""bench/shapes.py: a real model's shape with random valid blocks, as both engines read it."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from shapes import Shape, write_shape  # noqa: E402

from moeray.stages.gguf.reader import GGUFFile  # noqa: E402
from moeray.stages.runtime.model import load_model  # noqa: E402


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe", "glm4moe", "gpt-oss", "deepseek2"])
def test_a_shaped_file_has_the_shape_and_runs(tmp_path, arch):
    extra = {"qwen2moe": dict(shared_ff=512, norm_topk=False),  # glm4moe: layer 0 dense, a shared expert
             "glm4moe": dict(shared_ff=256, dense_lead=1, dense_ff=512, groups=(2, 1), weights_scale=2.5),
             "gpt-oss": dict(window=8),
             # MLA: 64 + 32 per query head through a q LoRA, the 128 + 32 latent; DeepSeek-V3's routing
             "deepseek2": dict(shared_ff=256, dense_lead=1, dense_ff=512, groups=(2, 1), weights_scale=2.5,
                               kv_lora=128, q_lora=128, rope_dim=32, v_dim=64, head_dim=96)}.get(arch, {})
    ff = 352 if arch == "qwen2moe" else 256  # 352: not a multiple of 256, so its down rows take Q5_0
    s = Shape(arch, layers=2, hidden=256, heads=4, kv_heads=2, experts=4, used=2, expert_ff=ff, vocab=49408,
              **{"head_dim": 64, **extra})
    path = write_shape("tiny", shape=s, path=tmp_path / "tiny.gguf", pool_blocks=1024)
    g = GGUFFile(path)
    cfg = g.config
    assert (cfg.arch, cfg.n_layers, cfg.hidden, cfg.n_experts, cfg.n_experts_used, cfg.expert_ffn_dim,
            cfg.vocab_size) == (arch, 2, 256, 4, 2, ff, 49408)
    oss = arch == "gpt-oss"  # MXFP4 experts, as published
    assert g.info("blk.1.ffn_gate_exps.weight").ggml_type.name == ("MXFP4" if oss else "Q4_K")
    assert g.info("blk.1.ffn_down_exps.weight").ggml_type.name == ("MXFP4" if oss else "Q5_0" if ff % 256 else "Q4_K")
    if arch == "glm4moe":
        assert (cfg.n_dense_leading, cfg.expert_gating, cfg.score_bias, cfg.expert_groups, cfg.expert_weights_scale,
                cfg.shared_expert_ffn_dim, cfg.shared_expert_gate, cfg.rope_dim) == (1, "sigmoid", True, 2, 2.5, 256, False, 32)
    if oss:
        assert (cfg.rope_scaling, cfg.sliding_window, cfg.swa_layers, cfg.attn_sinks, cfg.expert_bias, cfg.router_bias) == (
            "yarn", 8, (True, False), True, True, True)
    if arch == "deepseek2":
        assert (cfg.attention, cfg.n_kv_heads, cfg.head_dim, cfg.rope_dim, cfg.kv_lora_rank, cfg.q_lora_rank, cfg.v_head_dim,
                cfg.rope_scaling, cfg.n_dense_leading, cfg.expert_gating) == ("mla", 1, 96, 32, 128, 128, 64, "yarn", 1, "sigmoid")
    model = load_model(g)
    assert model.trunk is not None or model.backend != "ggml"  # every family's layers run as trunk graphs
    logits = model.step([[1, 2, 3, 4]], [0], model.new_kv_cache(1, 8))
    assert logits.shape == (1, 49408) and bool(torch.isfinite(logits).all())
    assert write_shape("tiny", shape=s, path=path, pool_blocks=1024).stat().st_mtime_ns == path.stat().st_mtime_ns
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return
    # llama.cpp loads it too (in a child: its libggml must not share this process with ggml-python's)
    code = ("import llama_cpp as L, sys; L.llama_backend_init(); "
            "m = L.llama_model_load_from_file(sys.argv[1].encode(), L.llama_model_default_params()); "
            "print(L.llama_model_n_params(m) > 0 if m else 'none')")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "True", out.stderr[-500:]

