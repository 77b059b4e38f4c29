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
            src, dst = self._rows(pairs, self.pool.n_blocks, self.n_slots)
            self._copy(self.pool.k + self.pool.v, self.k + self.v, src, dst)
            self.stats.saved += len(pairs)
            self.stats.saved_bytes += len(pairs) * self.block_bytes()

    def load(self, pairs: list[tuple[int, int]]) -> None:
        """For each (host slot, pool block): the slot's rows, every layer, back into the block."""
        if pairs:
            src, dst = self._rows(pairs, self.n_slots, self.pool.n_blocks)
            self._copy(self.k + self.v, self.pool.k + self.pool.v, src, dst)
            self.stats.loaded += len(pairs)
            self.stats.loaded_bytes += len(pairs) * self.block_bytes()

    def _rows(self, pairs, n_src: int, n_dst: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The row indices of whole blocks: every (a, b) pair's 16 rows, in order."""
        a = torch.tensor([p[0] for p in pairs])
        b = torch.tensor([p[1] for p in pairs])
        if not (0 <= int(a.min()) and int(a.max()) < n_src and 0 <= int(b.min()) and int(b.max()) < n_dst):
            raise MoerayError(f"host tier copy {pairs[:4]}... names a block outside the pool ({self.pool.n_blocks}) "
                              f"or the tier ({self.n_slots})")
        step = torch.arange(self.pool.block_size)
        bs = self.pool.block_size
        return (a.view(-1, 1) * bs + step).flatten(), (b.view(-1, 1) * bs + step).flatten()

    @staticmethod
    def _copy(srcs, dsts, src_rows: torch.Tensor, dst_rows: torch.Tensor) -> None:
        for s, d in zip(srcs, dsts):
            if s is None:
                continue
            rows = s.index_select(1, src_rows.to(s.device))
            d.index_copy_(1, dst_rows.to(d.device), rows.to(d.device))
