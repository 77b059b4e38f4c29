"""GGUFs of real MoE models' exact shapes with random valid quantised blocks, for benchmarks.

No real model of that size can be downloaded here, but speed depends on the shape (layers,
experts, widths, block types), not on the values. `write_shape("qwen3.6-35b-a3b")` writes, once,
into the cache dir a file of that model's published shape (config.json on its hub page) in the
block types its common downloads use: routed experts in `expert_type`, every other matrix in
`trunk_type`, the output head (and the embedding) in `head_type`; norms, routers, biases and the
DeltaNet's small tensors float32 (what llama.cpp's quantiser leaves unquantised). A matrix whose
rows are not a multiple of its type's block takes llama.cpp's quantiser's fallback (Q4_K -> Q5_0,
Q6_K -> Q8_0, the 2- and 3-bit types -> IQ4_NL). The default model's tokeniser is padded to the
model's vocabulary, so llama.cpp and moeray both load and run the file.

The blocks are random bytes with their scales set to small finite halves, so activations stay
finite; the routing is then near-uniform (hit-rate work uses the default model's real, skewed
routing instead). A model too big for this 24 GiB machine is cut to its first `layers` layers,
keeping its pattern (dense leading layers, DeltaNet:attention 3:1); `full_layers` records the
published count.

    python bench/shapes.py qwen3.6-35b-a3b          # prints the path (writes it the first time)
    python bench/shapes.py --list                    # every shape, its layers and its size
    python bench/shapes.py deepseek-v3 --layers 8    # another cut of the same model
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shutil
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T  # noqa: E402


@dataclass(frozen=True)
class Shape:
    arch: str  # qwen3moe | qwen2moe | glm4moe | gpt-oss | deepseek2 | qwen3next | qwen35moe
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    used: int
    expert_ff: int
    vocab: int
    shared_ff: int = 0  # the shared expert (qwen2moe, qwen3next: gated; glm4moe, deepseek2: ungated, k x expert_ff)
    dense_lead: int = 0  # glm4moe, deepseek2: the first layers have a dense FFN of dense_ff
    dense_ff: int = 0
    groups: tuple[int, int] = (1, 1)  # glm4moe, deepseek2: expert groups, groups chosen from
    weights_scale: float = 1.0  # glm4moe, deepseek2: routed_scaling_factor
    window: int = 128  # gpt-oss: the sliding window of its even layers (YaRN x32 over 4096, sinks, MXFP4 experts)
    rope_theta: float = 1e6
    rms_eps: float = 1e-6
    context: int = 32768
    norm_topk: bool = True
    # deepseek2 (MLA): head_dim = nope + rope_dim per query head; the latent of kv_lora; q through
    # a LoRA of q_lora (0: one attn_q); v_dim values per head. Sigmoid + bias routing as glm4moe
    # (gating "softmax": DeepSeek-V2's, no score bias).
    kv_lora: int = 0
    q_lora: int = 0
    rope_dim: int = 0  # rotated values per head (0: the family's default: all, or half for glm4moe)
    v_dim: int = 0
    # Block types (names of GGMLQuantizationType): routed experts, other matrices, head + embedding.
    expert_type: str = ""  # "": the family's own (gpt-oss: MXFP4, as published), else Q4_K
    trunk_type: str = "Q4_K"
    head_type: str = ""  # "": trunk_type
    gating: str = "sigmoid"  # glm4moe, deepseek2: sigmoid (+ exp_probs_b) or softmax
    yarn: tuple[float, int, float] = (40.0, 4096, 1.0)  # deepseek2: factor, original context, mscale_all_dim
    # qwen3next / qwen35moe: Gated DeltaNet layers (key heads, value heads, head width, conv kernel)
    # with every `full_interval`-th layer full attention (its q projection doubled by the output gate)
    linear: tuple[int, int, int, int] = (0, 0, 0, 0)
    full_interval: int = 4
    full_layers: int = 0  # the published model's layer count, when `layers` is a cut (0: whole)

    @property
    def experts_type(self) -> str:
        return self.expert_type or ("MXFP4" if self.arch == "gpt-oss" else "Q4_K")


# Published configs (config.json of each model on its hub page), in the types of their common
# downloads. The whole models that do not fit this machine are cut to their first layers.
SHAPES = {
    "qwen3-30b-a3b": Shape("qwen3moe", layers=48, hidden=2048, heads=32, kv_heads=4, head_dim=128,
                           experts=128, used=8, expert_ff=768, vocab=151936, context=40960),
    "qwen1.5-moe-a2.7b": Shape("qwen2moe", layers=24, hidden=2048, heads=16, kv_heads=16, head_dim=128,
                               experts=60, used=4, expert_ff=1408, shared_ff=5632, vocab=151936,
                               context=8192, norm_topk=False),
    # Qwen/Qwen3.6-35B-A3B (qwen35moe): IQ3_S experts as the Strata rigs ran it, Q8_0 trunk, Q6_K head: 16.1 GB
    "qwen3.6-35b-a3b": Shape("qwen35moe", layers=40, hidden=2048, heads=16, kv_heads=2, head_dim=256,
                             experts=256, used=8, expert_ff=512, shared_ff=512, vocab=248320, rope_dim=64,
                             rope_theta=1e7, context=262144, linear=(16, 32, 128, 4),
                             expert_type="IQ3_S", trunk_type="Q8_0", head_type="Q6_K"),
    # Qwen/Qwen3-Next-80B-A3B-Instruct (qwen3next): its first 12 of 48 layers (9 DeltaNet, 3 attention)
    "qwen3-next-80b-a3b": Shape("qwen3next", layers=12, full_layers=48, hidden=2048, heads=16, kv_heads=2,
                                head_dim=256, experts=512, used=10, expert_ff=512, shared_ff=512, vocab=151936,
                                rope_dim=64, rope_theta=1e7, context=262144, linear=(16, 32, 128, 4),
                                expert_type="IQ3_S", trunk_type="Q8_0", head_type="Q6_K"),
    # openai/gpt-oss-20b as ggml-org/gpt-oss-20b-GGUF ships it: MXFP4 experts, Q8_0 elsewhere (12.1 GB)
    "gpt-oss-20b": Shape("gpt-oss", layers=24, hidden=2880, heads=64, kv_heads=8, head_dim=64, experts=32,
                         used=4, expert_ff=2880, vocab=201088, rope_theta=150000.0, context=131072,
                         expert_type="MXFP4", trunk_type="Q8_0", head_type="Q8_0"),
    # deepseek-ai/DeepSeek-V2-Lite: MLA without a q LoRA, softmax routing over 64 experts (no groups
    # in the GGUF, as llama.cpp's converter writes V2), 2 shared, a dense first layer; Q4_K_M-like
    "deepseek-v2-lite": Shape("deepseek2", layers=27, hidden=2048, heads=16, kv_heads=1, head_dim=192,
                              experts=64, used=6, expert_ff=1408, shared_ff=2 * 1408, dense_lead=1, dense_ff=10944,
                              vocab=102400, rope_theta=10000.0, context=163840, norm_topk=False, gating="softmax",
                              kv_lora=512, rope_dim=64, v_dim=128, yarn=(40.0, 4096, 0.707),
                              expert_type="Q4_K", trunk_type="Q8_0", head_type="Q6_K"),
    # deepseek-ai/DeepSeek-V3: its first 4 of 61 layers (3 dense, 1 MoE), IQ2_XXS experts (unsloth's
    # UD-IQ2_XXS download), Q8_0 trunk, Q6_K head
    "deepseek-v3": Shape("deepseek2", layers=4, full_layers=61, hidden=7168, heads=128, kv_heads=1, head_dim=192,
                         experts=256, used=8, expert_ff=2048, shared_ff=2048, dense_lead=3, dense_ff=18432,
                         vocab=129280, groups=(8, 4), weights_scale=2.5, rope_theta=10000.0, context=163840,
                         kv_lora=512, q_lora=1536, rope_dim=64, v_dim=128, yarn=(40.0, 4096, 1.0),
                         expert_type="IQ2_XXS", trunk_type="Q8_0", head_type="Q6_K"),
    # moonshotai/Kimi-K2-Instruct: DeepSeek-V3's layer at 64 heads and 384 experts, one dense layer;
    # its first 4 of 61 layers (1 dense, 3 MoE)
    "kimi-k2": Shape("deepseek2", layers=4, full_layers=61, hidden=7168, heads=64, kv_heads=1, head_dim=192,
                     experts=384, used=8, expert_ff=2048, shared_ff=2048, dense_lead=1, dense_ff=18432,
                     vocab=163840, weights_scale=2.827, rope_theta=50000.0, context=131072,
                     kv_lora=512, q_lora=1536, rope_dim=64, v_dim=128, yarn=(32.0, 4096, 1.0),
                     expert_type="IQ2_XXS", trunk_type="Q8_0", head_type="Q6_K"),
    # zai-org/GLM-4.5-Air: its first 10 of 46 layers (1 dense, 9 MoE), Q4_K experts (Q4_K_M)
    "glm-4.5-air": Shape("glm4moe", layers=10, full_layers=46, hidden=4096, heads=96, kv_heads=8, head_dim=128,
                         experts=128, used=8, expert_ff=1408, shared_ff=1408, dense_lead=1, dense_ff=10944,
                         vocab=151552, rope_dim=64, context=131072,
                         expert_type="Q4_K", trunk_type="Q8_0", head_type="Q6_K"),
}

# Each block type's half-precision scale fields (byte offset in a block, value): set to small
# finite values so that a weight's spread is 0.01-0.06 whatever the type (tests check it).
_SCALES = {T.Q4_K: ((0, 2e-4), (2, 2e-4 * 7.5)), T.Q5_0: ((0, 2e-3),), T.Q8_0: ((0, 3e-4),),
           T.Q6_K: ((208, 2e-5),), T.Q2_K: ((80, 1.5e-3), (82, 1.5e-3 * 1.5)), T.Q3_K: ((108, 5e-4),),
           T.IQ3_S: ((0, 2e-4),), T.IQ2_XXS: ((0, 6e-4),), T.IQ4_NL: ((0, 4e-4),)}
_POOL_BLOCKS = 1 << 18  # a pool of random blocks (36 MiB of Q4_K) that every tensor is cut from
# llama.cpp's quantiser (llama_tensor_get_type) when a row is not a whole number of blocks
_FALLBACK = {T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0, T.Q2_K: T.IQ4_NL, T.Q3_K: T.IQ4_NL,
             T.IQ2_XXS: T.IQ4_NL, T.IQ2_XS: T.IQ4_NL, T.IQ2_S: T.IQ4_NL, T.IQ3_XXS: T.IQ4_NL,
             T.IQ3_S: T.IQ4_NL, T.IQ4_XS: T.IQ4_NL}


def matrix_type(cols: int, want: str | T = T.Q4_K) -> T:
    """The block type a matrix of `cols` columns takes when `want` is asked for."""
    qtype = T[want] if isinstance(want, str) else want
    return qtype if cols % GGML_QUANT_SIZES[qtype][0] == 0 else _FALLBACK.get(qtype, T.Q8_0)


class _Blocks:
    """A [*lead, rows, cols] matrix of random valid blocks, as GGUFWriter sees an array (shape in
    bytes, `tofile`): written from a shared pool at a per-tensor offset, never held whole."""

    def __init__(self, pools: "_Pools", qtype: T, rows: int, cols: int, lead: tuple = (), seed: int = 0):
        block, size = GGML_QUANT_SIZES[qtype]
        self.pools, self.qtype = pools, qtype
        self.row_bytes = cols // block * size
        self.shape = (*lead, rows, self.row_bytes)
        self.dtype = np.dtype(np.uint8)
        self.nbytes = int(np.prod(self.shape))
        self.start = (seed * 7919 % (pools.n_blocks)) * size

    def tofile(self, f) -> None:
        pool = self.pools[self.qtype]
        left, pos = self.nbytes, self.start
        while left:
            n = min(left, len(pool) - pos)
            pool[pos:pos + n].tofile(f)
            left -= n
            pos = 0
        # the pool's length is whole blocks and every cut starts on a block: each row stays valid


class _Floats:
    """A float32 tensor of `shape` drawn when written (`make(rng, n)` gives its n values), as
    GGUFWriter sees an array: a directory entry costs nothing until the data is written."""

    def __init__(self, shape: tuple, make, seed: int):
        self.shape = (*shape[:-1], 4 * shape[-1])  # bytes, as raw F32
        self.dtype = np.dtype(np.uint8)
        self.nbytes = 4 * int(np.prod(shape))
        self.make, self.seed = make, seed

    def tofile(self, f) -> None:
        n = self.nbytes // 4
        np.asarray(self.make(np.random.default_rng(self.seed), n), dtype=np.float32).reshape(n).tofile(f)


class _Pools:
    """Random valid blocks of each type, made on first use (only the types a file needs)."""

    def __init__(self, seed: int, n_blocks: int):
        self.seed, self.n_blocks, self.made = seed, n_blocks, {}

    def __getitem__(self, qtype: T) -> np.ndarray:
        if qtype not in self.made:
            self.made[qtype] = random_blocks(qtype, self.n_blocks, np.random.default_rng((self.seed, int(qtype))))
        return self.made[qtype]


def random_blocks(qtype: T, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """n_blocks random blocks of `qtype` (flat uint8) with finite scales of a small magnitude."""
    block, size = GGML_QUANT_SIZES[qtype]
    p = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    if qtype == T.MXFP4:  # an E8M0 scale byte, then 16 bytes of FP4 pairs
        p[:, 0] = rng.integers(118, 121, n_blocks)  # 2^-9 .. 2^-7
    elif qtype in _SCALES:
        for off, scale in _SCALES[qtype]:
            halves = (rng.uniform(0.5, 1.5, n_blocks) * scale).astype(np.float16)
            p[:, off:off + 2] = halves.view(np.uint8).reshape(-1, 2)
    else:
        raise SystemExit(f"bench/shapes.py has no random blocks of {qtype.name}: choose one of "
                         f"{', '.join(t.name for t in (*_SCALES, T.MXFP4))}")
    return p.reshape(-1)


@functools.lru_cache(maxsize=1)
def _tokenizer_fields() -> dict:
    """The default model's tokeniser (a gpt2 BPE vocabulary), for the padding below: its values
    (moeray's header reader: gguf's GGUFReader takes seconds over 49k tokens)."""
    from moeray.stages.gguf.default_model import default_model_path
    from moeray.stages.gguf.reader import read_gguf_header

    meta = read_gguf_header(default_model_path(quiet=True)).metadata
    return {n: v for n, v in meta.items() if n.startswith("tokenizer.")}


def _add_tokenizer(w, vocab: int) -> None:
    """The default model's tokeniser, padded to `vocab` tokens with control tokens."""
    from gguf import GGUFValueType as V

    for n, value in _tokenizer_fields().items():
        if n == "tokenizer.ggml.tokens":
            value = value + [f"<|moeray_pad_{i}|>" for i in range(vocab - len(value))]
        elif n == "tokenizer.ggml.token_type":
            value = value + [3] * (vocab - len(value))
        if isinstance(value, list):
            w.add_key_value(n, value, V.ARRAY, V.STRING if isinstance(value[0], str) else
                            V.FLOAT32 if isinstance(value[0], float) else V.INT32)
        else:
            w.add_key_value(n, value, V.BOOL if isinstance(value, bool) else V.UINT32 if isinstance(value, int)
                            else V.STRING)


