"""The KV cache of one stage: a fixed slab per layer, one slot per sequence."""
from __future__ import annotations

import torch

from moeray.errors import MoerayError


class KVCacheFullError(MoerayError):
    """A sequence would grow past the KV cache's max_len."""


def kv_cache_bytes(config, n_layers: int, max_seqs: int, max_len: int, itemsize: int = 4) -> int:
    """Bytes the KV cache of `n_layers` layers allocates: k and v of [max_seqs, n_kv_heads,
    max_len, head_dim] each, float32 by default. The driver prices it with this same formula."""
    return 2 * n_layers * max_seqs * config.n_kv_heads * max_len * config.head_dim * itemsize


class KVCache:
    """k/v per layer of the stage: [max_seqs, n_kv_heads, max_len, head_dim]; `lengths[slot]` tokens held.

    Layers are indexed by their global layer number (first .. first + n_layers - 1), so a stage's
    cache answers to the same numbers as the model.
    """

    def __init__(self, first_layer: int, n_layers: int, max_seqs: int, n_kv_heads: int, max_len: int,
                 head_dim: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        self.first_layer, self.n_layers = first_layer, n_layers
        self.max_seqs, self.max_len = max_seqs, max_len
        shape = (max_seqs, n_kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.lengths = [0] * max_seqs

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = layer - self.first_layer
        return self.k[i], self.v[i]

    def reset(self, slot: int) -> None:
        """Free a slot for a new sequence (old entries are masked out by the length, not cleared)."""
        self.lengths[slot] = 0

    def check_room(self, slots: list[int], n_new: list[int]) -> None:
        for s, n in zip(slots, n_new):
            if not 0 <= s < self.max_seqs:
                raise MoerayError(f"KV slot {s} does not exist; the cache has {self.max_seqs} slots")
            if self.lengths[s] + n > self.max_len:
                raise KVCacheFullError(
                    f"sequence in KV slot {s} would reach {self.lengths[s] + n} tokens, past the KV cache's "
                    f"max_len {self.max_len}; shorten the prompt or max tokens, or raise the context length")

    def advance(self, slots: list[int], n_new: list[int]) -> None:
        for s, n in zip(slots, n_new):
            self.lengths[s] += n

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
