import numpy as np
import pytest

from moeray.planner.mass import H, COVER_B_ENV, counts_mass, curve_mass, pair_mass
from moeray.planner.profile import Profile
from moeray.planner.slots import per_layer_slots
from moeray.errors import ProfileError


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
    monkeypatch.setenv(COVER_B_ENV, "6")
    assert curve_mass(T)[:5805].sum() == pytest.approx(1 - (1 - 5805 / T) ** 6)
    monkeypatch.setenv(COVER_B_ENV, "sharp")
    with pytest.raises(ProfileError, match=COVER_B_ENV):
        curve_mass(T)


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
