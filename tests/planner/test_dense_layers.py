"""Dense FFN layers inside an MoE model (DeepSeek's first_k_dense_replace, GLM's first layer):
no slots, no profile pairs, priced as trunk, in the config, the planner's split search and
`moeray plan`, the expert cache, routing traces and profiles.

The model: a synthetic 4-layer qwen3moe-shaped GGUF whose layer 0 has a dense FFN
(leading_dense_block_count = 1), written from the same tensor table the loader validates.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from moeray.planner.devices import DeviceSpec
from moeray.planner.profile import Profile
from moeray.planner.search import plan_placement
from moeray.stages.gguf.reader import GGUFFile, read_gguf_header
from test_gguf_file import tiny_config, write_synthetic_gguf

E = 4


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    cfg = dataclasses.replace(tiny_config("qwen3moe", n_experts=E), n_layers=4, n_dense_leading=1, ffn_dim=96)
    return write_synthetic_gguf(tmp_path_factory.mktemp("dense") / "mixed.gguf", cfg)


def test_config_and_tensors_say_which_layers_are_dense(mixed):
    h = read_gguf_header(mixed)
    cfg = h.config
    assert cfg.n_dense_leading == 1 and cfg.ffn_dim == 96
    assert [cfg.is_moe_layer(l) for l in range(4)] == [False, True, True, True] and cfg.moe_layers == [1, 2, 3]
    assert "blk.0.ffn_gate.weight" in h.tensors and "blk.0.ffn_gate_exps.weight" not in h.tensors
    assert h.expert_bytes(0) == 0 and all(h.expert_bytes(l) > 0 for l in (1, 2, 3))
    dense_ffn = sum(h.tensors[f"blk.0.ffn_{k}.weight"].n_bytes for k in ("gate", "up", "down"))
    assert h.trunk_bytes()["layers"][0] >= dense_ffn  # the dense FFN is trunk


def test_plan_has_no_pairs_and_no_slots_in_the_dense_layer(mixed, capsys):
    from moeray.cluster.cli import main
    from moeray.cluster.commands.plan import spec_from_gguf

    spec = spec_from_gguf(str(mixed))
    assert spec.moe_layers == [1, 2, 3] and spec.expert_bytes[0] == 0
    blob = spec.expert_bytes[1]
    trunk = sum(spec.trunk_bytes.layers) + spec.trunk_bytes.embedding + spec.trunk_bytes.head
    devs = [DeviceSpec(f"d{i}", trunk + 5 * blob, 1.0, 0.5) for i in range(2)]
    plan = plan_placement(spec, devs)
    assert plan.n_pairs == 3 * E  # the dense layer has no pairs to rank
    held = np.concatenate([s.held_pairs for s in plan.stages])
    assert len(held) and (held[:, 0] != 0).all()
    # missed time counts k picks per token in the 3 MoE layers only: a plan that holds nothing
    # predicts k * 3 * miss_ms of misses
    none = plan_placement(spec, [DeviceSpec("tiny", 0, 1.0, 0.5)], trunk="off")
    assert none.stages[0].miss_ms == pytest.approx(spec.n_experts_used * 3 * 0.5)
    # one stage per layer: the dense layer's stage holds no experts and has no slots
    four = plan_placement(spec, [DeviceSpec(f"d{i}", trunk + 5 * blob, 1.0, 0.5) for i in range(4)])
    s0 = four.stages[0]
    assert (s0.first_layer, s0.end_layer, len(s0.held_pairs), s0.slots) == (0, 1, 0, None)
    assert main(["plan", str(mixed), "--devices", f"{trunk + 5 * blob},{trunk + 5 * blob}"]) == 0
    assert "of 12 profiled pairs" in capsys.readouterr().out


def test_cache_trace_and_profile_skip_the_dense_layer(mixed, tmp_path):
    from moeray.cache.trace import read_trace
    from moeray.stages.runtime.model import load_cached, load_model

    gguf = GGUFFile(mixed)
    blob = gguf.expert_bytes(1)
    trace_path = tmp_path / "t.trace"
    model, cache = load_cached(gguf, budget_bytes=6 * blob, layout="per-layer", record_routing=trace_path)
    assert cache.slots.per_layer and cache.slots.n_slots == 3 * cache.slots.quota
    assert all(l != 0 for l, _ in cache.filled_pairs) and cache.filled_pairs
    ids = [3, 17, 42, 5, 99, 7]
    got = model.logits_all(ids)
    ref = load_model(GGUFFile(mixed), backend=model.backend).logits_all(ids)
    torch.testing.assert_close(got, ref)  # the cache serves the same experts
    stats = {s.layer: s for s in cache.layer_stats()}
    assert stats[0].lookups == 0 and stats[1].lookups == 2 * len(ids)  # k = 2 per token
    cache.close()
    table = read_trace(trace_path).counts()
    assert table.shape == (4, E) and table[0].sum() == 0 and table[1].sum() == len(ids) * 2
    prof = Profile.from_counts(table).for_layers(gguf.config.moe_layers)
    assert len(prof.pairs) == 3 * E and 0 not in prof.layers_array()
    # a stage of only the dense layer runs without any expert cache
    from moeray.stages.runtime.model import StageModel

    stage = StageModel(gguf, 0, 1)
    assert stage.run_layers(stage.embed([ids]), stage.batch_meta([len(ids)], [0], stage.new_kv_cache(1, 8)),
                            stage.new_kv_cache(1, 8)).shape == (len(ids), gguf.config.hidden)


def test_profile_for_layers_keeps_order_and_counts():
    p = Profile.from_counts(np.array([[5, 0], [1, 9], [0, 2]]))
    q = p.for_layers([1, 2])
    assert q.pairs == [(1, 1), (2, 1), (1, 0), (2, 0)] and q.counts == [9, 2, 1, 0]
    assert q.layers == (1, 2) and p.for_layers([0, 1, 2]) is p
