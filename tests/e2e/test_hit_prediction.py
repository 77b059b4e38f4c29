"""The plan's hit-rate prediction holds when the default model is served (issue 11).

The plan printed at start-up promises each stage a hit rate; this checks the promise against what
the stages' expert caches count. The plan is made as the driver makes it (the trunk and KV priced
by the driver's held_spec, each stage's slots in the bytes its ExpertCache holds), one real
ExpertCache per stage is filled from the same profile, and the routing of serving-style batched
greedy decoding of prompts the profile never saw is fed to the caches through their own routing
hook (ExpertCache.on_route: the counters and policies of a live stage).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from moeray.cache.budget import ByteBudget
from moeray.cache.expert_cache import ExpertCache
from moeray.cache.trace import read_trace
from moeray.planner.devices import DeviceSpec
from moeray.planner.fill import slot_fill_ranks
from moeray.planner.profile import Profile
from moeray.planner.search import plan_placement

TOLERANCE = 0.10  # a stage's measured hit rate may differ from its prediction by 10 points
SLOTS_PER_STAGE = 24  # of the ~60 experts of a stage's 7-8 layers
# Served traffic the profile never saw (it is recorded from stages/data/prompts.json).
PROMPTS = [("chat", "Which planets have rings, and why do some not?"),
           ("chat", "Give me three tips for keeping a sourdough starter alive."),
           ("code", "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n"),
           ("code", "SELECT name, COUNT(*) FROM orders JOIN customers ON"),
           ("prose", "The lighthouse keeper had not seen a ship in eleven days when"),
           ("prose", "Rivers carve valleys slowly, grain by grain, and over millions of years")]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def setup(default_model_path, tmp_path_factory):
    from moeray.cache.attach import routing_trace
    from moeray.cluster.placement import held_spec
    from moeray.stages.blocks.kv_cache import kv_layer_bytes
    from moeray.stages.blocks.kv_cache import blocks_for
    from moeray.stages.runtime.default_profile import _OneExpertPerLayer, default_profile_for, greedy
    from moeray.stages.gguf.reader import GGUFFile
    from moeray.stages.runtime.model import load_model
    from moeray.stages.blocks.moe import HostExperts
    from moeray.stages.text.tokenizer import Tokenizer

    gguf = GGUFFile(default_model_path)
    cfg = gguf.config
    profile = Profile.load(default_profile_for(default_model_path, quiet=True), cfg.n_layers, cfg.n_experts)
    tok = Tokenizer.from_metadata(gguf.metadata, source=str(default_model_path))
    prompts = [tok.encode_chat([{"role": "user", "content": t}]) if k == "chat" else tok.encode(t) for k, t in PROMPTS]
    trace_path = tmp_path_factory.mktemp("served") / "served.trace"
    writer = routing_trace(trace_path, cfg, 0, cfg.n_layers)
    greedy(load_model(gguf, experts=_OneExpertPerLayer(HostExperts(gguf), writer)), prompts, NEW_TOKENS, tok.end_ids)
    writer.close()

    host = HostExperts(gguf)
    spec = held_spec(gguf, kv_layer_bytes(cfg, 16 * blocks_for(512)))
    # The driver prices a slot in the bytes the cache holds, or no stage holds what its plan says.
    assert spec.expert_bytes == [host.slot_bytes(l) for l in range(cfg.n_layers)]
    # Four cards, each room for 8 layers' trunk and KV (the first also the embedding, the last the
    # head) and SLOTS_PER_STAGE experts: the caches hold about 3 of each layer's 8 experts.
    tb, room = spec.trunk_bytes, 8 * max(spec.trunk_bytes.layers) + SLOTS_PER_STAGE * max(spec.expert_bytes)
    devices = [DeviceSpec(f"sim{i}", room + extra, 1.0, 5.0)
               for i, extra in enumerate([tb.embedding, 0, 0, tb.head])]
    return host, profile, spec, devices, read_trace(trace_path)


def serve(host, plan, fill_order, trace, policy):
    """Each stage's ExpertCache, as the stage builds it (its room, per-layer slots, filled in
    `fill_order`), counting the served routing; returns the caches."""
    caches = [ExpertCache(host, s.first_layer, s.end_layer, ByteBudget(s.expert_room), layout="per-layer",
                          policy=policy) for s in plan.stages]
    for c in caches:
        c.fill(fill_order)
    stage_of = np.concatenate([np.full(s.n_layers, i) for i, s in enumerate(plan.stages)])
    for rec in trace.records:
        caches[stage_of[rec.layer]].on_route(rec.layer, torch.tensor(rec.ids), torch.tensor(rec.weights))
    return caches


@pytest.mark.parametrize("with_profile", [True, False], ids=["profile", "no-profile"])
def test_each_stage_measures_its_predicted_hit_rate(setup, with_profile):
    host, profile, spec, devices, trace = setup
    used = profile if with_profile else None
    plan = plan_placement(spec, devices, used, trunk="head=gpu,embed=gpu,layers=all")
    # A stage with no profile fills in the uniform ranking's order: arbitrary experts.
    fill_order = profile if with_profile else Profile.uniform(profile.n_layers, profile.n_experts)
    caches = serve(host, plan, fill_order, trace, "static")
    rows = []
    for s, c in zip(plan.stages, caches):
        # The planner's slot fill is exactly what the stage's cache took.
        planned = {fill_order.pairs[r] for r in slot_fill_ranks(fill_order.layers_array(), s.first_layer,
                                                                 s.end_layer, s.slots)}
        assert set(c.filled_pairs) == planned and c.core.n_resident == s.slot_pairs
        assert c.core.lookups.sum() > 0 and 0 < s.predicted_hit_rate < 1
        rows.append((s.index, s.predicted_hit_rate, c.hit_rate()))
    table = "\n".join(f"stage {i}: predicted {100 * p:.1f}%, measured {100 * m:.1f}%" for i, p, m in rows)
    for _, predicted, measured in rows:
        assert abs(measured - predicted) <= TOLERANCE, table
    if with_profile:  # the profile's fill is worth something: it beats the uniform share
        assert all(p > s.slot_pairs / (s.n_layers * spec.n_experts) + 0.1 for (_, p, _), s in zip(rows, plan.stages))


def test_a_learning_cache_does_not_fall_below_the_prediction(setup):
    """adaptive (the serving default) starts from the same fill and only swaps in hotter experts."""
    host, profile, spec, devices, trace = setup
    for used in (profile, None):
        plan = plan_placement(spec, devices, used, trunk="head=gpu,embed=gpu,layers=all")
        fill_order = used or Profile.uniform(profile.n_layers, profile.n_experts)
        for s, c in zip(plan.stages, serve(host, plan, fill_order, trace, "adaptive")):
            assert c.hit_rate() >= s.predicted_hit_rate - TOLERANCE, (s.index, s.predicted_hit_rate, c.hit_rate())
