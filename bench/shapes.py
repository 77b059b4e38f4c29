"""GGUFs of real MoE models' exact shapes with random valid quantised blocks, for benchmarks.

No real model of that size can be downloaded here, but speed depends on the shape (layers,
experts, widths, block types), not on the values. `write_shape("qwen3-30b-a3b")` writes, once,
into the cache dir a file of Qwen3-30B-A3B's published shape: every matrix Q4_K (a matrix whose
rows are not a multiple of 256 wide takes Q5_0, llama.cpp's quantiser's fallback), norms and
routers float32, and the default model's tokeniser padded to the model's vocabulary, so that
llama.cpp and moeray both load and run it. The blocks are random bytes with their scales set
to small finite halves, so activations stay finite; the routing is then near-uniform (hit-rate
work uses the default model's real, skewed routing instead).

    python bench/shapes.py qwen3-30b-a3b      # prints the path (writes it the first time: ~16 GiB)
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T  # noqa: E402


@dataclass(frozen=True)
class Shape:
    arch: str  # qwen3moe | qwen2moe | glm4moe | gpt-oss | deepseek2
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    used: int
    expert_ff: int
    vocab: int
    shared_ff: int = 0  # the shared expert (qwen2moe: gated; glm4moe: ungated, a multiple of expert_ff)
    dense_lead: int = 0  # glm4moe: the first layers have a dense FFN of dense_ff
    dense_ff: int = 0
    groups: tuple[int, int] = (1, 1)  # glm4moe: expert groups, groups chosen from
    weights_scale: float = 1.0  # glm4moe: routed_scaling_factor
    window: int = 128  # gpt-oss: the sliding window of its even layers (YaRN x32 over 4096, sinks, MXFP4 experts)
    rope_theta: float = 1e6
    rms_eps: float = 1e-6
    context: int = 32768
    norm_topk: bool = True
    # deepseek2 (MLA): head_dim = nope + rope_dim per query head; the latent of kv_lora; q through
    # a LoRA of q_lora (0: one attn_q); v_dim values per head. Sigmoid + bias routing as glm4moe.
    kv_lora: int = 0
    q_lora: int = 0
    rope_dim: int = 0
    v_dim: int = 0


# Published configs (config.json of each model on its hub page).
SHAPES = {
    "qwen3-30b-a3b": Shape("qwen3moe", layers=48, hidden=2048, heads=32, kv_heads=4, head_dim=128,
                           experts=128, used=8, expert_ff=768, vocab=151936, context=40960),
    "qwen1.5-moe-a2.7b": Shape("qwen2moe", layers=24, hidden=2048, heads=16, kv_heads=16, head_dim=128,
                               experts=60, used=4, expert_ff=1408, shared_ff=5632, vocab=151936,
                               context=8192, norm_topk=False),
}

# Each block type's half-precision scale fields (byte offsets in a block): set to small finite values.
_SCALES = {T.Q4_K: ((0, 2e-4), (2, 2e-4 * 7.5)), T.Q5_0: ((0, 2e-3),)}
_POOL_BLOCKS = 1 << 18  # a pool of random blocks (36 MiB of Q4_K) that every tensor is cut from


def matrix_type(cols: int) -> T:
    return T.Q4_K if cols % 256 == 0 else T.Q5_0


class _Blocks:
    """A [*lead, rows, cols] matrix of random valid blocks, as GGUFWriter sees an array (shape in
    bytes, `tofile`): written from a shared pool at a per-tensor offset, never held whole."""

    def __init__(self, pools: dict, qtype: T, rows: int, cols: int, lead: tuple = (), seed: int = 0):
        block, size = GGML_QUANT_SIZES[qtype]
        self.pool = pools[qtype]
        self.row_bytes = cols // block * size
        self.shape = (*lead, rows, self.row_bytes)
        self.dtype = np.dtype(np.uint8)
        self.nbytes = int(np.prod(self.shape))
        self.start = (seed * 7919 % (len(self.pool) // size)) * size

    def tofile(self, f) -> None:
        pool, left, pos = self.pool, self.nbytes, self.start
        while left:
            n = min(left, len(pool) - pos)
            pool[pos:pos + n].tofile(f)
            left -= n
            pos = 0
        # the pool's length is whole blocks and every cut starts on a block: each row stays valid


def _pools(rng, n_blocks: int) -> dict:
    pools = {}
    for qtype, fields in _SCALES.items():
        block, size = GGML_QUANT_SIZES[qtype]
        p = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
        for off, scale in fields:
            halves = (rng.uniform(0.5, 1.5, n_blocks) * scale).astype(np.float16)
            p[:, off:off + 2] = halves.view(np.uint8).reshape(-1, 2)
        pools[qtype] = p.reshape(-1)
    block, size = GGML_QUANT_SIZES[T.MXFP4]  # an E8M0 scale byte, then 16 bytes of FP4 pairs
    p = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    p[:, 0] = rng.integers(116, 120, n_blocks)  # 2^-11 .. 2^-8
    pools[T.MXFP4] = p.reshape(-1)
    return pools


def _tokenizer_fields():
    """The default model's tokeniser (a gpt2 BPE vocabulary), for the padding below."""
    import gguf

    from moeray.stages.gguf.default_model import default_model_path

    r = gguf.GGUFReader(default_model_path(quiet=True))
    return {n: f for n, f in r.fields.items() if n.startswith("tokenizer.")}


