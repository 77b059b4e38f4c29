"""A stage's expert slots as the rows of one host buffer, so a hit is an index, not an object.

Slot s (of any layer, in either layout) is row s of a [n_slots, row] byte buffer, row = the
largest expert the stage holds; an expert's gate, up and down blocks lie back to back in it
(the GGUF's bytes, or as many in ggml's repacked layout, repacked as they are filled: each kind
in the layout of the host stack, stages/blocks/moe.py HostExperts.stack_in). For each layer the host builds a stack over the buffer with that
layer's block types and the row as the expert stride, and ggml's mul_mat_id reads the hits of a
step from it in one call, indexed by slot. The buffer is allocated once; the OS commits its
pages as slots are filled, so memory follows the filled slots, not the budget.

Only on the host's ggml route with the slots on the host (a CUDA stage keeps one object per slot,
computed by torch on the card).
"""
from __future__ import annotations

import torch

KINDS = ("gate", "up", "down")


class SlotStore:
    @classmethod
    def for_host(cls, host, first: int, end: int, n_slots: int, held_bytes: list[int],
                 device: torch.device) -> "SlotStore | None":
        """A store when every MoE layer of [first, end) runs on ggml from the host, else None."""
        stack = getattr(host, "stack", None)
        if device.type != "cpu" or stack is None:
            return None
        prepare = getattr(host, "prepare", None)
        if prepare is not None:
            # a repacked host copy is made now, its memory checked first beside the slots' own
            prepare(first, end, reserve=n_slots * max(held_bytes))
        layers = [l for l in range(first, end) if host.gguf.expert_bytes(l) > 0]
        if not layers or any(stack(l) is None for l in layers):
            return None
        return cls(host, layers, n_slots, max(held_bytes))

    def __init__(self, host, layers: list[int], n_slots: int, row: int):
        self.host, self.n_slots, self.row = host, n_slots, row
        # Huge pages: a hit streams its expert's rows as a miss streams the host copy's.
        self.buffer = host.weight_buffer(max(1, n_slots) * row).view(max(1, n_slots), row)
        # Biases (gpt-oss) per kind, [n_slots, widest rows] float32, where any layer has them.
        self.biases = []
        for i in range(3):
            rows = [host.stack(l).biases[i].shape[1] for l in layers if host.stack(l).biases[i] is not None]
            self.biases.append(torch.zeros(max(1, n_slots), max(rows)) if rows else None)
        self._stacks: dict = {}
        self.held: dict[int, int] = {}  # slot -> bytes copied into it


    def load(self, layer: int, expert: int, slot: int) -> int:
        """Copy the expert's blocks (and biases) from the host copy into row `slot`; the bytes copied."""
        off = 0
        w = self.host.weights(layer, expert)  # views of the mapping: the plain bytes
        for part, p in zip((w.gate, w.up, w.down), self.stack(layer).parts):
            n = part.nbytes
            self.host.write_part(part, p, self.buffer[slot, off:off + n])
            off += n
        for i, b in enumerate(self.host.stack(layer).biases):
            if b is not None:
                self.biases[i][slot, :b.shape[1]].copy_(b[expert])
                off += b[expert].nbytes
        self.held[slot] = off
        return off

    def unload(self, slot: int) -> None:
        del self.held[slot]

    def stack(self, layer: int):
        """The layer's view of every slot, for one mul_mat_id over the step's hits."""
        s = self._stacks.get(layer)
        if s is None:
            own = self.host.stack(layer).biases
            biases = tuple(None if b is None else self.biases[i][:, :b.shape[1]] for i, b in enumerate(own))
            s = self._stacks[layer] = self.host.stack_in(layer, self.buffer.data_ptr(), self.row, self.n_slots,
                                                         self.buffer, biases)
        return s

    def window(self, layer: int, lo: int, n: int):
        """The layer's view of slots [lo, lo + n) only: a step's mul_mat_id walks every row of its
        stack (a counter per row, per call), so the rows a layer's residents use, not the stage's
        thousands (a per-layer quota of 77 on the default model served: 2,310 rows, 22 against
        16 ms a token)."""
        key = (layer, lo, n)
        s = self._stacks.get(key)
        if s is None:
            full = self.stack(layer)
            biases = tuple(None if b is None else b[lo:lo + n] for b in full.biases)
            s = self._stacks[key] = self.host.stack_in(layer, self.buffer.data_ptr() + lo * self.row, self.row, n,
                                                       self.buffer, biases)
        return s

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()
