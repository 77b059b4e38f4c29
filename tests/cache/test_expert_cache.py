"""ExpertCache: slot layouts, the profile fill, the byte budget, counters, and identical output
whatever the cache holds. On the embedded default model: tests/e2e/test_expert_cache_default_model.py."""
from __future__ import annotations


import numpy as np
import pytest
import torch

from moeray.cache.budget import BudgetExceededError, ByteBudget, device_budget
from moeray.cache.expert_cache import ExpertCache
from moeray.cache.residency import CacheCore, Slots
from moeray.planner.profile import Profile
from moeray.planner.slots import per_layer_slots
from moeray.stages.gguf.writer import write_gguf
from moeray.stages.runtime.model import StageModel, load_cached, load_model
from moeray.stages.blocks.moe import HostExperts
from tiny_models import tiny_mixtral, token_ids


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    # Tiny matmuls on a shared 2-core machine: torch's intra-op threads only contend (30x slower).
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    """Mixtral-style tiny model: 3 layers, 6 experts, top-2."""
    return write_gguf(tiny_mixtral(), tmp_path_factory.mktemp("cache") / "tiny-mixtral.gguf", "F16")


def greedy(model: StageModel, prompt: list[int], n_new: int) -> list[int]:
    kv = model.new_kv_cache(1, len(prompt) + n_new)
    logits = model.step([prompt], [0], kv)
    out = []
    for _ in range(n_new):
        tok = int(logits[0].argmax())
        out.append(tok)
        logits = model.step([[tok]], [0], kv)
    return out


def counts_profile(n_layers: int, n_experts: int, seed: int = 0) -> Profile:
    rng = np.random.default_rng(seed)
    return Profile.from_counts(rng.integers(0, 1000, size=(n_layers, n_experts)))


# -- slot layouts ---------------------------------------------------------------------------------

def test_per_layer_slots_are_layer_ranges_and_fall_back_to_uniform():
    blobs = [300, 100, 200]                       # bytes per expert of layers 0, 1, 2
    layout = per_layer_slots(7, blobs)            # 7 slots of 300 = 2100 bytes -> q = 2100 // 600 = 3
    slots = Slots.from_layout(layout)
    assert (slots.per_layer, slots.quota, slots.n_slots) == (True, 3, 9)
    core = CacheCore(0, 3, 8, blobs, slots, ByteBudget(layout.bytes_after), "static")
    # Every layer's hottest pairs land in its own range layer*q + n.
    core.fill([(1, 5), (1, 2), (0, 7), (2, 0), (1, 1), (1, 0), (2, 3)])
    assert sorted(core.lookup(1, e) for e in (5, 2, 1)) == [3, 4, 5]
    assert core.lookup(1, 0) is None              # layer 1 was full: the walk stopped there
    assert core.lookup(0, 7) in range(0, 3)
    assert core.lookup(2, 0) in range(6, 9)
    assert core.budget.used == 300 + 3 * 100 + 200
    # One copy of every layer does not fit: uniform slots of the largest blob.
    fallback = per_layer_slots(1, blobs)
    assert Slots.from_layout(fallback) == Slots(False, 0, 1)
    assert "uniform" in fallback.message


def test_expert_cache_layouts_on_a_model(tiny_path):
    model = load_model(tiny_path)
    host = HostExperts(model.gguf)
    blob = ExpertCache(host, 0, 3, ByteBudget(0)).held_bytes[0]
    per_layer = ExpertCache(host, 0, 3, ByteBudget(7 * blob), layout="per-layer")
    assert (per_layer.slots.per_layer, per_layer.slots.quota, per_layer.slots.n_slots) == (True, 2, 6)
    assert "2 per layer" in per_layer.layout_message
    fallback = ExpertCache(host, 0, 3, ByteBudget(2 * blob), layout="per-layer")
    assert fallback.slots == Slots(False, 0, 2)
    glob = ExpertCache(host, 0, 3, ByteBudget(7 * blob + blob - 1))
    assert glob.slots == Slots(False, 0, 7)
    # A slot holds the expert's GGUF bytes (F16 here) on the quantised backends; float32 on the exact one.
    if host.backend == "exact":
        assert glob.held_bytes == [2 * g for g in glob.gguf_bytes]
    else:
        assert glob.held_bytes == glob.gguf_bytes
    assert ExpertCache(HostExperts(model.gguf, "exact"), 0, 3, ByteBudget(0)).held_bytes == [2 * g for g in glob.gguf_bytes]