def shape_path(name: str) -> Path:
    from moeray.stages.gguf.default_model import cache_dir

    return cache_dir() / f"shape-{name}-q4_k-random.gguf"


def write_shape(name: str, seed: int = 0, shape: Shape | None = None, path: Path | None = None,
                pool_blocks: int = _POOL_BLOCKS) -> Path:
    """The file for SHAPES[name] (or `shape`) in the cache dir (or at `path`), written the first
    time (atomically); a file whose sidecar records the same shape is reused."""
    import gguf

    if shape is None and name not in SHAPES:
        raise SystemExit(f"unknown shape {name!r}: choose one of {', '.join(SHAPES)}")
    s = shape or SHAPES[name]
    path = Path(path) if path is not None else shape_path(name)
    record = json.loads(json.dumps({**asdict(s), "seed": seed, "writer": 1}))  # tuples as the sidecar's lists
    meta = path.with_name(path.name + ".json")
    if path.is_file() and meta.is_file() and json.loads(meta.read_text()).get("shape") == record:
        return path
    print(f"moeray: writing a {name}-shaped GGUF with random blocks into {path} ...", file=sys.stderr)
    rng = np.random.default_rng(seed)
    pools = _pools(rng, pool_blocks)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    w = gguf.GGUFWriter(tmp, arch=s.arch)
    a = s.arch
    w.add_name(f"{name} (random blocks, moeray bench)")
    w.add_uint32(f"{a}.block_count", s.layers)
    w.add_uint32(f"{a}.context_length", s.context)
    w.add_uint32(f"{a}.embedding_length", s.hidden)
    w.add_uint32(f"{a}.feed_forward_length", s.dense_ff or s.expert_ff * s.used)
    w.add_uint32(f"{a}.expert_feed_forward_length", s.expert_ff)
    glm, oss, mla = a == "glm4moe", a == "gpt-oss", a == "deepseek2"
    if oss:  # gpt-oss-20b's rope and window
        w.add_string(f"{a}.rope.scaling.type", "yarn")
        w.add_float32(f"{a}.rope.scaling.factor", 32.0)
        w.add_uint32(f"{a}.rope.scaling.original_context_length", 4096)
        w.add_uint32(f"{a}.attention.sliding_window", s.window)
    if mla:  # DeepSeek-V3's YaRN (x40 over 4096, mscale_all_dim 1) and MLA as llama.cpp's converter writes it
        w.add_string(f"{a}.rope.scaling.type", "yarn")
        w.add_float32(f"{a}.rope.scaling.factor", 40.0)
        w.add_uint32(f"{a}.rope.scaling.original_context_length", 4096)
        w.add_float32(f"{a}.rope.scaling.yarn_log_multiplier", 0.1)
        w.add_uint32(f"{a}.attention.kv_lora_rank", s.kv_lora)
        if s.q_lora:
            w.add_uint32(f"{a}.attention.q_lora_rank", s.q_lora)
        w.add_uint32(f"{a}.attention.key_length_mla", s.head_dim)
        w.add_uint32(f"{a}.attention.value_length_mla", s.v_dim)
    if glm or mla:  # sigmoid scores + correction bias, renormalised, scaled; half of each head rotated
        w.add_uint32(f"{a}.expert_shared_count", s.shared_ff // s.expert_ff)
        w.add_uint32(f"{a}.leading_dense_block_count", s.dense_lead)
        w.add_uint32(f"{a}.expert_gating_func", int(gguf.ExpertGatingFuncType.SIGMOID))
        w.add_bool(f"{a}.expert_weights_norm", s.norm_topk)
        w.add_float32(f"{a}.expert_weights_scale", s.weights_scale)
        w.add_uint32(f"{a}.expert_group_count", s.groups[0])
        w.add_uint32(f"{a}.expert_group_used_count", s.groups[1])
        w.add_uint32(f"{a}.rope.dimension_count", s.rope_dim or s.head_dim // 2)
    elif s.shared_ff:
        w.add_uint32(f"{a}.expert_shared_feed_forward_length", s.shared_ff)
    w.add_uint32(f"{a}.attention.head_count", s.heads)
    w.add_uint32(f"{a}.attention.head_count_kv", 1 if mla else s.kv_heads)
    w.add_uint32(f"{a}.attention.key_length", s.kv_lora + s.rope_dim if mla else s.head_dim)  # MLA: the MQA view
    w.add_uint32(f"{a}.attention.value_length", s.kv_lora if mla else s.head_dim)
    w.add_float32(f"{a}.rope.freq_base", s.rope_theta)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", s.rms_eps)
    w.add_uint32(f"{a}.expert_count", s.experts)
    w.add_uint32(f"{a}.expert_used_count", s.used)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    for n, f in _tokenizer_fields().items():
        value = f.contents()
        sub = f.types[1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        if n == "tokenizer.ggml.tokens":  # padded to the model's vocabulary with control tokens
            value = value + [f"<|moeray_pad_{i}|>" for i in range(s.vocab - len(value))]
        elif n == "tokenizer.ggml.token_type":
            value = value + [3] * (s.vocab - len(value))
        w.add_key_value(n, value, f.types[0], sub)

    seed_of = iter(range(1, 1 << 30))

    def mat(rows, cols, lead=(), qtype=None):
        qtype = qtype or matrix_type(cols)
        return _Blocks(pools, qtype, rows, cols, lead, next(seed_of)), qtype

    def add(tname, arr_type):
        arr, qtype = arr_type
        w.add_tensor(tname, arr, raw_dtype=qtype)

    def vec(tname, n, value=None):
        v = np.full(n, 1.0, np.float32) if value is None else value
        w.add_tensor(tname, v)

    H, D = s.hidden, s.head_dim
    add("token_embd.weight", mat(s.vocab, H))
    for i in range(s.layers):
        p = f"blk.{i}."
        vec(p + "attn_norm.weight", H)
        if mla:
            C, R = s.kv_lora, s.rope_dim
            if s.q_lora:
                add(p + "attn_q_a.weight", mat(s.q_lora, H))
                vec(p + "attn_q_a_norm.weight", s.q_lora)
                add(p + "attn_q_b.weight", mat(s.heads * D, s.q_lora))
            else:
                add(p + "attn_q.weight", mat(s.heads * D, H))
            add(p + "attn_kv_a_mqa.weight", mat(C + R, H))
            vec(p + "attn_kv_a_norm.weight", C)
            add(p + "attn_k_b.weight", mat(C, D - R, (s.heads,)))
            add(p + "attn_v_b.weight", mat(s.v_dim, C, (s.heads,)))
            add(p + "attn_output.weight", mat(H, s.heads * s.v_dim))
        else:
            add(p + "attn_q.weight", mat(s.heads * D, H))
            add(p + "attn_k.weight", mat(s.kv_heads * D, H))
            add(p + "attn_v.weight", mat(s.kv_heads * D, H))
            add(p + "attn_output.weight", mat(H, s.heads * D))
            if a == "qwen3moe":
                vec(p + "attn_q_norm.weight", D)
                vec(p + "attn_k_norm.weight", D)
            else:
                for t, n in (("q", s.heads * D), ("k", s.kv_heads * D), ("v", s.kv_heads * D)):
                    vec(p + f"attn_{t}.bias", n, (rng.standard_normal(n) * 0.02).astype(np.float32))
        if oss:
            vec(p + "attn_output.bias", H, (rng.standard_normal(H) * 0.02).astype(np.float32))
            vec(p + "attn_sinks.weight", s.heads, rng.standard_normal(s.heads).astype(np.float32))
        vec(p + ("post_attention_norm.weight" if glm or oss else "ffn_norm.weight"), H)
        if i < s.dense_lead:
            add(p + "ffn_gate.weight", mat(s.dense_ff, H))
            add(p + "ffn_up.weight", mat(s.dense_ff, H))
            add(p + "ffn_down.weight", mat(H, s.dense_ff))
            continue
        vec(p + "ffn_gate_inp.weight", 0, (rng.standard_normal((s.experts, H)) * 0.05).astype(np.float32))
        if glm or mla:
            vec(p + "exp_probs_b.bias", s.experts, (rng.standard_normal(s.experts) * 0.01).astype(np.float32))
        x = T.MXFP4 if oss else None  # gpt-oss's published experts
        add(p + "ffn_gate_exps.weight", mat(s.expert_ff, H, (s.experts,), x))
        add(p + "ffn_up_exps.weight", mat(s.expert_ff, H, (s.experts,), x))
        add(p + "ffn_down_exps.weight", mat(H, s.expert_ff, (s.experts,), x))
        if oss:
            vec(p + "ffn_gate_inp.bias", s.experts, (rng.standard_normal(s.experts) * 0.05).astype(np.float32))
            for kind, n in (("gate", s.expert_ff), ("up", s.expert_ff), ("down", H)):
                vec(p + f"ffn_{kind}_exps.bias", 0, (rng.standard_normal((s.experts, n)) * 0.02).astype(np.float32))
        if s.shared_ff and not (glm or mla):
            vec(p + "ffn_gate_inp_shexp.weight", 0, (rng.standard_normal(H) * 0.05).astype(np.float32))
        if s.shared_ff:
            add(p + "ffn_gate_shexp.weight", mat(s.shared_ff, H))
            add(p + "ffn_up_shexp.weight", mat(s.shared_ff, H))
            add(p + "ffn_down_shexp.weight", mat(H, s.shared_ff))
    vec("output_norm.weight", H)
    add("output.weight", mat(s.vocab, H))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)
    meta.write_text(json.dumps({"shape": record, "bytes": path.stat().st_size}))
    return path


if __name__ == "__main__":
    print(write_shape(sys.argv[1] if len(sys.argv) > 1 else "qwen3-30b-a3b"))
