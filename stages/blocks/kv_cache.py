"""The KV cache of one stage: a pool of fixed-size blocks per layer, addressed by block tables.

A sequence's tokens live in blocks of BLOCK_SIZE tokens; its block table lists them in order,
so token p of the sequence sits at row `table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE`
of the pool. Memory is the pool, allocated once (`n_blocks`, the plan's budget), never
max_seqs x max_len. Who owns which block is decided by the engine (cluster/kv_blocks.py): a
stage only reads and writes the rows a step's tables name, so every stage of a pipeline holds
the same block numbers for the same sequence.

Each layer's pool is [n_kv_heads, n_blocks * BLOCK_SIZE, head_dim] (head-major): a sequence
whose blocks are consecutive reads its keys as a view, exactly as a per-sequence slab did; any
other table is gathered once per layer with one index_select.

`KVCache` is the fixed-slot form the one-shot callers use (`StageModel.step`, `logits_all`,
profiling): slot s owns the consecutive blocks of s, so it is the contiguous-cache path.
"""
from __future__ import annotations

import torch

from moeray.errors import MoerayError
from moeray.stages.arch import arch_of

BLOCK_SIZE = 16  # tokens per block, as vLLM's default: small enough to waste < 16 tokens a sequence


class KVCacheFullError(MoerayError):
    """A sequence would grow past the KV cache's max_len."""


def kv_dtype(device: str | torch.device) -> torch.dtype:
    """The KV pool's dtype: 16-bit on CUDA (half the bytes, what its attention kernels read),
    float32 on CPU (CPU SDPA has no fast 16-bit path: bf16 measured slower, and it would cost
    the 1e-5 parity with the float32 reference)."""
    return torch.float16 if torch.device(device).type == "cuda" else torch.float32


def kv_token_bytes(config, layers: int | range, itemsize: int = 4) -> int:
    """Bytes one token's KV takes over `layers` (a range of layer numbers, or a count from layer 0),
    at the values per token per layer its architecture says (k and v of each KV head for GQA)."""
    arch = arch_of(config)
    layers = range(layers) if isinstance(layers, int) else layers
    return sum(arch.kv_values(config, l) for l in layers) * itemsize


def kv_block_bytes(config, layers: int | range, itemsize: int = 4) -> int:
    """Bytes one block takes over `layers`: what the driver charges per block."""
    return BLOCK_SIZE * kv_token_bytes(config, layers, itemsize)


def blocks_for(n_tokens: int) -> int:
    return -(-n_tokens // BLOCK_SIZE)


def kv_bytes_by_layer(config, n_blocks: int, itemsize: int = 4) -> list[int]:
    """Each layer's KV pool with `n_blocks` blocks, at its architecture's values per token."""
    return [n_blocks * kv_block_bytes(config, range(l, l + 1), itemsize) for l in range(config.n_layers)]


def kv_layer_bytes(config, n_blocks: int, itemsize: int = 4, layer: int | None = None) -> int:
    """KV pool of one layer with `n_blocks` blocks, as a stage allocates it (layer None: the
    largest layer's, the figure a message quotes)."""
    if layer is None:
        return max(kv_bytes_by_layer(config, n_blocks, itemsize), default=0)
    return n_blocks * kv_block_bytes(config, range(layer, layer + 1), itemsize)


class KVPool:
    """k/v of every layer of the stage, [n_kv_heads, n_blocks * BLOCK_SIZE, head_dim] each.

    The latent layout (MLA, stages/blocks/mla.py; v_dim=0): one [1, rows, head_dim] tensor per layer
    holding each token's compressed latent and RoPE key, and no v (the latent is the value).
    Either way the rows are addressed by the same block tables.

    Layers are indexed by their global layer number (first .. first + n_layers - 1), so a stage's
    pool answers to the same numbers as the model.
    """

    def __init__(self, first_layer: int, n_layers: int, n_blocks: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 kv_layers: list[int] | None = None, state=None, v_dim: int | None = None):
        if n_blocks < 1:
            raise MoerayError(f"a KV pool needs at least one block, got {n_blocks}")
        self.first_layer, self.n_layers, self.n_blocks = first_layer, n_layers, n_blocks
        self.block_size, self.dtype = BLOCK_SIZE, dtype
        # The layers that keep KV (a hybrid model's DeltaNet layers keep a state instead: `state`,
        # stages/deltanet.DeltaState, slots addressed by the step's state slots).
        self.kv_layers = list(range(first_layer, first_layer + n_layers)) if kv_layers is None else list(kv_layers)
        self._index = {layer: i for i, layer in enumerate(self.kv_layers)}
        self.state = state
        rows = n_blocks * BLOCK_SIZE
        v_dim = head_dim if v_dim is None else v_dim
        self.k = [torch.zeros((n_kv_heads, rows, head_dim), dtype=dtype, device=device) for _ in self.kv_layers]
        self.v = [torch.zeros((n_kv_heads, rows, v_dim), dtype=dtype, device=device) if v_dim else None
                  for _ in self.kv_layers]

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        i = self._index[layer]
        return self.k[i], self.v[i]

    def copy_rows(self, copies: list[tuple[int, int, int]]) -> None:
        """For each (src, dst, n): the first n rows of block src, every layer, into block dst."""
        for src, dst, n in copies:
            if not (0 <= src < self.n_blocks and 0 <= dst < self.n_blocks and 0 < n <= BLOCK_SIZE):
                raise MoerayError(f"cannot copy {n} rows from KV block {src} to {dst} in a pool of {self.n_blocks}")
            a, b = src * BLOCK_SIZE, dst * BLOCK_SIZE
            for t in self.k + self.v:
                if t is not None:
                    t[:, b:b + n] = t[:, a:a + n]

    def check_tables(self, tables: list[list[int]], ends: list[int]) -> None:
        for table, end in zip(tables, ends):
            if len(table) * BLOCK_SIZE < end:
                raise MoerayError(f"a block table of {len(table)} blocks cannot hold {end} tokens")
            if table and not 0 <= min(table) <= max(table) < self.n_blocks:
                raise MoerayError(f"block table {table[:8]}... names a block outside the pool of {self.n_blocks}")

    def nbytes(self) -> int:
        kv = sum(t.numel() * t.element_size() for t in self.k + self.v if t is not None)
        return kv + (self.state.nbytes() if self.state is not None else 0)


class KVCache(KVPool):
    """`max_seqs` fixed slots of `max_len` tokens over one pool: slot s owns blocks
    [s * per_slot, (s + 1) * per_slot). `lengths[slot]` tokens held. The one-shot path
    (StageModel.step), and the contiguous reference the block-table path is tested against."""

    def __init__(self, first_layer: int, n_layers: int, max_seqs: int, n_kv_heads: int, max_len: int,
                 head_dim: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 kv_layers: list[int] | None = None, state=None, v_dim: int | None = None):
        self.per_slot = blocks_for(max_len)
        super().__init__(first_layer, n_layers, max_seqs * self.per_slot, n_kv_heads, head_dim, dtype, device,
                         kv_layers, state, v_dim)
        self.max_seqs, self.max_len = max_seqs, max_len
        self.lengths = [0] * max_seqs

    def table(self, slot: int) -> list[int]:
        return list(range(slot * self.per_slot, (slot + 1) * self.per_slot))

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
