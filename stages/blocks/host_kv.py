"""The host tier of a stage's KV pool: blocks kept in this node's host memory after the pool gives
their block to another prefix, copied back when a later prompt begins with them.

Which block goes where is the engine's decision (cluster/kv_blocks.py HostTier, the same ledger
that names every block by its prefix hash): a step carries `StepBatch.kv_save` (pool block ->
host slot, before the block is written again) and `kv_load` (host slot -> pool block, before the
first step that reads it), and every stage moves its own layers' rows, so a stage keeps no
bookkeeping and each stage of a Ray pipeline keeps its own tier in its own process.

A slot holds one block's rows of every layer of the stage, as the pool stores them (its cache
types' bytes: a q8_0 pool's blocks take a quarter of float32's here too), so a block comes back
bit for bit. The slots are allocated once, uninitialised: the host's pages are taken as blocks
are saved, never more than `n_slots` blocks (the plan's share of MemAvailable).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moeray.errors import MoerayError


MAX_RUNS = 8  # runs of consecutive blocks copied slice by slice; more: one gather and scatter per tensor


@dataclass
class HostStats:
    saved: int = 0  # blocks copied from the pool into the tier
    loaded: int = 0  # blocks copied back into the pool (prefix hits served from host memory)
    saved_bytes: int = 0
    loaded_bytes: int = 0


class HostBlocks:
    """`n_slots` blocks of a KVPool's rows in host memory (pinned beside a card)."""

    def __init__(self, pool, n_slots: int):
        if n_slots < 1:
            raise MoerayError(f"a host tier needs at least one block, got {n_slots}")
        self.pool, self.n_slots = pool, n_slots
        rows = pool.block_size * n_slots
        pin = any(t.device.type == "cuda" for t in pool.k)
        # one host tensor per pool tensor, the same layout: [heads, slots * 16, row]
        self.k = [torch.empty((t.shape[0], rows, t.shape[2]), dtype=t.dtype, pin_memory=pin) for t in pool.k]
        self.v = [None if t is None else torch.empty((t.shape[0], rows, t.shape[2]), dtype=t.dtype, pin_memory=pin)
                  for t in pool.v]
        self.stats = HostStats()

    def nbytes(self) -> int:
        """Bytes the tier may hold (its slots; the pages are taken as they are written)."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v if t is not None)

    def block_bytes(self) -> int:
        return self.nbytes() // self.n_slots

    def save(self, pairs: list[tuple[int, int]]) -> None:
        """For each (pool block, host slot): the block's rows, every layer, into the slot."""
        if pairs:
            self._check(pairs, self.pool.n_blocks, self.n_slots)
            self._copy(self.pool.k + self.pool.v, self.k + self.v, pairs, self.pool.block_size)
            self.stats.saved += len(pairs)
            self.stats.saved_bytes += len(pairs) * self.block_bytes()

    def load(self, pairs: list[tuple[int, int]]) -> None:
        """For each (host slot, pool block): the slot's rows, every layer, back into the block."""
        if pairs:
            self._check(pairs, self.n_slots, self.pool.n_blocks)
            self._copy(self.k + self.v, self.pool.k + self.pool.v, pairs, self.pool.block_size)
            self.stats.loaded += len(pairs)
            self.stats.loaded_bytes += len(pairs) * self.block_bytes()

    def _check(self, pairs, n_src: int, n_dst: int) -> None:
        a, b = [p[0] for p in pairs], [p[1] for p in pairs]
        if not (0 <= min(a) and max(a) < n_src and 0 <= min(b) and max(b) < n_dst):
            raise MoerayError(f"host tier copy {pairs[:4]}... names a block outside the pool ({self.pool.n_blocks}) "
                              f"or the tier ({self.n_slots})")

    @staticmethod
    def runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
        """The pairs as (first a, first b, count) runs where both go on one block at a time."""
        out: list[list[int]] = []
        for a, b in pairs:
            if out and a == out[-1][0] + out[-1][2] and b == out[-1][1] + out[-1][2]:
                out[-1][2] += 1
            else:
                out.append([a, b, 1])
        return [tuple(r) for r in out]

    @staticmethod
    def _copy(srcs, dsts, pairs: list[tuple[int, int]], bs: int) -> None:
        """A few runs of consecutive blocks are copied as one slice per layer tensor each, straight
        into place (a long prefix's rows read and written once); many (a prefix evicted tail
        first lies in the tier's slots backwards) are gathered into a temporary and scattered, two
        ops per tensor rather than a copy per block per tensor."""
        runs = HostBlocks.runs(pairs)
        if len(runs) <= MAX_RUNS:
            for a, b, n in runs:
                for s, d in zip(srcs, dsts):
                    if s is not None:
                        d.narrow(1, b * bs, n * bs).copy_(s.narrow(1, a * bs, n * bs))
            return
        step = torch.arange(bs)
        src = (torch.tensor([p[0] for p in pairs]).view(-1, 1) * bs + step).flatten()
        dst = (torch.tensor([p[1] for p in pairs]).view(-1, 1) * bs + step).flatten()
        for s, d in zip(srcs, dsts):
            if s is not None:
                d.index_copy_(1, dst.to(d.device), s.index_select(1, src.to(s.device)).to(d.device))
