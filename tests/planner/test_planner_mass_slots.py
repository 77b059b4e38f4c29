import numpy as np
import pytest

from moeray.planner.devices import DeviceSpec
from moeray.planner.fill import fill_stage, slot_fill_ranks
from moeray.planner.mass import H, counts_mass, curve_mass, fit_cover_b, mass_model, pair_mass
from moeray.planner.profile import Profile
from moeray.planner.search import plan_placement
from moeray.planner.spec import ModelSpec, TrunkBytes
from moeray.planner.slots import per_layer_slots
from moeray import environment
from moeray.errors import MoerayError, ProfileError


def test_seed_H_values():
    assert H(0.8138, 3) == pytest.approx(0.99354, abs=5e-6)
    assert H(0.5, 3) == pytest.approx(0.875)
    assert H(14541 / 24576, 3) == pytest.approx(0.93192, abs=5e-6)


def test_curve_prefix_sums_are_H_and_b_is_overridable(monkeypatch):
    T = 24576
    m = curve_mass(T)
    assert m.sum() == pytest.approx(1.0)
    assert (np.diff(m) <= 1e-18).all()  # hottest first
    for n in (1, 5805, 8620, 14541, 20000):
        assert m[:n].sum() == pytest.approx(float(H(n / T, 3)), rel=1e-12)
    assert curve_mass(T, 6)[:5805].sum() == pytest.approx(1 - (1 - 5805 / T) ** 6)
    # b's debugging override is read by moeray/environment.py, never by the planner
    monkeypatch.setenv("MOERAY_SPLIT_COVER_B", "sharp")
    with pytest.raises(MoerayError, match="MOERAY_SPLIT_COVER_B"):
        environment.overrides("launch")


def test_counts_mode_uses_the_measured_shares():
    prof = Profile.from_counts([[30, 10], [0, 60]])
    assert prof.pairs[:3] == [(1, 1), (0, 0), (0, 1)]
    np.testing.assert_allclose(pair_mass(prof, "counts"), [0.6, 0.3, 0.1, 0.0])
    with pytest.raises(ProfileError, match="counts"):
        pair_mass(Profile.uniform(2, 2), "counts")
    with pytest.raises(ProfileError):
        counts_mass([0, 0])


def seed_002_blobs():
    # 12 layers at the largest blob, 36 smaller: chosen so that N*max = 15.20 GiB and q*sum = 15.14 GiB
    return [2_329_000] * 12 + [1_551_338] * 36


def test_seed_002_per_layer_slots_146_to_194():
    blobs = seed_002_blobs()
    lay = per_layer_slots(7008, blobs)
    assert 7008 // 48 == 146
    assert lay.per_layer and lay.quota == 194 and lay.n_slots == 9312
    assert lay.bytes_after < lay.bytes_before  # more slots in slightly less memory
    assert lay.message == ("per-layer slots use each layer's blob: 7008 uniform slots (15.20 GiB) -> "
                           "9312 slots, 194 per layer (15.14 GiB)")


def test_per_layer_slots_keep_uniform_when_one_copy_of_every_layer_does_not_fit():
    lay = per_layer_slots(30, seed_002_blobs())  # 30 big slots < one copy of all 48 layers
    assert not lay.per_layer and lay.quota == 0 and lay.n_slots == 30
    assert lay.bytes_after == lay.bytes_before == 30 * 2_329_000
    assert "uniform" in lay.message


# --- the mass the planner prices with (issue 11) -------------------------------------------------

def curve_counts(L, E, b, scale=1e7):
    """Counts whose cumulative share follows H(f) = 1 - (1 - f)^b, spread over layers at random."""
    T = L * E
    share = np.diff(1 - (1 - np.arange(T + 1) / T) ** b)
    table = np.zeros(T, dtype=np.int64)
    table[np.random.default_rng(0).permutation(T)] = np.rint(share * scale).astype(np.int64)
    return table.reshape(L, E)


@pytest.mark.parametrize("b", [1.0, 2.5, 6.0])
def test_fitted_b_recovers_the_curve_the_counts_follow(b):
    assert fit_cover_b(curve_counts(30, 8, b)) == pytest.approx(b, rel=0.01)


def test_mass_model_uses_counts_and_prints_the_fitted_b():
    prof = Profile.from_counts(curve_counts(30, 8, 2.5))
    m = mass_model(prof)
    assert m.mode == "counts" and m.source == "fitted" and m.picks == sum(prof.counts)
    assert m.line().endswith(f"mass curve: b={m.b:.2f} fitted from {m.picks} routed picks")
    np.testing.assert_allclose(m.pair_mass(prof), counts_mass(prof.counts))
    curve = mass_model(prof, "curve")
    assert curve.mode == "curve" and curve.b == m.b
    np.testing.assert_allclose(curve.pair_mass(prof), curve_mass(240, m.b))


def test_no_profile_prices_the_uniform_share_not_a_hottest_first_fill():
    m = mass_model(None)
    assert (m.mode, m.b, m.source) == ("curve", 1.0, "uniform")
    np.testing.assert_allclose(m.pair_mass(Profile.uniform(3, 4)), np.full(12, 1 / 12))
    # A plan without a profile: each stage's caches hold the share of its pairs they hold.
    spec = ModelSpec(4, 8, 2, [10] * 4, TrunkBytes(0, 0, [0] * 4))
    plan = plan_placement(spec, [DeviceSpec("a", 100, 1, 1), DeviceSpec("b", 60, 1, 1)], None, trunk="off")
    for s in plan.stages:
        assert s.held_mass / s.routed_mass == pytest.approx(len(s.held_pairs) / (s.n_layers * 8))
    assert "b=1 (no profile" in plan.lines()[-1]
    with pytest.raises(ProfileError, match="none was given"):
        mass_model(None, "counts")


def test_a_given_b_overrides_the_fit_and_means_the_curve():
    prof = Profile.from_counts(curve_counts(30, 8, 2.5))
    for given in (prof, None, Profile.uniform(30, 8)):
        m = mass_model(given, b=4)
        assert (m.mode, m.b, m.source) == ("curve", 4.0, "given")
    assert mass_model(prof, "counts", b=4).mode == "counts"
    assert mass_model(Profile.uniform(30, 8)).source == "default"   # a ranking without counts: b = 3
    assert mass_model(Profile.uniform(30, 8)).b == 3.0


@pytest.mark.parametrize("per_layer", [True, False])
def test_slot_fill_is_what_the_cache_fill_takes(per_layer):
    """The planner's prediction is priced on the pairs the runtime's slots hold: per-layer slots
    take each layer's hottest quota (the walk of ExpertCache.fill), uniform slots the range's hottest."""
    rng = np.random.default_rng(3)
    prof = Profile.from_counts(rng.integers(0, 50, (6, 5)))
    layout = per_layer_slots(9, [1] * 3) if per_layer else per_layer_slots(2, [1] * 3)
    assert layout.per_layer == per_layer
    got = [prof.pairs[r] for r in slot_fill_ranks(prof.layers_array(), 2, 5, layout)]
    if per_layer:
        want = [p for l in range(2, 5) for p in fill_stage(layout.quota, l, l + 1, prof, [1] * 6)]
        assert sorted(got) == sorted(want) and len(got) == 3 * layout.quota
    else:
        assert got == fill_stage(2, 2, 5, prof, [1] * 6)
