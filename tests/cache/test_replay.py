"""Replaying traces through static / adaptive / lru caches and Belady's optimum."""
from __future__ import annotations

import itertools
import random
from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from moeray.cache.replay import _belady_hits, belady, replay
from moeray.cache.residency import Slots
from moeray.cache.trace import Trace, TraceHeader, TraceRecord


def make_trace(steps: list[list[list[int]]], n_experts: int = 8, k: int = 2) -> Trace:
    """steps[s][layer] = the k experts one token routes to, one token per step (decode)."""
    n_layers = len(steps[0])
    tr = Trace(TraceHeader(n_layers, n_experts, k, 0, n_layers))
    for pos, step in enumerate(steps):
        for layer, ids in enumerate(step):
            tr.records.append(TraceRecord(layer, pos, [list(ids)], [[1.0 / k] * k]))
    return tr


def random_trace(rng: random.Random, n_steps: int, n_layers: int, n_experts: int, k: int, skew: float = 1.5):
    weights = [1.0 / (e + 1) ** skew for e in range(n_experts)]
    steps = []
    for _ in range(n_steps):
        steps.append([rng.sample(range(n_experts), k) if skew == 0 else
                      _weighted_distinct(rng, n_experts, weights, k) for _ in range(n_layers)])
    return make_trace(steps, n_experts, k)


def _weighted_distinct(rng, n, weights, k):
    chosen = []
    while len(chosen) < k:
        e = rng.choices(range(n), weights)[0]
        if e not in chosen:
            chosen.append(e)
    return chosen


def brute_force_optimum(keys: list, capacity: int) -> int:
    """Exhaustive offline optimum: any initial contents, bypass allowed, any eviction on a miss."""
    universe = sorted(set(keys))
    best = {frozenset(s): 0 for r in range(capacity + 1) for s in itertools.combinations(universe, r)}
    for key in keys:
        nxt: dict = {}
        for state, hits in best.items():
            if key in state:
                cands = [(state, hits + 1)]
            else:
                cands = [(state, hits)]
                if len(state) < capacity:
                    cands.append((state | {key}, hits))
                cands += [((state - {v}) | {key}, hits) for v in state]
            for s, h in cands:
                if nxt.get(s, -1) < h:
                    nxt[s] = h
        best = nxt
    return max(best.values())


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=14), st.integers(1, 3))
def test_belady_equals_brute_force_optimum(keys, capacity):
    assert int(_belady_hits(keys, capacity).sum()) == brute_force_optimum(keys, capacity)


@pytest.mark.parametrize("per_layer", [False, True])
def test_belady_bounds_every_online_policy(per_layer):
    rng = random.Random(7)
    tr = random_trace(rng, n_steps=300, n_layers=3, n_experts=8, k=2)
    slots = Slots(True, 3, 9) if per_layer else Slots(False, 0, 9)
    fill = [(l, e) for e in range(8) for l in range(3)]     # experts 0.. of every layer: a good fill
    opt = belady(tr, slots).hit_rate
    for policy, copies in [("static", 1), ("adaptive", 1), ("lru", 1), ("lru", None)]:
        r = replay(tr, policy, slots, fill, copies_per_step=copies)
        assert r.hit_rate <= opt + 1e-12, (policy, copies)
    assert opt > replay(tr, "static", slots, fill).hit_rate   # the bound is not trivially tied


def test_counters_add_up_to_tokens_times_k():
    rng = random.Random(1)
    tr = random_trace(rng, n_steps=50, n_layers=4, n_experts=8, k=2)
    for policy in ("static", "adaptive", "lru"):
        r = replay(tr, policy, Slots(False, 0, 5), [(0, 0), (1, 0), (2, 0), (3, 0), (0, 1)])
        assert list(r.lookups) == [50 * 2] * 4
        assert (r.hits <= r.lookups).all()
    b = belady(tr, Slots(False, 0, 5))
    assert list(b.lookups) == [100] * 4


