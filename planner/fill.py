"""Stage fill: which ranked pairs a stage's expert cache holds, with the stop rule.

A stage owning layers [a, b) with `room` bytes walks the profile hottest first, takes only
pairs of its own layers, each costing its layer's blob, and stops at the first pair that does
not fit. The fill depends on (room, a, b) alone, so a placement's held mass is a sum over its
stages and the search can price every (stage, a, b) once.

`fill_stage` is the one-range form (the cache fills its slots with it). `RangeTables` answers
thousands of (a, b, room) questions at once: the bytes a range has taken by rank r,
W(a, b, r), is monotone in r and is a difference of layer prefixes, P(b, r) - P(a, r); so the
stop rank is the first r where W(a, b, r+1) > room, found by a binary search over block
boundaries (prefix sums every `block` ranks) and a cumulative sum inside one block.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def fill_ranks(room: float, first_layer: int, end_layer: int, layer_of_rank, blob_bytes) -> np.ndarray:
    """Global ranks of the pairs a stage holds, hottest first (stop at the first misfit)."""
    lay = np.asarray(layer_of_rank)
    ranks = np.flatnonzero((lay >= first_layer) & (lay < end_layer))
    cost = np.cumsum(np.asarray(blob_bytes, dtype=np.float64)[lay[ranks]])
    over = np.flatnonzero(cost > room)
    return ranks if over.size == 0 else ranks[: over[0]]


def fill_stage(room: float, first_layer: int, end_layer: int, profile, blob_bytes) -> list[tuple[int, int]]:
    """The (layer, expert) pairs, in rank order, that `room` bytes hold for layers [first, end)."""
    held = fill_ranks(room, first_layer, end_layer, profile.layers_array(), blob_bytes)
    return [profile.pairs[r] for r in held]


@dataclass
class Fill:
    """Answers of RangeTables.query, one entry per question."""
    stop: np.ndarray  # rank of the first pair that did not fit (n_pairs when all fit)
    bytes: np.ndarray
    count: np.ndarray
    mass: np.ndarray
    value: np.ndarray  # sum of p_e * blob over the held pairs (trunk pricing)

    def take(self, other: "Fill", idx: np.ndarray) -> None:
        """Overwrite entries `idx` with `other`'s answers (other has one entry per idx)."""
        for name in ("stop", "bytes", "count", "mass", "value"):
            getattr(self, name)[idx] = getattr(other, name)


class RangeTables:
    # Per-rank quantities kept side by side so one gather and one cumsum serve all four.
    W, M, V, C = range(4)

    def __init__(self, layer_of_rank, blob_bytes, mass, value=None, block: int = 32):
        lay = np.asarray(layer_of_rank, dtype=np.int64)
        T, L = len(lay), len(blob_bytes)
        self.n_pairs, self.n_layers, self.block = T, L, block
        nb = max(1, -(-T // block))
        self.n_blocks = nb
        pad = nb * block - T
        data = np.zeros((nb * block, 4))
        data[:T, self.W] = np.asarray(blob_bytes, dtype=np.float64)[lay]
        data[:T, self.M] = mass
        if value is not None:
            data[:T, self.V] = value
        data[:T, self.C] = 1.0
        # Padding ranks belong to "layer L", which no range [a, b) with b <= L contains.
        lay_p = np.concatenate([lay, np.full(pad, L, dtype=np.int64)])
        self.lay_blk = lay_p.reshape(nb, block)
        self.data_blk = data.reshape(nb, block, 4)
        key = np.repeat(np.arange(nb), block) * (L + 1) + lay_p
        cols = np.ascontiguousarray(data.T)
        sums = np.empty((nb, L + 1, 4))
        for q in range(4):
            sums[:, :, q] = np.bincount(key, weights=cols[q], minlength=nb * (L + 1)).reshape(nb, L + 1)
        # G[kb, x] = totals over blocks < kb and layers < x (column L of `sums` is the padding)
        self.G = np.zeros((nb + 1, L + 1, 4))
        np.cumsum(sums[:, :L], axis=0, out=self.G[1:, 1:])
        np.cumsum(self.G[1:, 1:], axis=1, out=self.G[1:, 1:])
        self.Gw_flat = np.ascontiguousarray(self.G[:, :, self.W]).ravel()
        self.layer_mass = np.bincount(lay, weights=data[:T, self.M], minlength=L)
        self.layer_mass_prefix = np.concatenate([[0.0], np.cumsum(self.layer_mass)])
        self.n_steps = int(np.ceil(np.log2(nb + 1)))

    def routed(self, a, b) -> np.ndarray:
        """Routed mass of layers [a, b)."""
        return self.layer_mass_prefix[np.asarray(b)] - self.layer_mass_prefix[np.asarray(a)]

    def query(self, a, b, room) -> Fill:
        a = np.asarray(a, dtype=np.int64)
        b = np.asarray(b, dtype=np.int64)
        room = np.asarray(room, dtype=np.float64)
        nb, blk, stride = self.n_blocks, self.block, self.n_layers + 1
        Gw = self.Gw_flat
        # Largest block boundary kb whose bytes still fit: kb = 0 always does (0 <= room).
        lo = np.zeros(a.shape, dtype=np.int64)
        hi = np.full(a.shape, nb, dtype=np.int64)
        for _ in range(self.n_steps):
            mid = (lo + hi + 1) >> 1
            row = mid * stride
            ok = (Gw[row + b] - Gw[row + a]) <= room
            lo = np.where(ok, mid, lo)
            hi = np.where(ok, hi, mid - 1)
        kb = np.minimum(lo, nb - 1)  # kb == nb: everything fits; walk the last block, nothing overflows
        lays = self.lay_blk[kb]
        inr = (lays >= a[:, None]) & (lays < b[:, None])
        cum = np.cumsum(self.data_blk[kb] * inr[:, :, None], axis=1)
        base = self.G[kb, b] - self.G[kb, a]
        over = cum[:, :, self.W] > (room - base[:, self.W])[:, None]
        j = np.where(over.any(axis=1), over.argmax(axis=1), blk)
        taken = np.where((j > 0)[:, None], cum[np.arange(len(j)), np.maximum(j - 1, 0)], 0.0)
        tot = base + taken
        return Fill(stop=np.minimum(kb * blk + j, self.n_pairs), bytes=tot[:, self.W],
                    count=np.rint(tot[:, self.C]).astype(np.int64), mass=tot[:, self.M], value=tot[:, self.V])

    def bytes_before(self, a, b, rank) -> np.ndarray:
        """Bytes of the range's pairs ranked before `rank` (no stop rule: what a prefix costs)."""
        a = np.asarray(a, dtype=np.int64)
        b = np.asarray(b, dtype=np.int64)
        rank = np.asarray(rank, dtype=np.int64)
        kb = np.minimum(rank // self.block, self.n_blocks - 1)
        j = rank - kb * self.block
        lays = self.lay_blk[kb]
        inr = (lays >= a[:, None]) & (lays < b[:, None]) & (np.arange(self.block)[None, :] < j[:, None])
        stride = self.n_layers + 1
        base = self.Gw_flat[kb * stride + b] - self.Gw_flat[kb * stride + a]
        return base + np.where(inr, self.data_blk[kb, :, self.W], 0.0).sum(axis=1)
