"""How much of the routed traffic a ranked (layer, expert) pair carries.

Strata's measurements found that hit rate follows the *count* of held pairs almost alone, so
without measured counts the mass of the pair at global rank r is the increment of
H(f) = 1 - (1 - f)^b over the held fraction: prefixes sum to exactly H(n/T). b = 3 puts
H(0.8138) at 99.35% (the validated 2-GPU regime) and H(0.59) at 93.2% (92.2% measured).
A moeray profile can carry counts, and then the measured shares can be used instead.

What the planner prices must be what the caches will hold (`mass_model`): with counts it uses
them, and fits b to them so the curve it prints is calibrated; with no profile at all the caches
are filled in index order, i.e. with arbitrary experts, so it prices the uniform share (b = 1)
instead of promising a hottest-first fill nobody makes.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moeray.errors import ProfileError

DEFAULT_COVER_B = 3.0


def H(f, b: float = DEFAULT_COVER_B):
    """Share of the routed mass held by the hottest fraction f of the ranked pairs."""
    f = np.asarray(f, dtype=np.float64)
    return 1.0 - (1.0 - f) ** b


def curve_mass(n_pairs: int, b: float = DEFAULT_COVER_B) -> np.ndarray:
    """m[r] = H((r+1)/T) - H(r/T) for r in 0..T-1."""
    edges = H(np.arange(n_pairs + 1, dtype=np.float64) / n_pairs, b)
    return np.diff(edges)


def counts_mass(counts) -> np.ndarray:
    """Measured share of each ranked pair: count[r] / sum(count)."""
    c = np.asarray(counts, dtype=np.float64)
    total = c.sum()
    if total <= 0:
        raise ProfileError("--mass counts needs a profile whose counts are not all zero")
    return c / total


def pair_mass(profile, mode: str = "curve", b: float = DEFAULT_COVER_B) -> np.ndarray:
    """Mass of each pair of `profile` in its rank order, by the H curve or by its counts."""
    if mode == "curve":
        return curve_mass(len(profile.pairs), b)
    if mode == "counts":
        if profile.counts is None:
            raise ProfileError("--mass counts needs a profile with counts (a moeray profile from traces, "
                               "or a colibri heat file); this one holds a ranking only")
        return counts_mass(profile.counts_array())
    raise ValueError(f"unknown mass mode {mode!r}: use 'curve' or 'counts'")


# --- which mass the planner prices with ------------------------------------------------------

B_FIT_RANGE = (0.05, 1000.0)
FIT_POINTS = 1024  # points of the cumulative curve the fit of b reads


def fit_cover_b(counts) -> float:
    """b of H(f) = 1 - (1 - f)^b closest to a profile's measured curve: least squares over the
    cumulative share held by the hottest n pairs, n = 1..T (the curve's own definition), so curve
    mode is calibrated on the routing the profile saw instead of assumed. A 1-D convex-looking
    problem: a log-spaced grid, then golden-section search in log b around the best point."""
    c = np.sort(np.asarray(counts, dtype=np.float64).ravel())[::-1]
    total = c.sum()
    if total <= 0:
        raise ProfileError("fitting the mass curve needs a profile whose counts are not all zero")
    T = c.size
    # The curve is smooth in n, so at most FIT_POINTS evenly spaced n (both ends kept) weigh it as
    # all T do: a 24,576-pair profile is fitted in a few milliseconds instead of most of a plan's time.
    n = np.unique(np.linspace(1, T, min(T, FIT_POINTS)).round().astype(np.int64))
    cum = (np.cumsum(c) / total)[n - 1]
    one_minus_f = 1.0 - n.astype(np.float64) / T

    def err(log_b: float) -> float:
        return float(np.square(1.0 - one_minus_f ** np.exp(log_b) - cum).sum())

    lo, hi = np.log(B_FIT_RANGE[0]), np.log(B_FIT_RANGE[1])
    grid = np.linspace(lo, hi, 40)
    i = int(np.argmin([err(x) for x in grid]))
    a, b = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
    g = (np.sqrt(5.0) - 1.0) / 2.0
    x1, x2 = b - g * (b - a), a + g * (b - a)
    e1, e2 = err(x1), err(x2)
    for _ in range(30):  # the bracket shrinks to 0.618^30 of two grid steps: b to ~1e-6 relative
        if e1 <= e2:
            b, x2, e2 = x2, x1, e1
            x1 = b - g * (b - a)
            e1 = err(x1)
        else:
            a, x1, e1 = x1, x2, e2
            x2 = a + g * (b - a)
            e2 = err(x2)
    return float(np.exp((a + b) / 2.0))


@dataclass(frozen=True)
class MassModel:
    """How the planner prices a pair's share of the routed traffic, and why.

    mode   "counts": the profile's measured shares; "curve": H with exponent b.
    b      the exponent of H (also reported in counts mode: the curve that fits the counts).
    source where b comes from: "fitted", "given" (the caller's: --cover-b), "uniform" (no profile:
           the cache holds arbitrary experts, so a held pair carries the average share, b = 1),
           "default" (a ranking without counts: b = 3, Strata's fit).
    picks  routed picks the profile counted (0 without counts).
    """
    mode: str
    b: float
    source: str
    picks: int = 0

    def pair_mass(self, profile) -> np.ndarray:
        if self.mode == "counts":
            return counts_mass(profile.counts_array())
        return curve_mass(len(profile.pairs), self.b)

    def line(self) -> str:
        curve = {"fitted": f"mass curve: b={self.b:.2f} fitted from {self.picks} routed picks",
                 "given": f"mass curve: b={self.b:g} as given (--cover-b)",
                 "uniform": "mass curve: b=1 (no profile: the caches hold arbitrary experts, so each "
                            "holds the average share; pass --profile to plan a hottest-first fill)",
                 "default": f"mass curve: b={self.b:g} (default; the profile ranks pairs without counts)",
                 }[self.source]
        if self.mode == "counts":
            return f"mass: the profile's measured counts ({self.picks} routed picks); {curve}"
        return curve


def mass_model(profile, mode: str = "auto", b: float | None = None) -> MassModel:
    """The MassModel for `profile` (None = no profile at all), a --mass choice and a given b.

    auto: counts when the profile has them (unless b is given), else the curve. The curve's b is,
    in order: `b` when given (LaunchOptions.cover_b, --cover-b); fitted to the profile's counts;
    1 (uniform) with no profile; 3 for a ranking without counts.
    """
    if mode not in ("auto", "curve", "counts"):
        raise ValueError(f"unknown mass mode {mode!r}: use 'auto', 'curve' or 'counts'")
    counts = None if profile is None else profile.counts_array()
    picks = 0 if counts is None else int(counts.sum())
    if mode == "counts" and picks <= 0:
        if counts is None:
            raise ProfileError("--mass counts needs a profile with counts (a moeray profile from traces, "
                               "or a colibri heat file); " + ("none was given" if profile is None else
                                                             "this one holds a ranking only"))
        raise ProfileError("--mass counts needs a profile whose counts are not all zero")
    if b is not None:
        if not b > 0:
            raise ProfileError(f"b of the mass curve must be > 0, got {b}")
        source = "given"
    elif picks > 0:
        b, source = fit_cover_b(counts), "fitted"
    elif profile is None:
        b, source = 1.0, "uniform"
    else:
        b, source = DEFAULT_COVER_B, "default"
    if mode == "auto":  # a b set by hand is a request for the curve
        mode = "counts" if picks > 0 and source != "given" else "curve"
    return MassModel(mode, b, source, picks)
