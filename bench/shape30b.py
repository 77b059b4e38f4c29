"""A Qwen3-30B-A3B-shaped MoE GGUF with random blocks, written with numpy and gguf's writer alone.

The real file is ~17 GB (Q4_K_M) and cannot travel to the GPU machine (64 MiB a call), so the
device check writes this one there: the same architecture (qwen3moe: QK-norm, 128 experts,
top-8, renormalised) and the same tensor shapes (hidden 2048, 32 query / 4 KV heads of 128,
expert FFN 768, vocab 151936), the quant types of a Q4_K_M file (Q4_K weights, Q6_K for
attn_v, the experts' down projection and the output head, float32 norms and routers), but only
`layers` of the 48 layers: a slice of the real shape. Every block holds random codes under sane
float16 scales chosen so activations stay O(1) through the layers; it computes nothing meaningful,
but it moves exactly the bytes a real layer moves, through the same kernels.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

# Qwen3-30B-A3B (config.json of Qwen/Qwen3-30B-A3B)
FULL = dict(hidden=2048, heads=32, kv_heads=4, head_dim=128, experts=128, used=8, expert_ffn=768,
            vocab=151936, layers=48)
QUICK = dict(hidden=256, heads=4, kv_heads=2, head_dim=64, experts=16, used=4, expert_ffn=256,
             vocab=1024, layers=2)  # the CPU dry run: the same writer, tiny

Q4_K, Q6_K = 12, 14
BLOCK = {Q4_K: (256, 144), Q6_K: (256, 210)}


def _blocks(qtype: int, rows: int, cols: int, rng: np.random.Generator, lead: int = 1, gain: float = 1.0) -> np.ndarray:
    """uint8 [lead, rows, cols // 256 * type_size] of random blocks whose weights have std about
    gain/sqrt(cols) and mean about 0 (Q4_K: the sub-block mins cancel the codes' mean)."""
    qk, size = BLOCK[qtype]
    n = lead * rows * cols // qk
    b = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    target = gain / math.sqrt(cols)
    if qtype == Q4_K:
        # w = d * sc_j * q - dmin * m_j, q uniform in 0..15 (mean 7.5, std 4.6). Every sub-block
        # scale 32 and min 30 with dmin = 8 d: w = 32 d (q - 7.5). The 12 packed bytes: bytes 0-3
        # sc_j | (sc_j+4 >> 4) << 6, bytes 4-7 m_j | (m_j+4 >> 4) << 6, bytes 8-11 the low
        # nibbles of sc_j+4 | m_j+4 << 4.
        d = np.float16(target / (32 * 4.6))
        b[:, 0:2] = np.frombuffer(d.tobytes(), dtype=np.uint8)
        b[:, 2:4] = np.frombuffer(np.float16(8 * d).tobytes(), dtype=np.uint8)
        b[:, 4:8] = 32 | (32 >> 4) << 6
        b[:, 8:12] = 30 | (30 >> 4) << 6
        b[:, 12:16] = (32 & 15) | (30 & 15) << 4
    else:  # Q6_K: w = d * sc * (q - 32), q 0..63 (std 18.5), int8 scales at 192..208
        b[:, 192:208] = 16
        d = np.float16(target / (16 * 18.5))
        b[:, 208:210] = np.frombuffer(d.tobytes(), dtype=np.uint8)
    return b.reshape(lead, rows, -1) if lead > 1 else b.reshape(rows, -1)


def write(path: Path, layers: int, quick: bool = False, seed: int = 0) -> Path:
    """Write the slice to `path` (skipped when an earlier run wrote the same one)."""
    import gguf

    s = dict(QUICK if quick else FULL, layers=layers)
    meta = path.with_suffix(".json")
    if path.is_file() and meta.is_file() and json.loads(meta.read_text()) == {**s, "seed": seed}:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    H, E, Fe, V = s["hidden"], s["experts"], s["expert_ffn"], s["vocab"]
    q, kv = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    w = gguf.GGUFWriter(str(path) + ".tmp", "qwen3moe")
    w.add_name("qwen3-30b-a3b-shaped-random")
    w.add_block_count(layers)
    w.add_context_length(4096)
    w.add_embedding_length(H)
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_key_length(s["head_dim"])
    w.add_value_length(s["head_dim"])
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(E)
    w.add_expert_used_count(s["used"])
    w.add_expert_feed_forward_length(Fe)
    w.add_feed_forward_length(6144 if not quick else 512)

    def raw(name, qtype, rows, cols, lead=1, gain=1.0):
        a = _blocks(qtype, rows, cols, rng, lead, gain)
        w.add_tensor(name, a, raw_dtype=gguf.GGMLQuantizationType(qtype))  # shape: from the bytes

    def f32(name, a):
        w.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32))

    raw("token_embd.weight", Q4_K, V, H)
    for l in range(layers):
        p = f"blk.{l}."
        f32(p + "attn_norm.weight", 1.0 + 0.1 * rng.standard_normal(H))
        raw(p + "attn_q.weight", Q4_K, q, H)
        raw(p + "attn_k.weight", Q4_K, kv, H)
        raw(p + "attn_v.weight", Q6_K, kv, H)
        raw(p + "attn_output.weight", Q4_K, H, q)
        f32(p + "attn_q_norm.weight", 1.0 + 0.1 * rng.standard_normal(s["head_dim"]))
        f32(p + "attn_k_norm.weight", 1.0 + 0.1 * rng.standard_normal(s["head_dim"]))
        f32(p + "ffn_norm.weight", 1.0 + 0.1 * rng.standard_normal(H))
        # a decisive router (no near-ties that float rounding alone could flip)
        f32(p + "ffn_gate_inp.weight", rng.standard_normal((E, H)) * (4.0 / math.sqrt(H)))
        raw(p + "ffn_gate_exps.weight", Q4_K, Fe, H, lead=E)
        raw(p + "ffn_up_exps.weight", Q4_K, Fe, H, lead=E)
        raw(p + "ffn_down_exps.weight", Q6_K, H, Fe, lead=E)
    f32("output_norm.weight", np.ones(H))
    raw("output.weight", Q6_K, V, H, gain=4.0)  # logits spread wide: a clear greedy pick
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    Path(str(path) + ".tmp").replace(path)
    meta.write_text(json.dumps({**s, "seed": seed}))
    return path
