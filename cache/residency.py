"""Which (layer, expert) pairs are resident in which slot, what every lookup found, and the
policies that change residency while a stage runs.

This is the cache without its tensors (no torch here): `ExpertCache` wraps it with the
weights on the device, and `cache/replay.py` runs recorded traces through it, so a hit rate
measured in replay is the hit rate the real cache would count on the same routing.

Slots. A stage covers layers [first, end). Two layouts:
  global     n_slots slots of the largest blob, shared by all layers; slot s holds any pair.
  per-layer  every MoE layer gets the same quota q of slots at its own blob size; layer l's
             slots are j·q + n, n < q, j its index among the stage's MoE layers, so a slot never
             holds another layer's blob. A dense layer of an MoE model (blob 0) has no slots.
Every admission charges the `ByteBudget` the slot's held bytes first (it raises rather than
overrun) and every eviction releases them.

Steps. The engine runs the layers of a step in order, so a call whose layer is not greater
than the previous call's layer begins a new step. Every policy may copy at most
`copies_per_step` experts per step (default 1), so a swap never holds a step up for longer than
one expert copy. Ticks are tokens entering the stage (the first call of each step).

Policies:
  static    the profile fill, never changed (Strata's and colibri's default)
  adaptive  decayed heat counters; every `swap_every` ticks the hottest non-resident replaces
            the coldest resident (of the same layer when slots are per-layer) if its heat
            exceeds cold + cold/4 + 4; all heat halves every `decay_every` ticks (colibri's rule)
  lru       a miss is admitted in place of the least recently used resident, within the
            per-step copy limit (None = classic unlimited LRU, for comparison)
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np

from moeray.cache.budget import ByteBudget

POLICIES = ("static", "adaptive", "lru")


@dataclass(frozen=True)
class Slots:
    """The slot layout of one stage (from moeray.planner.slots.per_layer_slots or a plain global pool)."""
    per_layer: bool
    quota: int          # slots per layer when per_layer, else 0
    n_slots: int        # total slots

    @classmethod
    def from_layout(cls, layout) -> "Slots":
        """Adapt the planner's SlotLayout (per_layer, quota, n_slots, ...)."""
        return cls(bool(layout.per_layer), int(layout.quota) if layout.per_layer else 0, int(layout.n_slots))