def test_static_hits_are_exactly_the_lookups_of_filled_pairs():
    rng = random.Random(3)
    tr = random_trace(rng, n_steps=80, n_layers=2, n_experts=8, k=2)
    fill = [(0, 0), (1, 0), (0, 1), (1, 3)]
    r = replay(tr, "static", Slots(False, 0, 4), fill)
    expect = np.zeros(2, dtype=np.int64)
    for rec in tr.records:
        expect[rec.layer] += sum((rec.layer, e) in fill for row in rec.ids for e in row)
    assert list(r.hits) == list(expect)
    assert r.copies == 0


def test_unlimited_lru_matches_a_plain_lru():
    rng = random.Random(5)
    tr = random_trace(rng, n_steps=200, n_layers=2, n_experts=8, k=2, skew=0.7)
    cap = 5
    r = replay(tr, "lru", Slots(False, 0, cap), [], copies_per_step=None)
    od: OrderedDict = OrderedDict()
    hits = 0
    for rec in tr.records:
        for e in rec.ids[0]:
            key = (rec.layer, e)
            if key in od:
                hits += 1
                od.move_to_end(key)
            else:
                if len(od) == cap:
                    od.popitem(last=False)
                od[key] = None
    assert int(r.hits.sum()) == hits


def test_adaptive_follows_a_shift_of_the_hot_set_one_copy_per_step():
    # One layer, 8 experts, top-2, 2 slots filled with {0, 1}; after 100 steps the traffic moves to {6, 7}.
    steps = [[[0, 1]]] * 100 + [[[6, 7]]] * 400
    tr = make_trace(steps)
    slots = Slots(False, 0, 2)
    static = replay(tr, "static", slots, [(0, 0), (0, 1)])
    adaptive = replay(tr, "adaptive", slots, [(0, 0), (0, 1)])
    assert static.hit_rate == pytest.approx(100 / 500)
    # Heat of 0 and 1 is 100 each; a newcomer must pass 100 + 100/4 + 4 = 129 hits: expert 6
    # swaps in at the first 16-token boundary after that (tick 240), and since a step copies at
    # most one expert, expert 7 waits for the next boundary (tick 256).
    assert adaptive.resident == [(0, 6), (0, 7)]
    assert adaptive.copies == 2
    assert int(adaptive.hits[0]) == 200 + (500 - 240) + (500 - 256)


def test_adaptive_hysteresis_keeps_a_resident_that_is_nearly_as_hot():
    # Expert 0 resident with heat 100; expert 1 then reaches 110 < 100 + 100/4 + 4: no swap.
    steps = [[[0, 3]]] * 100 + [[[1, 3]]] * 110
    tr = make_trace(steps)
    r = replay(tr, "adaptive", Slots(True, 2, 2), [(0, 0), (0, 3)])
    assert r.copies == 0
    # Past the threshold the newcomer wins exactly once.
    tr2 = make_trace([[[0, 3]]] * 100 + [[[1, 3]]] * 160)
    r2 = replay(tr2, "adaptive", Slots(True, 2, 2), [(0, 0), (0, 3)])
    assert r2.copies == 1


def test_copy_limit_per_step_holds_for_lru_in_prefill():
    # A 64-token prefill step touching 16 different experts: limited LRU may copy only one of them.
    tr = Trace(TraceHeader(1, 16, 2, 0, 1))
    tr.records.append(TraceRecord(0, 0, [[t % 16, (t + 1) % 16] for t in range(64)], [[0.5, 0.5]] * 64))
    r = replay(tr, "lru", Slots(False, 0, 4), [], copies_per_step=1)
    assert r.copies == 1
    r_inf = replay(tr, "lru", Slots(False, 0, 4), [], copies_per_step=None)
    assert r_inf.copies > 1


@pytest.mark.parametrize("policy", ["adaptive", "lru"])
def test_budget_never_exceeded_with_unequal_blobs(policy):
    rng = random.Random(11)
    tr = random_trace(rng, n_steps=400, n_layers=3, n_experts=8, k=2, skew=0.8)
    blobs = [100, 250, 170]          # a cold fill (experts 7, 6, ...) so that both policies swap
    for slots in (Slots(False, 0, 5), Slots(True, 2, 6)):
        r = replay(tr, policy, slots, [(l, e) for e in reversed(range(8)) for l in range(3)], blob_bytes=blobs,
                   copies_per_step=None if policy == "lru" else 1)
        assert r.extra["peak_bytes"] <= r.extra["capacity_bytes"]
        assert r.copies > 0
