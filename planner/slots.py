"""Per-layer expert slots: spend an N-slot budget on each layer's real blob size.

`--expert-cache N` is a budget of N slots of the largest blob. Every layer gets the same quota
q, so a layer's slots are a contiguous range of q and each holds exactly that
layer's blob; q = floor(N * max_blob / sum(blob)). If one copy of every layer does not fit
(q < 1), the cache keeps N uniform slots of the largest blob. Dense layers of an MoE model
(blob 0) get no slots: layer l's slots are j*q + n, j its index among the MoE layers.
"""
from __future__ import annotations

from dataclasses import dataclass

GIB = 1 << 30


@dataclass
class SlotLayout:
    per_layer: bool
    quota: int  # slots per layer; 0 when the slots are uniform
    n_slots: int
    bytes_before: int  # N uniform slots of the largest blob
    bytes_after: int
    message: str


def per_layer_slots(n_slots: int, blob_bytes: list[int]) -> SlotLayout:
    """A layer with blob 0 is dense (no experts): it gets no slots, the quota covers the others."""
    if n_slots < 0 or not blob_bytes or min(blob_bytes) < 0 or max(blob_bytes) <= 0:
        raise ValueError("per_layer_slots needs n_slots >= 0 and blob sizes >= 0 with at least one MoE layer")
    biggest, total = max(blob_bytes), sum(blob_bytes)
    n_moe = sum(1 for b in blob_bytes if b > 0)
    before = n_slots * biggest
    q = before // total
    if q < 1:
        return SlotLayout(False, 0, n_slots, before, before,
                          f"per-layer slots need one copy of every layer ({total / GIB:.2f} GiB): "
                          f"keeping {n_slots} uniform slots ({before / GIB:.2f} GiB)")
    after = q * total
    return SlotLayout(True, q, q * n_moe, before, after,
                      f"per-layer slots use each layer's blob: {n_slots} uniform slots ({before / GIB:.2f} GiB)"
                      f" -> {q * n_moe} slots, {q} per layer ({after / GIB:.2f} GiB)")
