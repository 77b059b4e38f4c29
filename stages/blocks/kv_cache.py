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

A pool keeps its rows in llama.cpp's cache types (`KVTypes`, planner/kv.py), K and V apart:
float32, float16, or q8_0 / q4_0 (a row of 32-value blocks, each a float16 scale and its codes,
about 1.06 and 0.56 bytes a value). A quantised row is stored as ggml lays it out, so the trunk
graph writes it with ggml_set_rows and attends over it with ggml_flash_attn_ext as it lies; the
torch path writes the same bytes and dequantises what it reads (stages/blocks/kv_quant.py).

`KVCache` is the fixed-slot form the one-shot callers use (`StageModel.step`, `logits_all`,
profiling): slot s owns the consecutive blocks of s, so it is the contiguous-cache path.
"""
from __future__ import annotations

import torch

from moeray.errors import MoerayError
from moeray.planner.kv import KVTypes, default_kv_types, resolve_kv_types, row_bytes
from moeray.stages.arch import arch_of
from moeray.stages.blocks import kv_quant
from moeray.stages.blocks.kv_rotation import rotate, rotation

BLOCK_SIZE = 16  # tokens per block, as vLLM's default: small enough to waste < 16 tokens a sequence


def row_runs(copies: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Block copies (src, dst, n rows) as row copies (src row, dst row, n rows), each run of whole
    blocks that follow one another in both places joined into one: a moved prefix of a few hundred
    blocks is then one copy per layer, not one per block."""
    out: list[list[int]] = []
    for src, dst, n in copies:
        a, b = src * BLOCK_SIZE, dst * BLOCK_SIZE
        if out and out[-1][2] % BLOCK_SIZE == 0 and out[-1][0] + out[-1][2] == a and out[-1][1] + out[-1][2] == b:
            out[-1][2] += n
        else:
            out.append([a, b, n])
    return [tuple(r) for r in out]


class KVCacheFullError(MoerayError):
    """A sequence would grow past the KV cache's max_len."""


def kv_dtype(device: str | torch.device) -> torch.dtype:
    """The torch dtype of a float pool on `device` (the default types' K rows)."""
    return torch.float16 if kv_types_for(device).k == "f16" else torch.float32


def kv_types_for(device: str | torch.device, asked: KVTypes | None = None) -> KVTypes:
    """The cache types a pool on `device` holds: `asked`, else the default (planner/kv.py)."""
    return asked if asked is not None else default_kv_types([torch.device(device).type])


def as_kv_types(types: KVTypes | int | None) -> KVTypes:
    """KVTypes from the older itemsize argument (4: float32 rows, 2: float16), or as given."""
    if types is None or isinstance(types, KVTypes):
        return types or KVTypes.same("f32")
    return KVTypes.same({4: "f32", 2: "f16"}[types])


def kv_token_bytes(config, layers: int | range, types: KVTypes | int = 4) -> int:
    """Bytes one token's KV takes over `layers` (a range of layer numbers, or a count from layer 0),
    at its architecture's layout (k and v of each KV head for GQA; MLA's latent) in `types`."""
    arch, types = arch_of(config), as_kv_types(types)
    layers = range(layers) if isinstance(layers, int) else layers
    return sum(types.token_bytes(*arch.kv_layout(config, l)) for l in layers if arch.kv_values(config, l))


def kv_block_bytes(config, layers: int | range, types: KVTypes | int = 4) -> int:
    """Bytes one block takes over `layers`: what the driver charges per block."""
    return BLOCK_SIZE * kv_token_bytes(config, layers, types)


