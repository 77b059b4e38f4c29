"""Trunk placement: colibri's seven autoplace cases (seed 003), adapted to a stage of moeray."""
import numpy as np
import pytest

from moeray.planner.devices import DeviceSpec
from moeray.planner.profile import Profile
from moeray.planner.search import plan_placement
from moeray.planner.spec import ModelSpec, TrunkBytes
from moeray.planner.trunk import TrunkPolicy
from moeray.errors import PlacementError

BLOB = 100


def one_stage(free, E=4, k=2, head=0, embed=0, layers=(0, 0), counts=None, trunk="auto", cpu_factor=2.0):
    L = len(layers)
    spec = ModelSpec(L, E, k, [BLOB] * L, TrunkBytes(embed, head, list(layers)))
    prof = Profile.from_counts(counts) if counts is not None else Profile.uniform(L, E)
    plan = plan_placement(spec, [DeviceSpec("card", free, 1.0, 0.5)], prof, trunk=trunk, cpu_factor=cpu_factor,
                          handoff_ms=0.0)
    return plan.stages[0], plan


def verdict(stage, name):
    (d,) = [d for d in stage.trunk if d["component"] == name]
    return d["on_card"]


def test_fits_is_placed_and_the_budget_shrinks_by_exactly_the_trunk():
    st, plan = one_stage(free=10_000, head=700, layers=(300, 200))
    assert verdict(st, "lm_head") and verdict(st, "layer 0 trunk") and verdict(st, "layer 1 trunk")
    assert st.trunk_bytes == 1200 and st.expert_room == 10_000 - 1200
    assert st.host_trunk_ms == 0.0
    assert any(line.startswith("[place] stage 0: lm_head (") for line in plan.lines(verbose=True))
    assert not any(line.startswith("[place]") for line in plan.lines())  # all on the card: the default


def test_too_big_stays_on_the_host_and_costs_host_time():
    st, plan = one_stage(free=1_000, head=1_001)
    assert not verdict(st, "lm_head") and st.trunk_bytes == 0 and st.expert_room == 1_000
    assert "too big" in st.trunk[0]["why"]
    # a byte of dense weight on the host costs miss_ms / (cpu_factor * blob)
    assert st.host_trunk_ms == pytest.approx(1_001 * 0.5 / (2.0 * BLOB))


@pytest.mark.parametrize("with_counts", [False, True])
def test_hot_tail_keeps_its_experts_cold_tail_yields(with_counts):
    # p_marginal 0.67: k=2 of E=3 (or a heat share of 1/3 with k=2); the card is full of experts.
    hot = dict(E=3, k=2, counts=np.ones((2, 3), dtype=int) if with_counts else None)
    st, _ = one_stage(free=2 * 3 * BLOB, head=2 * BLOB, **hot)
    assert not verdict(st, "lm_head") and st.expert_room == 600 and len(st.held_pairs) == 6
    assert "p_marginal 0.67" in st.trunk[0]["why"]
    # p_marginal 0.17: k=1 of E=6 (or the coldest experts at a heat share of 1/6 with k=1).
    if with_counts:
        st, _ = one_stage(free=2 * 4 * BLOB, head=2 * BLOB, E=4, k=1, counts=np.array([[1, 1, 1, 3]] * 2))
        assert st.expert_room == 600 and len(st.held_pairs) == 6
    else:
        st, _ = one_stage(free=2 * 6 * BLOB, head=2 * BLOB, E=6, k=1)
        assert st.expert_room == 1000 and len(st.held_pairs) == 10
    assert verdict(st, "lm_head")
    assert "p_marginal 0.17" in st.trunk[0]["why"]
    if with_counts:  # the hot experts (count 3) are the ones kept
        assert {(0, 3), (1, 3)} <= {tuple(p) for p in st.held_pairs}


def test_room_no_expert_would_use_always_goes_to_the_trunk():
    # every expert of the stage fits with room to spare: even at p = 1 and value 0 (the embedding)
    st, _ = one_stage(free=2 * 2 * BLOB + 350, E=2, k=2, head=150, embed=200)
    assert verdict(st, "lm_head") and verdict(st, "embedding")
    assert len(st.held_pairs) == 4 and st.expert_room == 400
    assert all("no expert would use" in d["why"] for d in st.trunk)


def test_an_explicit_list_is_obeyed_and_charged_to_the_expert_budget():
    # at p = 2/3 auto would keep the experts; the list puts the head and layer 1 on the card anyway
    st, plan = one_stage(free=600, E=3, k=2, head=200, layers=(100, 100), trunk="lmhead=gpu,layers=1")
    assert verdict(st, "lm_head") and verdict(st, "layer 1 trunk") and not verdict(st, "layer 0 trunk")
    assert st.trunk_bytes == 300 and st.expert_room == 300 and len(st.held_pairs) == 3
    assert plan.trunk_mode == "lmhead=gpu,layers=1"
    with pytest.raises(PlacementError, match="--trunk head=gpu,layers=all: the trunk a stage holds on its card needs more VRAM"):
        one_stage(free=250, head=200, layers=(100, 100), trunk="head=gpu,layers=all")
    with pytest.raises(PlacementError, match="unknown component"):
        TrunkPolicy.parse("tail=gpu", 4)
    with pytest.raises(PlacementError, match="outside"):
        TrunkPolicy.parse("layers=2-9", 4)
    assert TrunkPolicy.parse("head=gpu,attn=0-1+3,embed=cpu", 4).layers == {0, 1, 3}


def test_off_places_nothing_and_prices_nothing():
    st, plan = one_stage(free=600, head=200, layers=(100, 100), trunk="off")
    assert st.trunk == [] and st.trunk_bytes == 0 and st.expert_room == 600 and st.host_trunk_ms == 0
    assert not any(line.startswith("[place]") for line in plan.lines())


def test_nothing_offered_is_a_no_op():
    st, plan = one_stage(free=500)
    off, _ = one_stage(free=500, trunk="off")
    assert st.trunk == [] and st.expert_room == 500
    assert [tuple(p) for p in st.held_pairs] == [tuple(p) for p in off.held_pairs]
    assert st.stage_ms == off.stage_ms


def test_each_stage_charges_its_own_card():
    spec = ModelSpec(4, 4, 1, [BLOB] * 4, TrunkBytes(50, 300, [10, 10, 10, 10]))
    devs = [DeviceSpec("big", 5_000, 1, 0.5), DeviceSpec("small", 500, 1, 0.5)]
    plan = plan_placement(spec, devs, split="K=2", cpu_factor=1.0)
    first, last = plan.stages
    assert [d["component"] for d in first.trunk] == ["layer 0 trunk", "layer 1 trunk", "embedding"]
    assert [d["component"] for d in last.trunk] == ["lm_head", "layer 2 trunk", "layer 3 trunk"]
    for s in plan.stages:
        placed = sum(d["bytes"] for d in s.trunk if d["on_card"])
        assert s.trunk_bytes == placed and s.expert_room == s.free_bytes - placed
