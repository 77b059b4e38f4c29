"""ExpertCache: the hot experts of one stage, held on the stage's device, as the MoE block's
ExpertSource.

A hit is served from a slot: the expert's three matrices in the compute format (float32, the
format the trunk runs in) on the stage's device. A miss is served from the host copy
(`HostExperts`, dequantised from the GGUF's mmap'd quantised bytes) and computed on the host, as
llama.cpp's --cpu-moe and the seeds' engines do. A slot holds exactly what the host would have
produced for that expert, and the MoE block adds the experts' outputs in the same order whatever
serves them, so on the CPU the output is bit-identical for every cache size and policy.

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
from moeray.errors import ProfileError
from moeray.stages.gguf_file import EXPERT_KINDS
from moeray.stages.moe import HostExperts

LAYOUTS = ("global", "per-layer")
COMPUTE_DTYPE = torch.float32


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


def slot_bytes(host: HostExperts, layer: int) -> int:
    """Bytes one slot of `layer` holds: the expert's three matrices in the compute format."""
    n = 0
    for kind in EXPERT_KINDS:
        _, shape = host.info(layer, kind)
        n += int(np.prod(shape)) * COMPUTE_DTYPE.itemsize
    return n


class ExpertCache:
    """ExpertSource for layers [first, end) of a model, with slots charged to `budget`."""

    def __init__(self, host: HostExperts, first: int, end: int, budget: ByteBudget, *,
                 layout: str = "global", policy: str = "static", device: str | torch.device = "cpu",
                 copies_per_step: int | None = 1, swap_every: int = 16, decay_every: int = 1024):
        if layout not in LAYOUTS:
            raise ValueError(f"slot layout {layout!r}: choose one of {', '.join(LAYOUTS)}")
        cfg = host.gguf.config
        if not cfg.is_moe:
            raise ProfileError(f"{host.gguf.path}: a dense model has no routed experts to cache")
        self.host, self.first, self.end = host, first, end
        self.config = cfg
        self.device = torch.device(device)
        self.budget = budget
        # Bytes one slot holds (compute format) and one expert takes in the GGUF, per layer.
        self.held_bytes = [slot_bytes(host, l) for l in range(first, end)]
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
        self.core = CacheCore(first, end, cfg.n_experts, self.held_bytes, slots, budget, policy,
                              copies_per_step=copies_per_step, swap_every=swap_every,
                              decay_every=decay_every, on_load=self._load, on_unload=self._unload)
        self.served_from_slot = 0   # get() calls answered by a slot (once per expert per step)
        self.served_from_host = 0
        self.filled_pairs: list[tuple[int, int]] = []
        self.trace_writer = None
        self.previous_hook = None   # the model's routing hook before attach_cache (restored on detach)

    @property
    def policy(self) -> str:
        return self.core.policy_name

    # -- slots -----------------------------------------------------------------------------------
    def _load(self, layer: int, expert: int, slot: int) -> None:
        ws = []
        for w in self.host.get(layer, expert):
            w = w.to(device=self.device, dtype=COMPUTE_DTYPE)
            if w.device.type == "cpu":
                w = w.clone()   # own memory: never a view of the read-only file mapping
            ws.append(w.contiguous())
        held = sum(w.numel() * w.element_size() for w in ws)
        if held != self.held_bytes[layer - self.first]:
            raise RuntimeError(f"slot of layer {layer} holds {held} bytes, {self.held_bytes[layer - self.first]} charged")
        self._weights[slot] = (ws[0], ws[1], ws[2])

    def _unload(self, layer: int, expert: int, slot: int) -> None:
        del self._weights[slot]

    def fill(self, profile) -> int:
        """Fill the slots from `profile` (planner.profile.Profile) by the planner's stop rule:
        walk the pairs hottest first, take this stage's layers, stop at the first that does not
        fit. With per-layer slots each layer takes its own hottest `quota` pairs."""
        from moeray.planner.fill import fill_stage

        cfg = self.config
        profile.check_model(cfg.n_layers, cfg.n_experts)
        full = [0] * cfg.n_layers     # the planner indexes blob sizes by absolute layer
        if self.slots.per_layer:
            for l in range(self.first, self.end):
                full[l] = self.held_bytes[l - self.first]
            pairs: list[tuple[int, int]] = []
            for l in range(self.first, self.end):
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

    # -- ExpertSource ------------------------------------------------------------------------------
    def lookup(self, layer: int, expert: int) -> int | None:
        return self.core.lookup(layer, expert)

    def get(self, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        slot = self.core.lookup(layer, expert)
        if slot is not None:
            self.served_from_slot += 1
            return self._weights[slot]
        self.served_from_host += 1
        return self.host.get(layer, expert)

    def on_route(self, layer: int, expert_ids: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        """The model's routing hook: count the call's lookups, let the policy act (at most one copy
        per step), and record the routing if a trace writer is attached."""
        ids = expert_ids.detach().to("cpu").numpy()
        self.core.route(layer, ids)
        if self.trace_writer is not None:
            self.trace_writer.record(layer, ids, weights.detach().to("cpu", torch.float32).numpy())

    # -- statistics --------------------------------------------------------------------------------
    def layer_stats(self) -> list[LayerStats]:
        resident = (self.core.slot_of >= 0).sum(axis=1)
        return [LayerStats(self.first + i, int(self.core.lookups[i]), int(self.core.hits[i]),
                           int(self.core.misses[i]), int(resident[i])) for i in range(self.end - self.first)]

    def hit_rate(self) -> float:
        return self.core.hit_rate()

    def stats(self) -> dict:
        c = self.core
        return {
            "layers": [self.first, self.end], "policy": self.policy,
            "layout": "per-layer" if self.slots.per_layer else "global",
            "layout_message": self.layout_message,
            "slots": self.slots.n_slots, "resident": c.n_resident,
            "budget_bytes": self.budget.capacity, "used_bytes": self.budget.used, "peak_bytes": self.budget.peak,
            "held_bytes_per_slot": self.held_bytes, "gguf_bytes_per_expert": self.gguf_bytes,
            "lookups": int(c.lookups.sum()), "hits": int(c.hits.sum()), "misses": int(c.misses.sum()),
            "hit_rate": c.hit_rate(), "copies": c.copies, "steps": c.steps, "ticks": c.ticks,
            "per_layer": [{"layer": s.layer, "lookups": s.lookups, "hits": s.hits, "misses": s.misses,
                           "resident": s.resident} for s in self.layer_stats()],
        }

    def close(self) -> None:
        if self.trace_writer is not None:
            self.trace_writer.close()