# -- fill -------------------------------------------------------------------------------------------

def test_fill_takes_the_hottest_pairs_of_the_stage_in_rank_order(tiny_path):
    prof = counts_profile(3, 6)
    model, cache = load_cached(tiny_path, (1, 3), profile=prof, n_slots=5, layout="global")
    in_range = [p for p in prof.pairs if 1 <= p[0] < 3]
    assert cache.filled_pairs == in_range[:5]
    assert sorted(cache.core.resident_pairs()) == sorted(in_range[:5])
    assert all(cache.lookup(l, e) is not None for l, e in in_range[:5])
    assert all(cache.lookup(l, e) is None for l, e in in_range[5:])


def test_per_layer_fill_skips_a_full_layer_and_keeps_walking(tiny_path):
    model = load_model(tiny_path)
    # Layer 0 is hottest everywhere, so a global fill would give it every slot.
    counts = np.array([[900, 800, 700, 600, 500, 400], [90, 80, 70, 60, 50, 40], [9, 8, 7, 6, 5, 4]])
    host = HostExperts(model.gguf)
    blob = ExpertCache(host, 0, 3, ByteBudget(0)).held_bytes[0]
    glob = ExpertCache(host, 0, 3, ByteBudget(6 * blob))
    glob.fill(Profile.from_counts(counts))
    assert glob.core.resident_pairs() == [(0, e) for e in range(6)]
    per = ExpertCache(host, 0, 3, ByteBudget(6 * blob), layout="per-layer")
    per.fill(Profile.from_counts(counts))
    assert per.core.resident_pairs() == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]


def test_fill_stops_at_the_first_pair_without_room():
    # Global slots, a byte budget that runs out first: the 60-byte pair does not fit and nothing
    # after it is taken, though the later 10-byte pair would have fitted.
    core = CacheCore(0, 2, 4, [60, 10], Slots(False, 0, 4), ByteBudget(100), "static")
    n = core.fill([(1, 0), (0, 0), (1, 1), (0, 1), (1, 2)])
    assert n == 3 and core.resident_pairs() == [(0, 0), (1, 0), (1, 1)]
    assert core.budget.used == 80


def test_a_profile_for_another_model_is_refused(tiny_path):
    from moeray.errors import ProfileError

    with pytest.raises(ProfileError, match="layers"):
        load_cached(tiny_path, profile=Profile.uniform(30, 6), n_slots=2, layout="global")


