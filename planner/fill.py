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


class RangeTables:
    # Per-rank quantities, channel-major so that every cumulative sum runs along contiguous memory.
    W, M, C = range(3)
    N_CH = 3

    def __init__(self, layer_of_rank, blob_bytes, mass, block: int = 32):
        lay = np.asarray(layer_of_rank, dtype=np.int64)
        T, L = len(lay), len(blob_bytes)
        self.n_pairs, self.n_layers, self.block = T, L, block
        nb = max(1, -(-T // block))
        self.n_blocks = nb
        K = self.N_CH
        cols = np.zeros((K, nb * block))
        cols[self.W, :T] = np.asarray(blob_bytes, dtype=np.float64)[lay]
        cols[self.M, :T] = mass
        cols[self.C, :T] = 1.0
        # Padding ranks belong to "layer L", which no range [a, b) with b <= L contains.
        lay_p = np.full(nb * block, L, dtype=np.int64)
        lay_p[:T] = lay
        self.lay_blk = lay_p.reshape(nb, block)
        self.cols_blk = cols.reshape(K, nb, block)
        key = (np.arange(nb)[:, None] * (L + 1) + self.lay_blk).ravel()
        # G[ch, kb, x] = totals over blocks < kb and layers < x (layer L of the bincount is the padding)
        self.G = np.zeros((K, nb + 1, L + 1))
        for q in range(K):
            s = np.bincount(key, weights=cols[q], minlength=nb * (L + 1)).reshape(nb, L + 1)
            g = self.G[q]
            np.cumsum(s[:, :L], axis=0, out=g[1:, 1:])
            np.cumsum(g[1:, 1:], axis=1, out=g[1:, 1:])
        self.Gw_flat = self.G[self.W].ravel()
        self.layer_mass = np.bincount(lay, weights=cols[self.M, :T], minlength=L)
        self.layer_mass_prefix = np.concatenate([[0.0], np.cumsum(self.layer_mass)])
        self.n_steps = int(np.ceil(np.log2(nb + 1)))

    def routed(self, a, b) -> np.ndarray:
        """Routed mass of layers [a, b)."""
        return self.layer_mass_prefix[np.asarray(b)] - self.layer_mass_prefix[np.asarray(a)]

    def _range_totals(self, ch, kb, a, b):
        stride = self.n_layers + 1
        g = self.G[ch].ravel()
        return g[kb * stride + b] - g[kb * stride + a]

    def query(self, a, b, room) -> Fill:
        a = np.asarray(a, dtype=np.int64)
        b = np.asarray(b, dtype=np.int64)
        room = np.asarray(room, dtype=np.float64)
        # A range whose every pair fits needs no search: it holds all of it.
        nb, stride = self.n_blocks, self.n_layers + 1
        all_w = self.Gw_flat[nb * stride + b] - self.Gw_flat[nb * stride + a]
        full = all_w <= room
        if not full.any():
            return self._search(a, b, room)
        out = Fill(stop=np.full(a.shape, self.n_pairs, dtype=np.int64), bytes=all_w,
                   count=np.rint(self._range_totals(self.C, np.full(a.shape, nb), a, b)).astype(np.int64),
                   mass=self._range_totals(self.M, np.full(a.shape, nb), a, b))
        part = np.flatnonzero(~full)
        if part.size:
            f = self._search(a[part], b[part], room[part])
            out.stop[part], out.bytes[part], out.count[part], out.mass[part] = f.stop, f.bytes, f.count, f.mass
        return out

    def _search(self, a, b, room) -> Fill:
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
        # Inside block kb: the range's pairs in rank order until the first that does not fit.
        lays = self.lay_blk[kb]
        inr = (lays >= a[:, None]) & (lays < b[:, None])
        base_w = Gw[kb * stride + b] - Gw[kb * stride + a]
        w = np.where(inr, self.cols_blk[self.W, kb], 0.0)
        over = np.cumsum(w, axis=1) > (room - base_w)[:, None]
        j = np.where(over.any(axis=1), over.argmax(axis=1), blk)
        take = inr & (np.arange(blk)[None, :] < j[:, None])
        return Fill(stop=np.minimum(kb * blk + j, self.n_pairs),
                    bytes=base_w + np.where(take, w, 0.0).sum(axis=1),
                    count=(np.rint(self._range_totals(self.C, kb, a, b)).astype(np.int64) + take.sum(axis=1)),
                    mass=self._range_totals(self.M, kb, a, b) + np.where(take, self.cols_blk[self.M, kb], 0.0).sum(axis=1))

    def bytes_before(self, a, b, rank) -> np.ndarray:
        """Bytes of the range's pairs ranked before `rank` (no stop rule: what a prefix costs)."""
        a = np.asarray(a, dtype=np.int64)
        b = np.asarray(b, dtype=np.int64)
        rank = np.asarray(rank, dtype=np.int64)
        kb = np.minimum(rank // self.block, self.n_blocks - 1)
        j = rank - kb * self.block
        lays = self.lay_blk[kb]
        inr = (lays >= a[:, None]) & (lays < b[:, None]) & (np.arange(self.block)[None, :] < j[:, None])
        return self._range_totals(self.W, kb, a, b) + np.where(inr, self.cols_blk[self.W, kb], 0.0).sum(axis=1)


def slot_fill_ranks(layer_of_rank, first_layer: int, end_layer: int, slots) -> np.ndarray:
    """Global ranks of the pairs a stage's expert cache holds after its profile fill, for its real
    slot layout (planner.slots.SlotLayout, or None for no slots): per-layer slots take each layer's
    hottest `quota` pairs, uniform slots the range's hottest `n_slots` (ExpertCache.fill's rule).
    The stop-rule fill above prices a range; this is what the runtime then holds, so a stage's
    predicted hit rate is the mass of these ranks."""
    lay = np.asarray(layer_of_rank)
    ranks = np.flatnonzero((lay >= first_layer) & (lay < end_layer))
    if slots is None or slots.n_slots <= 0:
        return ranks[:0]
    if not slots.per_layer:
        return ranks[: slots.n_slots]
    own = lay[ranks]
    by_layer = np.argsort(own, kind="stable")  # grouped by layer, rank order inside each group
    grouped = own[by_layer]
    place = np.empty(len(ranks), dtype=np.int64)
    place[by_layer] = np.arange(len(ranks)) - np.searchsorted(grouped, grouped, side="left")
    return ranks[place < slots.quota]
