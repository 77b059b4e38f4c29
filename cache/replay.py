"""Replay a routing trace through a cache and count what it would have hit.

The online policies run through the same `CacheCore` the stage's `ExpertCache` uses, so their
numbers are the numbers the real cache would count on the same routing. Belady's offline
optimum is the upper bound: it sees the future, evicts the resident whose next use is farthest,
may refuse to admit (bypass), loads any number of experts per step, and chooses the initial
contents freely (the first distinct experts to arrive while slots are free count as preloaded).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from moeray.cache.budget import ByteBudget
from moeray.cache.residency import CacheCore, Slots
from moeray.cache.trace import Trace


@dataclass
class ReplayResult:
    policy: str
    n_slots: int
    lookups: np.ndarray            # per layer of [first, end)
    hits: np.ndarray
    copies: int = 0
    extra: dict = field(default_factory=dict)
    resident: list = field(default_factory=list)    # pairs resident at the end (online policies)

    @property
    def hit_rate(self) -> float:
        total = int(self.lookups.sum())
        return float(self.hits.sum()) / total if total else 0.0

    def to_json(self) -> dict:
        return {"policy": self.policy, "n_slots": self.n_slots, "hit_rate": self.hit_rate,
                "lookups": int(self.lookups.sum()), "hits": int(self.hits.sum()),
                "copies": self.copies, "per_layer_hit_rate": [
                    (float(h) / float(n) if n else 0.0) for h, n in zip(self.hits, self.lookups)],
                **self.extra}


def replay(trace: Trace, policy: str, slots: Slots, fill_pairs: Iterable[tuple[int, int]] = (), *,
           blob_bytes: Sequence[int] | None = None, copies_per_step: int | None = 1,
           swap_every: int = 16, decay_every: int = 1024) -> ReplayResult:
    """Run `trace` through a cache of `slots` filled with `fill_pairs`, under `policy`.

    blob_bytes (per layer of the trace's range) only matters when layers differ in size; by
    default every blob is one unit, so the budget is the slot count.
    """
    h = trace.header
    nl = h.end - h.first
    blobs = [1] * nl if blob_bytes is None else list(blob_bytes)
    if slots.per_layer:
        capacity = slots.quota * sum(blobs)
    else:
        capacity = slots.n_slots * max(blobs)
    core = CacheCore(h.first, h.end, h.n_experts, blobs, slots, ByteBudget(capacity, "replay"), policy,
                     copies_per_step=copies_per_step, swap_every=swap_every, decay_every=decay_every)
    core.fill(fill_pairs)
    for rec in trace.records:
        core.route(rec.layer, rec.ids)
    name = policy if copies_per_step == 1 else f"{policy}(copies/step={copies_per_step or 'inf'})"
    return ReplayResult(name, slots.n_slots, core.lookups.copy(), core.hits.copy(), core.copies,
                        {"peak_bytes": core.budget.peak, "capacity_bytes": capacity},
                        core.resident_pairs())


def _belady_hits(keys: list, capacity: int) -> np.ndarray:
    """Hit flag of every access under the offline optimum (bypass, free initial load), one pool."""
    hit = np.zeros(len(keys), dtype=bool)
    if capacity <= 0:
        return hit
    inf = len(keys) + 1
    next_use = [inf] * len(keys)
    seen: dict = {}
    for t in range(len(keys) - 1, -1, -1):
        next_use[t] = seen.get(keys[t], inf)
        seen[keys[t]] = t
    resident: dict = {}         # key -> its next use
    heap: list = []             # (-next use, key); stale entries are skipped
    preloading = True
    for t, key in enumerate(keys):
        nxt = next_use[t]
        if key in resident:
            hit[t] = True
        elif len(resident) < capacity:
            hit[t] = preloading     # while slots are free, it could have been loaded before step 1
        else:
            preloading = False
            while True:
                far, victim = heap[0]
                if resident.get(victim) == -far:
                    break
                heapq.heappop(heap)
            if -far <= nxt:         # every resident is needed sooner: bypass
                continue
            heapq.heappop(heap)
            del resident[victim]
        resident[key] = nxt
        heapq.heappush(heap, (-nxt, key))
    return hit


def belady(trace: Trace, slots: Slots) -> ReplayResult:
    """Offline optimum. Global slots are one pool of equal slots; per-layer slots, one pool per layer."""
    h = trace.header
    nl = h.end - h.first
    lookups = np.zeros(nl, dtype=np.int64)
    hits = np.zeros(nl, dtype=np.int64)
    keys: list = []
    for rec in trace.records:
        i = rec.layer - h.first
        flat = [e for row in rec.ids for e in row]
        lookups[i] += len(flat)
        keys.extend((i, e) for e in flat)
    layer_of = np.fromiter((k[0] for k in keys), dtype=np.int64, count=len(keys))
    if slots.per_layer:
        for i in range(nl):
            idx = np.flatnonzero(layer_of == i)
            hits[i] = int(_belady_hits([keys[t] for t in idx], slots.quota).sum())
    else:
        flags = _belady_hits(keys, slots.n_slots)
        hits = np.bincount(layer_of[flags], minlength=nl).astype(np.int64)
    return ReplayResult("belady", slots.n_slots, lookups, hits, 0)