@pytest.mark.parametrize("policy", ["adaptive", "lru"])
def test_a_cache_holding_every_expert_counts_a_stage_step_as_static_does(policy):
    # serve --local holds every expert or none: every pick hits, and a policy's counters of a
    # whole-stage step (route_layers, counted at once) are the static cache's, call for call.
    rng = np.random.default_rng(3)
    cores = {}
    for name in ("static", policy):
        core = cores[name] = CacheCore(0, 3, 4, [10, 0, 10], Slots(False, 0, 8), ByteBudget(100), name)
        assert core.fill([(l, e) for l in (0, 2) for e in range(4)]) == 8
    for _ in range(5):
        ids = rng.integers(0, 4, size=(2, 3, 2))  # layers 0 and 2, 3 tokens, top-2
        picks = [c.route_layers([0, 2], ids) for c in cores.values()]
        assert np.array_equal(picks[0], picks[1])
    a, b = cores.values()
    for name in ("routed", "lookups", "hits", "misses"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert b.hits.sum() == b.lookups.sum() == 5 * 2 * 3 * 2 and b.misses.sum() == 0
    assert b.steps == a.steps == 5 and b.copies == 0 and b.resident_pairs() == a.resident_pairs()


# -- budget -----------------------------------------------------------------------------------------

def test_budget_refuses_to_overrun():
    b = ByteBudget(100)
    b.charge(60)
    with pytest.raises(BudgetExceededError):
        b.charge(41)
    assert b.used == 60
    b.release(60)
    assert b.used == 0 and b.peak == 60
    with pytest.raises(Exception):
        device_budget("cpu", None)               # a CPU budget must be given


@pytest.mark.parametrize("policy", ["static", "adaptive", "lru"])
def test_budget_holds_and_counters_add_up_while_generating(tiny_path, policy):
    prof = counts_profile(3, 6, seed=4)
    blob = ExpertCache(HostExperts(load_model(tiny_path).gguf), 0, 3, ByteBudget(0)).held_bytes[0]
    budget = 5 * blob + 123                       # 5 slots and change
    model, cache = load_cached(tiny_path, budget_bytes=budget, profile=prof, policy=policy, layout="global")
    cache.core.policy.swap_every = 2              # swap often, so the budget is tested under churn
    prompt = token_ids(12)
    n_new = 24
    greedy(model, prompt, n_new)
    tokens = len(prompt) + n_new                  # greedy() feeds every new token back
    for s in cache.layer_stats():                 # the last layer's FFN: the prompt's last token only
        assert s.lookups == (tokens if s.layer < 2 else 1 + n_new) * 2
        assert s.hits + s.misses == s.lookups
    held = cache.resident_bytes()
    assert cache.budget.used == held == cache.core.n_resident * blob
    assert cache.budget.peak <= budget
    if policy != "static":
        assert 0 < cache.core.copies <= cache.core.steps      # at most one copy per step
    else:
        assert cache.core.copies == 0


# -- same output whatever the cache -------------------------------------------------------------------

def test_identical_greedy_output_across_cache_sizes_and_policies(tiny_path):
    prompt = token_ids(10)
    ref_model = load_model(tiny_path)
    reference = greedy(ref_model, prompt, 16)
    prof = counts_profile(3, 6, seed=1)
    for policy in ("static", "adaptive", "lru"):
        for n_slots in (0, 5, 18):                # empty, some, every expert
            model, cache = load_cached(tiny_path, profile=prof, policy=policy, n_slots=n_slots, layout="global")
            assert greedy(model, prompt, 16) == reference, (policy, n_slots)
            if n_slots == 18:
                assert cache.hit_rate() == 1.0
            if n_slots == 0:
                assert cache.hit_rate() == 0.0
            assert cache.served_from_slot + cache.served_from_host > 0


@pytest.mark.parametrize("policy", ["static", "adaptive", "lru"])
def test_replay_of_the_recorded_trace_counts_what_the_live_cache_counted(tiny_path, tmp_path, policy):
    from moeray.cache.replay import replay
    from moeray.cache.trace import read_trace

    trace_path = tmp_path / "live.trace"
    model, cache = load_cached(tiny_path, profile=counts_profile(3, 6, seed=2), policy=policy,
                               record_routing=trace_path, n_slots=4, layout="global")
    cache.core.policy.swap_every = 2
    greedy(model, token_ids(9), 20)
    cache.close()
    trace = read_trace(trace_path)
    assert len(trace.records) == 3 * 21               # every call of every layer recorded
    r = replay(trace, policy, cache.slots, cache.filled_pairs, swap_every=2)
    assert list(r.lookups) == list(cache.core.lookups)
    assert list(r.hits) == list(cache.core.hits)
    assert r.copies == cache.core.copies
