"""ExpertCache: the hot experts of one stage, held on the stage's device; the `Experts` its MoE
blocks are built with.

A hit is computed from a slot: a copy of the expert's three matrices in their stored block form
(the GGUF's bytes, so a slot costs exactly the expert's GGUF size) on the stage's device. A miss is
computed from the host copy (the GGUF mapping), as llama.cpp's --cpu-moe, Strata and colibri
do. The host object (moeray.stages.blocks.moe.HostExperts) is handed in, so this package imports nothing
of moeray.stages. A slot holds the same bytes as the host copy and the experts' outputs are added
in the same order whatever serves them, so on the CPU the output is identical for every cache size
and policy.

Which pairs are resident, the per-layer counters and the policies live in `CacheCore`
(cache/residency.py), shared with the replay. Every slot filled charges the `ByteBudget` the
bytes its tensors hold; the budget refuses rather than overruns.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from moeray.cache.budget import ByteBudget
from moeray.cache.residency import CacheCore, Slots
from moeray.cache.slot_store import SlotStore
from moeray.errors import ProfileError

LAYOUTS = ("global", "per-layer")


@dataclass(frozen=True)
class LayerStats:
    layer: int
    lookups: int
    hits: int
    misses: int
    resident: int

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0


class ExpertCache:
    """The experts of layers [first, end): slots charged to `budget` in front of `host` (a
    HostExperts: `weights(layer, expert)`, `slot_bytes(layer)`, `forward(...)`)."""

    def __init__(self, host, first: int, end: int, budget: ByteBudget, *,
                 layout: str = "global", policy: str = "static", device: str | torch.device = "cpu",
                 copies_per_step: int | None = 1, swap_every: int = 16, decay_every: int = 1024):
        if layout not in LAYOUTS:
            raise ValueError(f"slot layout {layout!r}: choose one of {', '.join(LAYOUTS)}")
        cfg = host.gguf.config
        if not any(cfg.is_moe_layer(l) for l in range(first, end)):
            raise ProfileError(f"{host.gguf.path}: layers {first}-{end - 1} are dense (no routed experts to cache)")
        self.host, self.first, self.end = host, first, end
        self.config = cfg
        self.device = torch.device(device)
        self.budget = budget
        # Bytes one slot holds and one expert takes in the GGUF, per layer (equal unless exact).
        self.held_bytes = [host.slot_bytes(l) for l in range(first, end)]
        self.gguf_bytes = [host.gguf.expert_bytes(l) for l in range(first, end)]
        max_blob = max(self.held_bytes)
        n_uniform = budget.capacity // max_blob
        self.layout_message = f"{n_uniform} uniform slots of {max_blob} bytes"
        if layout == "per-layer":
            from moeray.planner.slots import per_layer_slots

            plan = per_layer_slots(n_uniform, self.held_bytes)
            slots = Slots.from_layout(plan)
            self.layout_message = plan.message
        else:
            slots = Slots(False, 0, n_uniform)
        self.slots = slots
        self._weights: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        # On the host's ggml route the slots are rows of one buffer (a hit is an index into it,
        # read by the same mul_mat_id graph as the mapping); elsewhere each slot holds an object.
        self.slot_store = SlotStore.for_host(host, first, end, slots.n_slots, self.held_bytes, self.device)
        # Where the slots are host memory, a split layer computes from the mapping (one_stack).
        self.split_from_host = self.device.type == "cpu"
        self.core = CacheCore(first, end, cfg.n_experts, self.held_bytes, slots, budget, policy,
                              copies_per_step=copies_per_step, swap_every=swap_every,
                              decay_every=decay_every, on_load=self._load, on_unload=self._unload)
        self.served_from_slot = 0   # get() calls answered by a slot (once per expert per step)
        self.served_from_host = 0
        self.filled_pairs: list[tuple[int, int]] = []
        self.trace_writer = None
        self._one: dict[int, object] = {}  # one_stack's answer per layer, until residency changes
        self._stage_sources = None  # after_stage's (stacks, from a slot per layer, ...) for the last stacks

    @property
    def policy(self) -> str:
        return self.core.policy_name

    # -- slots -----------------------------------------------------------------------------------
    def _load(self, layer: int, expert: int, slot: int) -> None:
        self._one.clear()
        if self.slot_store is not None:
            n = self.slot_store.load(layer, expert, slot)  # copied into the slot's row of the buffer
        else:
            w = self.host.weights(layer, expert).to(self.device)  # owned copy, never a view of the mapping
            n = w.nbytes
            self._weights[slot] = w
        if n != self.held_bytes[layer - self.first]:
            raise RuntimeError(f"slot of layer {layer} holds {n} bytes, {self.held_bytes[layer - self.first]} charged")

    def _unload(self, layer: int, expert: int, slot: int) -> None:
        self._one.clear()
        if self.slot_store is not None:
            self.slot_store.unload(slot)
        else:
            del self._weights[slot]

    def fill(self, profile) -> int:
        """Fill the slots from `profile` (planner.profile.Profile) by the planner's stop rule:
        walk the pairs hottest first, take this stage's layers, stop at the first that does not
        fit. With per-layer slots each layer takes its own hottest `quota` pairs."""
        from moeray.planner.fill import fill_stage

        cfg = self.config
        profile.check_model(cfg.n_layers, cfg.n_experts)
        profile = profile.for_layers(cfg.moe_layers)  # a dense layer has no pairs
        full = [0] * cfg.n_layers     # the planner indexes blob sizes by absolute layer
        if self.slots.per_layer:
            for l in range(self.first, self.end):
                full[l] = self.held_bytes[l - self.first]
            pairs: list[tuple[int, int]] = []
            for l in range(self.first, self.end):
                if not full[l]:
                    continue  # dense: no slots
                pairs += fill_stage(self.slots.quota * full[l], l, l + 1, profile, full)
            rank = {p: r for r, p in enumerate(profile.pairs)}
            pairs.sort(key=rank.__getitem__)
        else:
            slot_size = max(self.held_bytes)
            full = [slot_size] * cfg.n_layers
            pairs = fill_stage(self.slots.n_slots * slot_size, self.first, self.end, profile, full)
        n = self.core.fill(pairs)
        self.filled_pairs = pairs[:n]
        return n

    def resident_bytes(self) -> int:
        """Bytes the filled slots really hold (what was copied into them)."""
        if self.slot_store is not None:
            return sum(self.slot_store.held.values())
        return sum(w.nbytes for w in self._weights.values())

    def slot_bytes(self, layer: int) -> int:
        """Bytes one slot of `layer` holds (as HostExperts.slot_bytes)."""
        return self.held_bytes[layer - self.first]

    # -- Experts -----------------------------------------------------------------------------------
    def lookup(self, layer: int, expert: int) -> int | None:
        return self.core.lookup(layer, expert)

    def forward(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Count this call's lookups and let the policy act (at most one copy per step) before the
        experts run, so a swap made now already serves this call; then compute hits from slots and
        misses through the host.

        Per layer the bookkeeping is one host copy of the ids and a few numpy ops over [E]-sized
        arrays (the picks per expert counted once, by bincount): a step with every expert
        resident costs what the host path costs, whose graph it shares."""
        ids = ids.detach().to("cpu")  # one copy to the host per layer, for the counters and the grouping
        ids_np = ids.numpy()
        picks = self._route(layer, ids_np, weights)  # [E] picks of each expert in this call
        if self.slot_store is None:
            return self.host.forward(layer, x, ids, weights, self._slot_weights)
        table = self.core.slot_of[layer - self.first]  # read after the policy acted: -1 where a miss
        hit_experts = self._served(picks, table >= 0)
        if not hit_experts:  # every pick from the mapping: the host path itself
            return self.host.forward_stacks(layer, x, ids, weights)
        lo, slots = self._slot_window(layer, table)
        slot_of = table[ids_np]
        return self.host.forward_stacks(layer, x, ids, weights, np.where(slot_of >= 0, slot_of - lo, -1), slots)

    def _served(self, picks: np.ndarray, from_slot: np.ndarray) -> int:
        """Count the experts a call used by what served them; the number served from a slot."""
        used = picks > 0
        hit_experts = int(np.count_nonzero(used & from_slot))
        self.served_from_slot += hit_experts
        self.served_from_host += int(np.count_nonzero(used)) - hit_experts
        return hit_experts

    def one_stack(self, layer: int):
        """The stack that serves every pick of the layer's coming step, known without its ids:
        the slot buffer when every expert of the layer is resident, the mapping when none is or
        when the slots are host memory (None: a split layer on a card, or slots that are objects
        there). Read before the policy acts on the step: a swap it makes then serves from the
        next step on (the same bytes either way: a slot holds the host stack's layout), while
        the counters count as forward does."""
        if self.slot_store is None:
            return None
        if layer in self._one:  # asked per layer per step; kept until a slot is loaded or unloaded
            return self._one[layer]
        table = self.core.slot_of[layer - self.first]
        resident = table >= 0
        if resident.all():
            lo, slots = self._slot_window(layer, table)
            one = self.host.one_stack(layer, slots, torch.from_numpy((table - lo).astype(np.int32)))
        elif not resident.any() or self.split_from_host:
            # A split layer on a CPU device: its slots hold the mapping's own bytes in the same
            # memory, so the mapping serves every pick inside the layer's graph and the stage
            # keeps its one graph a decode step (after the graph it cost one or two graphs a
            # layer more: docs/performance.md, "Four Ray stages"). The counters still count the
            # slots' hits (what the device would serve); served_from_host what computed them.
            one = self.host.one_stack(layer)
        else:
            one = None  # a split layer on a card: hits from its slots there, misses on the host
        self._one[layer] = one
        return one

    def _slot_window(self, layer: int, table: np.ndarray):
        """(lo, the slot stack over rows lo .. the last the layer's residents use; `table`: the
        layer's slot_of row): a hit's index in it is its slot - lo."""
        held = table[table >= 0]
        lo = int(held.min())
        return lo, self.slot_store.window(layer, lo, int(held.max()) - lo + 1)

    def after_one_stack(self, layer: int, ids: torch.Tensor, weights: torch.Tensor, one) -> None:
        """forward's counting for a step whose experts ran inside the layer's graph: the lookups,
        the policy's turn, the trace; the experts it used, by the stack that served them."""
        picks = self._route(layer, ids.numpy(), weights)
        slots = one.slot_of is not None
        self._served(picks, np.full(picks.shape, slots))
        if not slots:
            self.host.computed += int(np.count_nonzero(picks))

    def after_stage(self, layers: list[int], ids: torch.Tensor, weights: torch.Tensor, ones: list) -> None:
        """after_one_stack for every MoE layer of a step that ran as one stage graph (ids, weights
        [L, N, k], ones: each layer's OneStack), counted in one pass over the layers' picks."""
        if self.trace_writer is not None:  # the trace records each layer's call
            for l, i, w, one in zip(layers, ids, weights, ones):
                self.after_one_stack(l, i, w, one)
            return
        picks = self.core.route_layers(layers, ids.numpy())
        kept = self._stage_sources
        if kept is None or kept[0] is not ones:  # the same list while the stacks stay (StageModel)
            from_slot = np.array([one.slot_of is not None for one in ones])[:, None]
            kept = self._stage_sources = (ones, from_slot, ~from_slot[:, 0], bool(from_slot.all()))
        _, from_slot, host_rows, all_slots = kept
        if all_slots:  # every layer from its slots: what the counters add needs no mask
            self.served_from_slot += int(np.count_nonzero(picks))
            return
        self._served(picks, np.broadcast_to(from_slot, picks.shape))
        self.host.computed += int(np.count_nonzero(picks[host_rows]))

    def _slot_weights(self, layer: int, expert: int):
        slot = self.core.lookup(layer, expert)
        if slot is None:
            self.served_from_host += 1
            return None
        self.served_from_slot += 1
        return self._weights[slot]

    def on_route(self, layer: int, expert_ids: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        """Count the call's lookups, let the policy act, and record the routing if tracing."""
        self._route(layer, expert_ids.detach().to("cpu").numpy(), weights)

    def _route(self, layer: int, ids: np.ndarray, weights: torch.Tensor | None) -> np.ndarray:
        picks = self.core.route(layer, ids)
        if self.trace_writer is not None:
            self.trace_writer.record(layer, ids, weights.detach().to("cpu", torch.float32).numpy())
        return picks

    # -- statistics --------------------------------------------------------------------------------
    def layer_stats(self) -> list[LayerStats]:
        resident = (self.core.slot_of >= 0).sum(axis=1)
        return [LayerStats(self.first + i, int(self.core.lookups[i]), int(self.core.hits[i]),
                           int(self.core.misses[i]), int(resident[i])) for i in range(self.end - self.first)]

    def hit_rate(self) -> float:
        return self.core.hit_rate()

    def stats(self) -> dict:
        c = self.core
        if self.trace_writer is not None:  # a polled stage's trace stays current with its counters
            self.trace_writer.flush()
        return {
            "layers": [self.first, self.end], "policy": self.policy,
            "layout": "per-layer" if self.slots.per_layer else "global",
            "layout_message": self.layout_message,
            "slots": self.slots.n_slots, "quota": self.slots.quota, "resident": c.n_resident,
            "budget_bytes": self.budget.capacity, "used_bytes": self.budget.used, "peak_bytes": self.budget.peak,
            "held_bytes_per_slot": self.held_bytes, "gguf_bytes_per_expert": self.gguf_bytes,
            "lookups": int(c.lookups.sum()), "hits": int(c.hits.sum()), "misses": int(c.misses.sum()),
            "hit_rate": c.hit_rate(), "copies": c.copies, "steps": c.steps, "ticks": c.ticks,
            "routed": self.core.routed.tolist(),  # [layer - first][expert] picks: the stage's live profile
            "per_layer": [{"layer": s.layer, "lookups": s.lookups, "hits": s.hits, "misses": s.misses,
                           "resident": s.resident} for s in self.layer_stats()],
        }

    def close(self) -> None:
        if self.trace_writer is not None:
            self.trace_writer.close()
        self.host.close()
