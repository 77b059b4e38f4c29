"""Shared builders for the planner tests (plain functions, no torch)."""
from __future__ import annotations

import numpy as np

from moeray.planner.devices import DeviceSpec
from moeray.planner.profile import Profile
from moeray.planner.spec import ModelSpec, TrunkBytes

GIB = 1 << 30


def moe_48x512(seed: int = 0, trunk_per_layer: int = 0):
    """48 layers x 512 experts, top-10, per-layer blob sizes around 2.3 MB (IQ3-like, two quant mixes)."""
    rng = np.random.default_rng(seed)
    L, E = 48, 512
    blob = [2_329_000 if l % 4 == 0 else 1_900_000 + int(rng.integers(0, 200_000)) for l in range(L)]
    spec = ModelSpec(L, E, 10, blob, TrunkBytes(400_000_000, 600_000_000, [trunk_per_layer] * L))
    return spec


def cards_12_12_8_8(fast_ms=0.4, slow_ms=1.2, miss_ms=0.5):
    """The 12 GiB cards are 3x faster per layer: a split by speed strands the 8 GiB cards' VRAM."""
    return [DeviceSpec("12a", 12 * GIB, fast_ms, miss_ms), DeviceSpec("12b", 12 * GIB, fast_ms, miss_ms),
            DeviceSpec("8a", 8 * GIB, slow_ms, miss_ms), DeviceSpec("8b", 8 * GIB, slow_ms, miss_ms)]


def skewed_profile(L: int, E: int, seed: int = 0) -> Profile:
    """Zipf-like counts per layer, hot experts at random places: what a real router trace looks like."""
    rng = np.random.default_rng(seed)
    base = 1.0 / np.arange(1, E + 1) ** 1.1
    counts = np.stack([rng.permutation(base) for _ in range(L)]) * 1e6
    return Profile.from_counts(np.rint(counts).astype(np.int64))