class CacheCore:
    def __init__(self, first: int, end: int, n_experts: int, blob_bytes: Sequence[int],
                 slots: Slots, budget: ByteBudget, policy: str = "static", *,
                 copies_per_step: int | None = 1, swap_every: int = 16, decay_every: int = 1024,
                 on_load: Callable[[int, int, int], None] | None = None,
                 on_unload: Callable[[int, int, int], None] | None = None):
        if policy not in POLICIES:
            raise ValueError(f"cache policy {policy!r}: choose one of {', '.join(POLICIES)}")
        if len(blob_bytes) != end - first:
            raise ValueError(f"blob_bytes has {len(blob_bytes)} entries for layers [{first}, {end})")
        self.first, self.end, self.n_experts = first, end, n_experts
        self.blob_bytes = [int(b) for b in blob_bytes]
        self.slots = slots
        self.budget = budget
        self.policy_name = policy
        self.copies_per_step = copies_per_step
        self.on_load, self.on_unload = on_load, on_unload
        nl = end - first
        self.slot_of = np.full((nl, n_experts), -1, dtype=np.int64)   # -1: not resident
        self.pair_of: dict[int, tuple[int, int]] = {}
        self.slot_bytes: dict[int, int] = {}
        if slots.per_layer:
            moe_index = np.cumsum([b > 0 for b in self.blob_bytes]) - 1
            self._free = [list(range((j + 1) * slots.quota - 1, j * slots.quota - 1, -1)) if b > 0 else []
                          for j, b in zip(moe_index, self.blob_bytes)]
        else:
            self._free = [list(range(slots.n_slots - 1, -1, -1))]
        self.lookups = np.zeros(nl, dtype=np.int64)
        self.routed = np.zeros((nl, n_experts), dtype=np.int64)  # picks per (layer, expert): a live profile
        self.hits = np.zeros(nl, dtype=np.int64)
        self.misses = np.zeros(nl, dtype=np.int64)
        self.ticks = 0
        self.steps = 0
        self.copies = 0          # expert copies made while running (the initial fill is not counted)
        self._n_pairs = n_experts * sum(1 for b in self.blob_bytes if b > 0)  # every (layer, expert) there is
        self._stage_rows = None  # route_layers' (layers, their rows, bincount offsets) for the last layers
        self._last_layer = None
        self._copies_left = copies_per_step
        if policy == "adaptive":
            self.policy: _Policy = _Adaptive(self, swap_every, decay_every)
        elif policy == "lru":
            self.policy = _LRU(self)
        else:
            self.policy = _Policy(self)

    # -- residency -----------------------------------------------------------------------------
    def _free_list(self, layer: int) -> list[int]:
        return self._free[layer - self.first] if self.slots.per_layer else self._free[0]

    def lookup(self, layer: int, expert: int) -> int | None:
        s = int(self.slot_of[layer - self.first, expert])
        return None if s < 0 else s

    def has_room(self, layer: int) -> bool:
        n_bytes = self.blob_bytes[layer - self.first]
        return n_bytes > 0 and bool(self._free_list(layer)) and self.budget.fits(n_bytes)

    def admit(self, layer: int, expert: int) -> int:
        """Put (layer, expert) in a free slot; charges the budget first (raises if it would overrun)."""
        if self.slot_of[layer - self.first, expert] >= 0:
            raise ValueError(f"expert {expert} of layer {layer} is already resident")
        free = self._free_list(layer)
        if not free:
            raise ValueError(f"no free slot for layer {layer}")
        n_bytes = self.blob_bytes[layer - self.first]
        self.budget.charge(n_bytes)
        slot = free.pop()
        try:
            if self.on_load is not None:
                self.on_load(layer, expert, slot)
        except BaseException:
            free.append(slot)
            self.budget.release(n_bytes)
            raise
        self.slot_of[layer - self.first, expert] = slot
        self.pair_of[slot] = (layer, expert)
        self.slot_bytes[slot] = n_bytes
        return slot

    def evict(self, layer: int, expert: int) -> None:
        slot = self.lookup(layer, expert)
        if slot is None:
            raise ValueError(f"expert {expert} of layer {layer} is not resident")
        if self.on_unload is not None:
            self.on_unload(layer, expert, slot)
        self.slot_of[layer - self.first, expert] = -1
        del self.pair_of[slot]
        self.budget.release(self.slot_bytes.pop(slot))
        self._free_list(layer).append(slot)

    def fill(self, pairs: Iterable[tuple[int, int]]) -> int:
        """Admit `pairs` in order (the planner's fill decides them); returns how many were admitted.

        A pair of a layer outside this stage, or of a dense layer (no experts), is skipped; the
        walk stops at the first pair that has no room, which is the planner's stop rule (the
        planner's fill never offers one).
        """
        n = 0
        for layer, expert in pairs:
            if not (self.first <= layer < self.end) or self.lookup(layer, expert) is not None:
                continue
            if self.blob_bytes[layer - self.first] == 0:
                continue
            if not self.has_room(layer):
                break
            self.admit(layer, expert)
            n += 1
        self.policy.after_fill()
        return n

    @property
    def n_resident(self) -> int:
        return len(self.pair_of)

    def resident_pairs(self) -> list[tuple[int, int]]:
        return sorted(self.pair_of.values())

    def _copy(self, evict: tuple[int, int] | None, admit: tuple[int, int]) -> None:
        """One running swap: counts against this step's copy allowance."""
        if evict is not None:
            self.evict(*evict)
        self.admit(*admit)
        self.copies += 1
        if self._copies_left is not None:
            self._copies_left -= 1

    def can_copy(self) -> bool:
        return self._copies_left is None or self._copies_left > 0

    # -- routing -------------------------------------------------------------------------------
    def route(self, layer: int, expert_ids) -> np.ndarray:
        """Count one MoE call's lookups (expert_ids: [n_tokens, k]) and let the policy act; returns
        the call's picks per expert ([n_experts], what the live profile adds)."""
        ids = np.asarray(expert_ids, dtype=np.int64).reshape(len(expert_ids), -1)
        if self._last_layer is None or layer <= self._last_layer:
            self.steps += 1
            self._copies_left = self.copies_per_step
            old = self.ticks
            self.ticks += ids.shape[0]
            self.policy.on_ticks(old, self.ticks)
        self._last_layer = layer
        i = layer - self.first
        self.policy.touch(layer, ids)
        n = ids.size
        picks = np.bincount(ids.ravel(), minlength=self.n_experts)
        self.routed[i] += picks
        # A pick hits when its expert is resident: the picks of the resident experts, summed.
        hit = int(picks[self.slot_of[i] >= 0].sum()) if self.policy.counts_vectorised else self.policy.last_hits
        self.lookups[i] += n
        self.hits[i] += hit
        self.misses[i] += n - hit
        self.policy.after_call(layer)
        return picks

    def route_layers(self, layers: list[int], expert_ids: np.ndarray) -> np.ndarray:
        """route() for the MoE layers of one step at once (ascending; expert_ids [L, n_tokens, k]),
        the same counters in a few numpy calls instead of a Python call per layer; returns the picks
        per (layer, expert), [L, n_experts]. A policy that acts on each call (adaptive, lru) is
        given every call, one layer at a time, as before, unless every expert is resident (a stage
        whose cache holds them all, `serve --local`'s): no call can miss then, so no policy has a
        swap to make, and its per-layer Python (~0.4 ms a token on the default model's 30 layers,
        py-spy of a served stream) is left out; its heat starts counting again if an expert leaves."""
        ids = np.asarray(expert_ids, dtype=np.int64)
        if not len(layers):
            return np.zeros((0, self.n_experts), dtype=np.int64)
        if type(self.policy) is not _Policy and len(self.pair_of) < self._n_pairs:
            return np.stack([self.route(l, i) for l, i in zip(layers, ids)])
        L, N = ids.shape[0], ids.shape[1]
        if self._last_layer is None or layers[0] <= self._last_layer:  # the step's first layer, as route()
            self.steps += 1
            self._copies_left = self.copies_per_step
            old = self.ticks
            self.ticks += N
            self.policy.on_ticks(old, self.ticks)
        self._last_layer = layers[-1]
        kept = self._stage_rows
        if kept is None or kept[0] is not layers:  # the same list each step while the stacks stay
            rows = np.asarray(layers, dtype=np.int64) - self.first
            if len(rows) and (np.diff(rows) == 1).all():  # a run of layers: a view, not a gather
                rows = slice(int(rows[0]), int(rows[-1]) + 1)
            kept = self._stage_rows = (layers, rows, np.arange(L, dtype=np.int64)[:, None] * self.n_experts)
        _, rows, offsets = kept
        E = self.n_experts
        picks = np.bincount((offsets + ids.reshape(L, -1)).ravel(), minlength=L * E).reshape(L, E)
        n = ids[0].size
        # Every pair resident (serve --local's stage): each pick hits, no mask to read.
        hit = n if len(self.pair_of) == self._n_pairs else (picks * (self.slot_of[rows] >= 0)).sum(axis=1)
        self.routed[rows] += picks
        self.lookups[rows] += n
        self.hits[rows] += hit
        self.misses[rows] += n - hit
        return picks

    def reset_counters(self) -> None:
        self.lookups[:] = 0
        self.routed[:] = 0
        self.hits[:] = 0
        self.misses[:] = 0

    def hit_rate(self) -> float:
        total = int(self.lookups.sum())
        return float(self.hits.sum()) / total if total else 0.0