def blocks_for(n_tokens: int) -> int:
    return -(-n_tokens // BLOCK_SIZE)


def kv_bytes_by_layer(config, n_blocks: int, types: KVTypes | int = 4) -> list[int]:
    """Each layer's KV pool with `n_blocks` blocks, at its architecture's layout in `types`."""
    return [n_blocks * kv_block_bytes(config, range(l, l + 1), types) for l in range(config.n_layers)]


def kv_layer_bytes(config, n_blocks: int, types: KVTypes | int = 4, layer: int | None = None) -> int:
    """KV pool of one layer with `n_blocks` blocks, as a stage allocates it (layer None: the
    largest layer's, the figure a message quotes)."""
    if layer is None:
        return max(kv_bytes_by_layer(config, n_blocks, types), default=0)
    return n_blocks * kv_block_bytes(config, range(layer, layer + 1), types)


def check_kv_types(config, types: KVTypes, layers: range | None = None, what: str = "") -> None:
    """One line naming the type and the fix where this model's attention cannot keep its rows in
    `types` (a quantised row of a width that is not a multiple of 32; an MLA latent with K and V
    types apart). `what`: how the user asked ("--cache-type-k q8_0 --cache-type-v q8_0")."""
    arch = arch_of(config)
    layers = range(config.n_layers) if layers is None else layers
    for l in layers:
        if arch.kv_values(config, l):
            why = types.problem(*arch.kv_layout(config, l))
            if why:
                asked = what or f"cache types K {types.k}, V {types.v}"
                raise MoerayError(f"{asked}: {why} (--cache-type-k / --cache-type-v)")


def stage_kv_types(config, layers: range, device, asked: KVTypes | tuple[str, str] | None = None) -> KVTypes:
    """The cache types a stage of `layers` holds on `device`: `asked` (types, or (k, v) names where
    "auto" is the default's), else this process's options (StageOptions.cache_type_k / _v);
    checked against the layers' attention (check_kv_types)."""
    from moeray.stages.kernels import settings

    if not isinstance(asked, KVTypes):
        k, v = asked if asked is not None else (settings.current().cache_type_k, settings.current().cache_type_v)
        arch = arch_of(config)
        kv = [l for l in layers if arch.kv_values(config, l)]
        latent = bool(kv) and arch.kv_layout(config, kv[0])[2] == 0
        what = f"--cache-type-k {k} --cache-type-v {v}"
        try:
            asked = resolve_kv_types(k, v, kv_types_for(device), latent)
        except Exception as exc:
            raise MoerayError(f"{what}: {exc}") from None
        check_kv_types(config, asked, layers, what)
        return asked
    check_kv_types(config, asked, layers)
    return asked


def pool_tensor(cache_type: str, heads: int, rows: int, width: int, device, empty: bool = False) -> torch.Tensor:
    """One layer's rows in `cache_type`: float32 / float16 [heads, rows, width], or a quantised
    type's bytes, uint8 [heads, rows, row bytes] in ggml's block layout (what ggml_set_rows writes
    and ggml_flash_attn_ext reads)."""
    make = torch.empty if empty else torch.zeros
    if cache_type in ("f32", "f16"):
        return make((heads, rows, width), dtype=kv_quant.FLOAT[cache_type], device=device)
    return make((heads, rows, row_bytes(cache_type, width)), dtype=torch.uint8, device=device)


class KVPool:
    """k/v of every layer of the stage, [n_kv_heads, n_blocks * BLOCK_SIZE, head_dim] each, its
    rows in the pool's cache types (`types`: float32, float16, or q8_0 / q4_0 blocks as bytes,
    `pool_tensor`): the same rows either way, one per token per head.

    The latent layout (MLA, stages/blocks/mla.py; v_dim=0): one [1, rows, head_dim] tensor per layer
    holding each token's compressed latent and RoPE key, and no v (the latent is the value).
    Either way the rows are addressed by the same block tables.

    Layers are indexed by their global layer number (first .. first + n_layers - 1), so a stage's
    pool answers to the same numbers as the model.

    `host`: blocks the engine keeps in this node's host memory (stages/blocks/host_kv.py HostBlocks),
    saved from the pool before their block is given to another prefix and loaded back on a hit.
    """

    def __init__(self, first_layer: int, n_layers: int, n_blocks: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 kv_layers: list[int] | None = None, state=None, v_dim: int | None = None,
                 types: KVTypes | None = None, host_blocks: int = 0):
        if n_blocks < 1:
            raise MoerayError(f"a KV pool needs at least one block, got {n_blocks}")
        if types is None:  # the older callers name a float dtype
            types = KVTypes.same("f16" if dtype == torch.float16 else "f32")
        self.first_layer, self.n_layers, self.n_blocks = first_layer, n_layers, n_blocks
        self.block_size, self.types = BLOCK_SIZE, types
        # the float rows' dtype (None for a quantised pool: bytes, read through kv_quant)
        self.dtype = kv_quant.FLOAT.get(types.k) if types.k == types.v else None
        # The layers that keep KV (a hybrid model's DeltaNet layers keep a state instead: `state`,
        # stages/deltanet.DeltaState, slots addressed by the step's state slots).
        self.kv_layers = list(range(first_layer, first_layer + n_layers)) if kv_layers is None else list(kv_layers)
        self._index = {layer: i for i, layer in enumerate(self.kv_layers)}
        self.state = state
        rows = n_blocks * BLOCK_SIZE
        v_dim = head_dim if v_dim is None else v_dim
        self.widths = (head_dim, v_dim)
        # the Hadamard block each kind of row is turned by before it is quantised, 0: none
        # (stages/blocks/kv_rotation.py: llama.cpp's rule, so both engines keep the same rows)
        self.rot = {"k": rotation(types.k, head_dim, "k"), "v": rotation(types.v, v_dim, "v")}
        self.k = [pool_tensor(types.k, n_kv_heads, rows, head_dim, device) for _ in self.kv_layers]
        self.v = [pool_tensor(types.v, n_kv_heads, rows, v_dim, device) if v_dim else None for _ in self.kv_layers]
        self.host = None
        if host_blocks and self.kv_layers:
            from moeray.stages.blocks.host_kv import HostBlocks

            self.host = HostBlocks(self, host_blocks)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        i = self._index[layer]
        return self.k[i], self.v[i]

    def copy_rows(self, copies: list[tuple[int, int, int]]) -> None:
        """For each (src, dst, n): the first n rows of block src, every layer, into block dst."""
        for src, dst, n in copies:
            if not (0 <= src < self.n_blocks and 0 <= dst < self.n_blocks and 0 < n <= BLOCK_SIZE):
                raise MoerayError(f"cannot copy {n} rows from KV block {src} to {dst} in a pool of {self.n_blocks}")
        for a, b, n in row_runs(copies):
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
        """Bytes the pool holds on its device (KV rows and recurrent states; not the host tier)."""
        kv = sum(t.numel() * t.element_size() for t in self.k + self.v if t is not None)
        return kv + (self.state.nbytes() if self.state is not None else 0)

    def block_bytes(self) -> int:
        """Bytes one block's rows take over every layer of the pool."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v if t is not None) // self.n_blocks

    # --- the torch path's reads and writes (the trunk graph reads and writes the rows itself)

    def write(self, cache: torch.Tensor, kind: str, rows: torch.Tensor | int, values: torch.Tensor) -> None:
        """The step's values [N, heads, width] into `cache` (a layer's k or v: `kind` "k" or "v";
        MLA's latent is "k") at pool rows `rows` (an int: one token), in the pool's type, turned
        by its rotation first where it has one."""
        stored = kv_quant.quantize(rotate(values, self.rot[kind]), getattr(self.types, kind))
        if isinstance(rows, int):
            cache[:, rows] = stored[0]
        else:
            cache.index_copy_(1, rows, stored.transpose(0, 1))


def kv_stats(kv: KVPool) -> dict:
    """A stage's pool as /v1/stages shows it: blocks, bytes, its cache types and bytes per token,
    and its host tier (slots, bytes, blocks saved and loaded back)."""
    per_token = kv.block_bytes() // kv.block_size if kv.k else 0
    out = {"blocks": kv.n_blocks, "block_tokens": kv.block_size, "bytes": kv.nbytes(),
           "cache_type_k": kv.types.k, "cache_type_v": kv.types.v, "bytes_per_token": per_token}
    host = kv.host
    if host is not None:
        s = host.stats
        out["host"] = {"blocks": host.n_slots, "bytes": host.nbytes(), "saved_blocks": s.saved,
                       "loaded_blocks": s.loaded, "saved_bytes": s.saved_bytes, "loaded_bytes": s.loaded_bytes}
    return out


class KVCache(KVPool):
    """`max_seqs` fixed slots of `max_len` tokens over one pool: slot s owns blocks
    [s * per_slot, (s + 1) * per_slot). `lengths[slot]` tokens held. The one-shot path
    (StageModel.step), and the contiguous reference the block-table path is tested against."""

    def __init__(self, first_layer: int, n_layers: int, max_seqs: int, n_kv_heads: int, max_len: int,
                 head_dim: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 kv_layers: list[int] | None = None, state=None, v_dim: int | None = None,
                 types: KVTypes | None = None):
        self.per_slot = blocks_for(max_len)
        super().__init__(first_layer, n_layers, max_seqs * self.per_slot, n_kv_heads, head_dim, dtype, device,
                         kv_layers, state, v_dim, types)
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