def shape_of(name: str, layers: int | None = None) -> Shape:
    """SHAPES[name], or its first `layers` layers (up to the published count)."""
    if name not in SHAPES:
        raise SystemExit(f"unknown shape {name!r}: choose one of {', '.join(SHAPES)}")
    s = SHAPES[name]
    if layers is not None and layers != s.layers:
        whole = s.full_layers or s.layers
        if not 0 < layers <= whole:
            raise SystemExit(f"{name} has {whole} layers: --layers must be 1..{whole}")
        s = replace(s, layers=layers, full_layers=0 if layers == whole else whole)
    return s


def shrink(s: Shape) -> Shape:
    """The same family, layer pattern and block types at toy widths (tests write and run it in
    seconds): hidden 256, 4 heads of 64, at most 8 experts, the vocabulary the tokeniser needs.
    A width that is not a multiple of 256 keeps its remainder, so the same fallback types appear;
    at most 4 layers, or the first full-attention layer of a hybrid, or one MoE layer past the
    dense ones."""
    def w(real: int, base: int = 256) -> int:
        return base + real % 256

    layers = min(s.layers, max(4, s.dense_lead + 1, s.full_interval if s.linear[0] else 0))
    ff = w(s.expert_ff)
    tiny = dict(layers=layers, full_layers=0, hidden=w(s.hidden), heads=4, kv_heads=min(s.kv_heads, 2),
                head_dim=64, experts=min(s.experts, 8), used=min(s.used, 2), expert_ff=ff,
                shared_ff=(s.shared_ff // s.expert_ff) * ff if s.arch in ("glm4moe", "deepseek2") else
                (w(s.shared_ff) if s.shared_ff else 0),
                dense_ff=w(s.dense_ff, 512) if s.dense_ff else 0, vocab=49408, context=4096,
                groups=(min(s.groups[0], 2), min(s.groups[1], 1)),
                rope_dim=s.rope_dim and (32 if s.arch in ("deepseek2", "glm4moe") else 16))
    if s.arch == "deepseek2":
        tiny.update(kv_heads=1, head_dim=96, kv_lora=128, q_lora=128 if s.q_lora else 0, v_dim=64)
    if s.linear[0]:
        tiny.update(linear=(2, 4, 32, s.linear[3]))
    if s.arch == "gpt-oss":
        tiny.update(window=8)
    return replace(s, **tiny)


def shape_path(name: str, shape: Shape | None = None) -> Path:
    from moeray.stages.gguf.default_model import cache_dir

    s = shape or SHAPES[name]
    cut = f"-{s.layers}l" if s.full_layers else ""
    return cache_dir() / f"shape-{name}{cut}-{s.experts_type.lower()}-random.gguf"


def is_recurrent(s: Shape, layer: int) -> bool:
    """qwen3next / qwen35moe: a Gated DeltaNet layer (every full_interval-th is attention)."""
    return s.linear[0] > 0 and (layer + 1) % s.full_interval != 0


def bench_model(shape: str | None, model: str | None) -> str:
    """The GGUF a bench runs: a real shape's synthetic file (`--shape`, written once), `--model`, or
    the embedded default model."""
    if shape:
        return str(write_shape(shape))
    if model:
        return model
    from moeray.stages.gguf.default_model import default_model_path

    return str(default_model_path())


def write_shape(name: str, seed: int = 0, shape: Shape | None = None, path: Path | None = None,
                pool_blocks: int = _POOL_BLOCKS, header_only: bool = False) -> Path:
    """The file for SHAPES[name] (or `shape`) in the cache dir (or at `path`), written the first
    time (atomically); a file whose sidecar records the same shape is reused. header_only: the
    metadata and tensor directory alone (what `moeray plan` and the layout tests read), no data."""
    import gguf

    s = shape or shape_of(name)
    path = Path(path) if path is not None else shape_path(name, s)
    record = json.loads(json.dumps({**asdict(s), "seed": seed, "writer": 2, "header_only": header_only}))
    meta = path.with_name(path.name + ".json")
    if path.is_file() and meta.is_file() and json.loads(meta.read_text()).get("shape") == record:
        return path
    if not header_only:
        print(f"moeray: writing a {name}-shaped GGUF with random blocks into {path} ...", file=sys.stderr)
    pools = _Pools(seed, pool_blocks)
    rng = np.random.default_rng(seed)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    w = gguf.GGUFWriter(tmp, arch=s.arch)
    a = s.arch
    glm, oss, mla = a == "glm4moe", a == "gpt-oss", a == "deepseek2"
    hybrid = a in ("qwen3next", "qwen35moe")
    cut = f", its first {s.layers} of {s.full_layers} layers" if s.full_layers else ""
    w.add_name(f"{name} (random blocks{cut}, moeray bench)")
    w.add_uint32(f"{a}.block_count", s.layers)
    w.add_uint32(f"{a}.context_length", s.context)
    w.add_uint32(f"{a}.embedding_length", s.hidden)
    w.add_uint32(f"{a}.feed_forward_length", s.dense_ff or s.expert_ff * s.used)
    w.add_uint32(f"{a}.expert_feed_forward_length", s.expert_ff)
    if oss:  # gpt-oss-20b's rope and window
        w.add_string(f"{a}.rope.scaling.type", "yarn")
        w.add_float32(f"{a}.rope.scaling.factor", 32.0)
        w.add_uint32(f"{a}.rope.scaling.original_context_length", 4096)
        w.add_uint32(f"{a}.attention.sliding_window", s.window)
    if mla:  # YaRN (yarn_log_multiplier = 0.1 mscale_all_dim) and MLA as llama.cpp's converter writes them
        factor, orig, mscale_all_dim = s.yarn
        w.add_string(f"{a}.rope.scaling.type", "yarn")
        w.add_float32(f"{a}.rope.scaling.factor", factor)
        w.add_uint32(f"{a}.rope.scaling.original_context_length", orig)
        w.add_float32(f"{a}.rope.scaling.yarn_log_multiplier", 0.1 * mscale_all_dim)
        w.add_uint32(f"{a}.attention.kv_lora_rank", s.kv_lora)
        # Written even when 0 (one attn_q): llama.cpp knows DeepSeek-V2-Lite's missing key by its 27
        # layers only, so a cut or a toy copy without it would not load there.
        w.add_uint32(f"{a}.attention.q_lora_rank", s.q_lora)
        w.add_uint32(f"{a}.attention.key_length_mla", s.head_dim)
        w.add_uint32(f"{a}.attention.value_length_mla", s.v_dim)
    if glm or mla:  # sigmoid scores + correction bias (or softmax), renormalised, scaled; partial rope
        w.add_uint32(f"{a}.expert_shared_count", s.shared_ff // s.expert_ff)
        w.add_uint32(f"{a}.leading_dense_block_count", s.dense_lead)
        func = gguf.ExpertGatingFuncType.SIGMOID if s.gating == "sigmoid" else gguf.ExpertGatingFuncType.SOFTMAX
        w.add_uint32(f"{a}.expert_gating_func", int(func))
        w.add_bool(f"{a}.expert_weights_norm", s.norm_topk)
        w.add_float32(f"{a}.expert_weights_scale", s.weights_scale)
        if s.groups != (1, 1):
            w.add_uint32(f"{a}.expert_group_count", s.groups[0])
            w.add_uint32(f"{a}.expert_group_used_count", s.groups[1])
        w.add_uint32(f"{a}.rope.dimension_count", s.rope_dim or s.head_dim // 2)
    elif s.shared_ff:
        w.add_uint32(f"{a}.expert_shared_feed_forward_length", s.shared_ff)
    if hybrid:  # llama.cpp's converter's keys (Qwen3NextModel, Qwen3_5MoeTextModel)
        k_heads, v_heads, lin_dim, kernel = s.linear
        w.add_uint32(f"{a}.rope.dimension_count", s.rope_dim)
        w.add_uint32(f"{a}.ssm.conv_kernel", kernel)
        w.add_uint32(f"{a}.ssm.state_size", lin_dim)
        w.add_uint32(f"{a}.ssm.group_count", k_heads)
        w.add_uint32(f"{a}.ssm.time_step_rank", v_heads)
        w.add_uint32(f"{a}.ssm.inner_size", v_heads * lin_dim)
        w.add_uint32(f"{a}.full_attention_interval", s.full_interval)
        if a == "qwen35moe":
            w.add_array(f"{a}.rope.dimension_sections", [11, 11, 10, 0])
    w.add_uint32(f"{a}.attention.head_count", s.heads)
    w.add_uint32(f"{a}.attention.head_count_kv", 1 if mla else s.kv_heads)
    w.add_uint32(f"{a}.attention.key_length", s.kv_lora + s.rope_dim if mla else s.head_dim)  # MLA: the MQA view
    w.add_uint32(f"{a}.attention.value_length", s.kv_lora if mla else s.head_dim)
    w.add_float32(f"{a}.rope.freq_base", s.rope_theta)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", s.rms_eps)
    w.add_uint32(f"{a}.expert_count", s.experts)
    w.add_uint32(f"{a}.expert_used_count", s.used)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    _add_tokenizer(w, s.vocab)

    seed_of = iter(range(1, 1 << 30))

    def add(tname, rows, cols, lead=(), want=None):
        """A matrix of random blocks: `want` (default: the trunk's type), or its fallback."""
        qtype = matrix_type(cols, want or s.trunk_type)
        w.add_tensor(tname, _Blocks(pools, qtype, rows, cols, lead, next(seed_of)), raw_dtype=qtype)

    def vec(tname, *shape, std=0.0, mean=1.0, low=None, high=None):
        """float32: mean + std x normal, or uniform in [low, high)."""
        if low is not None:
            make = lambda r, n: r.uniform(low, high, n)  # noqa: E731
        else:
            make = lambda r, n: mean + std * r.standard_normal(n) if std else np.full(n, mean)  # noqa: E731
        w.add_tensor(tname, _Floats(shape, make, next(seed_of)), raw_dtype=T.F32)

    H, D = s.hidden, s.head_dim
    head = s.head_type or s.trunk_type
    add("token_embd.weight", s.vocab, H, want=head)
    for i in range(s.layers):
        p = f"blk.{i}."
        vec(p + "attn_norm.weight", H)
        if mla:
            C, R = s.kv_lora, s.rope_dim
            if s.q_lora:
                add(p + "attn_q_a.weight", s.q_lora, H)
                vec(p + "attn_q_a_norm.weight", s.q_lora)
                add(p + "attn_q_b.weight", s.heads * D, s.q_lora)
            else:
                add(p + "attn_q.weight", s.heads * D, H)
            add(p + "attn_kv_a_mqa.weight", C + R, H)
            vec(p + "attn_kv_a_norm.weight", C)
            add(p + "attn_k_b.weight", C, D - R, (s.heads,))
            add(p + "attn_v_b.weight", s.v_dim, C, (s.heads,))
            add(p + "attn_output.weight", H, s.heads * s.v_dim)
        elif is_recurrent(s, i):  # Gated DeltaNet: fused qkv, z gate, beta/alpha, conv, decay, gated norm, out
            k_heads, v_heads, lin_dim, kernel = s.linear
            key_dim, value_dim = k_heads * lin_dim, v_heads * lin_dim
            add(p + "attn_qkv.weight", 2 * key_dim + value_dim, H)
            add(p + "attn_gate.weight", value_dim, H)
            if a == "qwen35moe":
                add(p + "ssm_beta.weight", v_heads, H)
                add(p + "ssm_alpha.weight", v_heads, H)
            else:
                add(p + "ssm_ba.weight", 2 * v_heads, H)
            vec(p + "ssm_conv1d.weight", 2 * key_dim + value_dim, kernel, low=-0.5, high=0.5)  # Conv1d's init
            vec(p + "ssm_dt.bias", v_heads)
            vec(p + "ssm_a", v_heads, low=-16.0, high=-1.0)  # -exp(A_log), A_log = log U(1, 16)
            vec(p + "ssm_norm.weight", lin_dim)
            add(p + "ssm_out.weight", H, value_dim)
        else:
            q_rows = 2 * s.heads * D if hybrid else s.heads * D  # the hybrids' q carries the output gate
            add(p + "attn_q.weight", q_rows, H)
            add(p + "attn_k.weight", s.kv_heads * D, H)
            add(p + "attn_v.weight", s.kv_heads * D, H)
            add(p + "attn_output.weight", H, s.heads * D)
            if a in ("qwen3moe", "qwen3next", "qwen35moe"):
                vec(p + "attn_q_norm.weight", D)
                vec(p + "attn_k_norm.weight", D)
            else:
                for t, n in (("q", s.heads * D), ("k", s.kv_heads * D), ("v", s.kv_heads * D)):
                    vec(p + f"attn_{t}.bias", n, std=0.02, mean=0.0)
        if oss:
            vec(p + "attn_output.bias", H, std=0.02, mean=0.0)
            vec(p + "attn_sinks.weight", s.heads, std=1.0, mean=0.0)
        vec(p + ("post_attention_norm.weight" if glm or oss or hybrid else "ffn_norm.weight"), H)
        if i < s.dense_lead:
            add(p + "ffn_gate.weight", s.dense_ff, H)
            add(p + "ffn_up.weight", s.dense_ff, H)
            add(p + "ffn_down.weight", H, s.dense_ff)
            continue
        vec(p + "ffn_gate_inp.weight", s.experts, H, std=0.05, mean=0.0)
        if (glm or mla) and s.gating == "sigmoid":
            vec(p + "exp_probs_b.bias", s.experts, std=0.01, mean=0.0)
        add(p + "ffn_gate_exps.weight", s.expert_ff, H, (s.experts,), s.experts_type)
        add(p + "ffn_up_exps.weight", s.expert_ff, H, (s.experts,), s.experts_type)
        add(p + "ffn_down_exps.weight", H, s.expert_ff, (s.experts,), s.experts_type)
        if oss:
            vec(p + "ffn_gate_inp.bias", s.experts, std=0.05, mean=0.0)
            for kind, n in (("gate", s.expert_ff), ("up", s.expert_ff), ("down", H)):
                vec(p + f"ffn_{kind}_exps.bias", s.experts, n, std=0.02, mean=0.0)
        if s.shared_ff and not (glm or mla):
            vec(p + "ffn_gate_inp_shexp.weight", H, std=0.05, mean=0.0)
        if s.shared_ff:
            add(p + "ffn_gate_shexp.weight", s.shared_ff, H)
            add(p + "ffn_up_shexp.weight", s.shared_ff, H)
            add(p + "ffn_down_shexp.weight", H, s.shared_ff)
    vec("output_norm.weight", H)
    add("output.weight", s.vocab, H, want=head)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        if header_only:
            w.write_ti_data_to_file()
        else:
            w.write_tensors_to_file()
        w.close()
    except OSError as exc:  # a full disk: leave no partial file of many GiB behind
        with contextlib.suppress(OSError):
            w.close()
        tmp.unlink(missing_ok=True)
        free = shutil.disk_usage(path.parent).free
        raise SystemExit(f"{path}: could not write the {name}-shaped file ({exc}); {free / 2**30:.1f} GiB free "
                         f"there: free disk space or point MOERAY_CACHE_DIR at a larger disk") from exc
    os.replace(tmp, path)
    meta.write_text(json.dumps({"shape": record, "bytes": path.stat().st_size}))
    return path


def file_bytes(s: Shape) -> int:
    """Tensor bytes of the file `s` writes (sums the directory of a header-only write)."""
    import tempfile

    from moeray.stages.gguf.reader import read_gguf_header

    with tempfile.TemporaryDirectory() as d:
        h = read_gguf_header(write_shape("size", shape=s, path=Path(d) / "h.gguf", header_only=True))
        return sum(t.n_bytes for t in h.tensors.values())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("name", nargs="?", default="qwen3-30b-a3b", help=f"one of {', '.join(SHAPES)}")
    ap.add_argument("--layers", type=int, help="write the first N layers (default: the shape's own)")
    ap.add_argument("--list", action="store_true", help="list the shapes with their sizes, write nothing")
    args = ap.parse_args()
    if args.list:
        for n, s in SHAPES.items():
            cut = f"first {s.layers} of {s.full_layers}" if s.full_layers else f"{s.layers} (whole)"
            print(f"{n:<20} {s.arch:<10} layers {cut:<16} experts {s.experts} top-{s.used} {s.experts_type:<8} "
                  f"{file_bytes(s) / 1e9:6.1f} GB  {shape_path(n, s)}")
        return 0
    print(write_shape(args.name, shape=shape_of(args.name, args.layers)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