class _Policy:
    """static: residency is the fill."""
    counts_vectorised = True
    last_hits = 0

    def __init__(self, core: CacheCore):
        self.core = core

    def after_fill(self) -> None:
        pass

    def on_ticks(self, old: int, new: int) -> None:
        pass

    def touch(self, layer: int, ids: np.ndarray) -> None:
        pass

    def after_call(self, layer: int) -> None:
        pass


class _Adaptive(_Policy):
    def __init__(self, core: CacheCore, swap_every: int, decay_every: int):
        super().__init__(core)
        self.swap_every, self.decay_every = swap_every, decay_every
        self.heat = np.zeros(core.slot_of.shape, dtype=np.int64)
        self.swap_due = False
        self.swaps = 0

    def on_ticks(self, old: int, new: int) -> None:
        for _ in range(new // self.decay_every - old // self.decay_every):
            self.heat >>= 1
        if new // self.swap_every > old // self.swap_every:
            self.swap_due = True

    def touch(self, layer: int, ids: np.ndarray) -> None:
        # Counted before the lookup is scored: heat is what was asked for, resident or not.
        np.add.at(self.heat[layer - self.core.first], ids.ravel(), 1)

    def after_call(self, layer: int) -> None:
        if not self.swap_due or not self.core.can_copy():
            return
        self.swap_due = False
        choice = self._best_swap()
        if choice is not None:
            self.core._copy(*choice)
            self.swaps += 1

    def _best_swap(self):
        """(coldest resident or None for a free slot, hottest non-resident) passing hysteresis."""
        core, heat = self.core, self.heat
        resident = core.slot_of >= 0
        hot_heat = np.where(resident, -1, heat)
        cold_heat = np.where(resident, heat, np.iinfo(np.int64).max)
        if core.slots.per_layer:
            if core.slots.quota == 0:
                return None
            best, best_margin = None, 0
            for i in range(heat.shape[0]):
                e_new = int(hot_heat[i].argmax())
                h_new = int(hot_heat[i, e_new])
                if h_new < 0:
                    continue
                layer = core.first + i
                if core.has_room(layer):
                    cold, victim = 0, None
                else:
                    e_old = int(cold_heat[i].argmin())
                    cold, victim = int(cold_heat[i, e_old]), (layer, e_old)
                margin = h_new - (cold + cold // 4 + 4)
                if margin > best_margin:
                    best, best_margin = (victim, (layer, e_new)), margin
            return best
        flat_new = int(hot_heat.argmax())
        i_new, e_new = divmod(flat_new, heat.shape[1])
        h_new = int(hot_heat[i_new, e_new])
        if h_new < 0:
            return None
        newcomer = (core.first + i_new, e_new)
        if core.has_room(newcomer[0]):
            cold, victim = 0, None
        else:
            if core.n_resident == 0:
                return None
            flat_old = int(cold_heat.argmin())
            i_old, e_old = divmod(flat_old, heat.shape[1])
            cold, victim = int(cold_heat[i_old, e_old]), (core.first + i_old, e_old)
            # A smaller blob may not free room for a larger one's layer in a byte-tight budget.
            freed = core.blob_bytes[i_old]
            if core.budget.free + freed < core.blob_bytes[i_new]:
                return None
        if h_new > cold + cold // 4 + 4:
            return victim, newcomer
        return None


class _LRU(_Policy):
    counts_vectorised = False

    def __init__(self, core: CacheCore):
        super().__init__(core)
        nl = core.end - core.first
        self.order: list[OrderedDict] = [OrderedDict() for _ in range(nl if core.slots.per_layer else 1)]

    def _od(self, layer: int) -> OrderedDict:
        return self.order[layer - self.core.first] if self.core.slots.per_layer else self.order[0]

    def after_fill(self) -> None:
        # The fill is hottest first: make the hottest the most recently used.
        for od in self.order:
            od.clear()
        for layer, expert in reversed(list(self._fill_order())):
            self._od(layer)[(layer, expert)] = None

    def _fill_order(self):
        # Slots are handed out from a free list in order, so slot order within a pool is fill order.
        return [self.core.pair_of[s] for s in sorted(self.core.pair_of)]

    def touch(self, layer: int, ids: np.ndarray) -> None:
        core = self.core
        i = layer - core.first
        hits = 0
        od = self._od(layer)
        for e in ids.ravel().tolist():
            key = (layer, e)
            if core.slot_of[i, e] >= 0:
                hits += 1
                od.move_to_end(key)
                continue
            if not core.can_copy():
                continue
            if core.has_room(layer):
                core._copy(None, key)
            elif od:
                victim = next(iter(od))
                freed = core.blob_bytes[victim[0] - core.first]
                if core.budget.free + freed < core.blob_bytes[i]:
                    continue
                del od[victim]
                core._copy(victim, key)
            else:
                continue
            od[key] = None
        self.last_hits = hits
