"""The published MoE shapes planned from their sizes (planner/shapes.py MOE_SHAPES): DeepSeek-V3,
Kimi-K2, GLM-4.5 and GLM-4.5-Air with their dense leading layers, KV layouts and block types,
on 2 x 24 GB + 2 x 16 GB (docs/models.md prints these plans)."""
from __future__ import annotations

import json

import pytest

from moeray.planner.devices import parse_devices
from moeray.planner.search import plan_placement
from moeray.planner.shapes import BYTES_PER_256, MOE_SHAPES, moe_spec

# Total parameters the model cards publish (DeepSeek-V3 without its MTP module; Kimi-K2 "1T";
# GLM-4.5 355B and Air 106B with theirs, which moeray neither loads nor plans).
PUBLISHED = {"deepseek-v3": 671e9, "kimi-k2": 1.03e12, "glm-4.5": 355e9, "glm-4.5-air": 106e9}
RIG = "24GiB,24GiB,16GiB,16GiB"


@pytest.mark.parametrize("name", list(MOE_SHAPES))
def test_the_spec_has_the_published_size_dense_layers_and_kv(name):
    s = MOE_SHAPES[name]
    spec = moe_spec(s)
    assert spec.expert_bytes[:s.dense_layers] == [0] * s.dense_layers
    assert set(spec.expert_bytes[s.dense_layers:]) == {3 * s.expert_ffn * s.hidden * BYTES_PER_256[s.expert_type] // 256}
    assert spec.moe_layers == list(range(s.dense_layers, s.n_layers))
    # the weights at each tensor's block type, back to a parameter count
    n_expert = len(spec.moe_layers) * s.n_experts * 3 * s.expert_ffn * s.hidden
    q8 = (sum(spec.trunk_bytes.layers) + spec.trunk_bytes.embedding) * 256 / BYTES_PER_256["Q8_0"]
    assert n_expert + q8 + s.vocab * s.hidden == pytest.approx(PUBLISHED[name], rel=0.02)
    kv = {"deepseek-v3": 512 + 64, "kimi-k2": 512 + 64, "glm-4.5": 2 * 8 * 128, "glm-4.5-air": 2 * 8 * 128}[name]
    assert spec.kv_token_bytes == [2 * kv] * s.n_layers


@pytest.mark.parametrize("name", list(MOE_SHAPES))
def test_each_plans_on_two_24_and_two_16_gb_cards(name, tmp_path, capsys):
    from moeray.cluster.cli import main

    spec = moe_spec(MOE_SHAPES[name])
    plan = plan_placement(spec.with_kv_for(32768), parse_devices(RIG))
    assert len(plan.stages) == 4 and plan.split[0][0] == 0 and plan.split[-1][1] == spec.n_layers
    dense = set(range(MOE_SHAPES[name].dense_layers))
    assert plan.n_pairs == len(spec.moe_layers) * spec.n_experts
    assert all(int(l) not in dense for st in plan.stages for l, _ in st.held_pairs)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(spec.to_dict()))
    assert main(["plan", "--spec", str(path), "--devices", RIG, "--kv-tokens", "32768"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("layer split auto: K=") and "[kv] " in out and "32768 tokens (--kv-tokens)" in out
