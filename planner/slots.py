"""Per-layer expert slots: spend an N-slot budget on each layer's real blob size.

`--expert-cache N` is a budget of N slots of the largest blob. Every layer gets the same quota
q, so a layer's slots are the contiguous range `layer*q + n` and each holds exactly that
layer's blob; q = floor(N * max_blob / sum(blob)). If one copy of every layer does not fit
(q < 1), the cache keeps N uniform slots of the largest blob.
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
    if n_slots < 0 or not blob_bytes or min(blob_bytes) <= 0:
        raise ValueError("per_layer_slots needs n_slots >= 0 and a positive blob size per layer")
    biggest, total = max(blob_bytes), sum(blob_bytes)
    before = n_slots * biggest
    q = before // total
    if q < 1:
        return SlotLayout(False, 0, n_slots, before, before,
                          f"per-layer slots need one copy of every layer ({total / GIB:.2f} GiB): "
                          f"keeping {n_slots} uniform slots ({before / GIB:.2f} GiB)")
    after = q * total
    return SlotLayout(True, q, q * len(blob_bytes), before, after,
                      f"per-layer slots use each layer's blob: {n_slots} uniform slots ({before / GIB:.2f} GiB)"
                      f" -> {q * len(blob_bytes)} slots, {q} per layer ({after / GIB:.2f} GiB)")
