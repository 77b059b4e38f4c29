import struct

import msgpack
import numpy as np
import pytest

from moeray.planner.profile import HEAT_MAGIC, Profile
from moeray.errors import ProfileError


def test_uniform_profile_interleaves_layers():
    p = Profile.uniform(3, 2)
    assert p.pairs == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]
    assert p.counts is None


def test_moeray_round_trip_and_partial_ranking(tmp_path):
    counts = np.random.default_rng(1).integers(0, 50, (4, 6))
    p = Profile.from_counts(counts)
    p.save(tmp_path / "p.msgpack")
    q = Profile.load(tmp_path / "p.msgpack", 4, 6)
    assert q.pairs == p.pairs and q.counts == p.counts
    # A trace that saw only three pairs: the rest follow, interleaved across layers.
    doc = {"format": "moeray-profile", "version": 1, "n_layers": 2, "n_experts": 3,
           "pairs": [[1, 2], [0, 1], [1, 0]], "counts": [9, 5, 1]}
    (tmp_path / "part.msgpack").write_bytes(msgpack.packb(doc))
    r = Profile.load(tmp_path / "part.msgpack")
    assert r.pairs == [(1, 2), (0, 1), (1, 0), (0, 0), (1, 1), (0, 2)]
    assert r.counts == [9, 5, 1, 0, 0, 0]


def test_strp_round_trip_full_and_partial(tmp_path):
    p = Profile.from_counts(np.random.default_rng(2).integers(1, 99, (5, 7)))
    p.save_strp(tmp_path / "full.strp")
    assert Profile.load(tmp_path / "full.strp").pairs == p.pairs
    p.save_strp(tmp_path / "part.strp", n_ranked=4)
    q = Profile.load(tmp_path / "part.strp", 5, 7)
    assert q.pairs[:4] == p.pairs[:4] and sorted(q.pairs) == sorted(p.pairs)
    assert q.counts is None  # STRP holds ranks only
    raw = (tmp_path / "full.strp").read_bytes()
    assert raw[:4] == b"STRP" and struct.unpack_from("<5I", raw, 4) == (1, 5, 7, 0, 35)


def test_colibri_heat_round_trip(tmp_path):
    counts = np.random.default_rng(3).integers(0, 1000, (3, 8))
    p = Profile.from_counts(counts)
    p.save_heat(tmp_path / "heat.bin")
    q = Profile.load(tmp_path / "heat.bin")
    assert q.pairs == p.pairs and q.counts == p.counts
    np.testing.assert_array_equal(q.count_table(), counts)
    # ranked hottest first
    assert q.counts == sorted(q.counts, reverse=True)


def test_corrupt_and_mismatched_profiles_are_refused(tmp_path):
    p = Profile.from_counts(np.arange(12).reshape(3, 4) + 1)
    p.save_strp(tmp_path / "a.strp")
    p.save_heat(tmp_path / "a.heat")
    p.save(tmp_path / "a.mp")
    raw = (tmp_path / "a.strp").read_bytes()
    bad = {
        "trunc.strp": raw[:30],
        "short.strp": raw[:10],
        "table.strp": raw[:-4] + struct.pack("<i", 5),  # rank table disagrees with the pair list
        "version.strp": raw[:4] + struct.pack("<I", 2) + raw[8:],
        "trunc.heat": (tmp_path / "a.heat").read_bytes()[:-4],
        "garbage.bin": b"\x00\x01not a profile at all",
        "empty.bin": b"",
        "dup.mp": msgpack.packb({"format": "moeray-profile", "version": 1, "n_layers": 2, "n_experts": 2,
                                 "pairs": [[0, 0], [0, 0]]}),
        "range.mp": msgpack.packb({"format": "moeray-profile", "version": 1, "n_layers": 2, "n_experts": 2,
                                   "pairs": [[2, 0]]}),
        "other.mp": msgpack.packb({"format": "something-else"}),
    }
    for name, data in bad.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ProfileError) as exc:
            Profile.load(tmp_path / name)
        assert name in str(exc.value), name  # the message names the file
    for name in ("a.strp", "a.heat", "a.mp"):
        with pytest.raises(ProfileError, match="layers"):
            Profile.load(tmp_path / name, n_layers=4)
        with pytest.raises(ProfileError, match="experts"):
            Profile.load(tmp_path / name, n_layers=3, n_experts=5)
    with pytest.raises(ProfileError, match="cannot read"):
        Profile.load(tmp_path / "missing.bin")
    assert struct.pack("<I", HEAT_MAGIC) == b"1HTQ"
