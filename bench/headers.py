"""Header-only GGUFs of published models: the metadata and tensor directory of the real file, no
tensor data, so `moeray plan` prices the real model (it reads headers only) in under a second.

    python bench/headers.py gpt-oss-120b /tmp/gpt-oss-120b.header.gguf
    moeray plan /tmp/gpt-oss-120b.header.gguf --devices 24GiB,24GiB,16GiB,16GiB

Shapes are the published config.json; tensor types those of the published GGUF where known:
gpt-oss's experts are MXFP4 (ggml-org/gpt-oss-*-GGUF, the MXFP4 checkpoint repacked); its other
matrices are taken as Q8_0 and its vectors F32 (the 20B file's published ~12.1 GB matches this
mix: `bytes` below prints 12.1e9). Tensor names and metadata keys are llama.cpp's converter's.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gguf  # noqa: E402
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T  # noqa: E402


@dataclass(frozen=True)
class GptOssShape:
    layers: int
    experts: int
    used: int = 4
    hidden: int = 2880
    expert_ff: int = 2880
    heads: int = 64
    kv_heads: int = 8
    head_dim: int = 64
    vocab: int = 201088
    window: int = 128
    context: int = 131072


SHAPES = {"gpt-oss-120b": GptOssShape(layers=36, experts=128), "gpt-oss-20b": GptOssShape(layers=24, experts=32)}


def gpt_oss_tensors(s: GptOssShape, expert_type: T = T.MXFP4, trunk_type: T = T.Q8_0) -> dict[str, tuple[tuple[int, ...], T]]:
    """name -> (numpy shape, type), as the converter names them."""
    H, E, F, q, kv = s.hidden, s.experts, s.expert_ff, s.heads * s.head_dim, s.kv_heads * s.head_dim
    t = {"token_embd.weight": ((s.vocab, H), trunk_type), "output_norm.weight": ((H,), T.F32),
         "output.weight": ((s.vocab, H), trunk_type)}
    for i in range(s.layers):
        p = f"blk.{i}."
        t.update({p + "attn_norm.weight": ((H,), T.F32), p + "post_attention_norm.weight": ((H,), T.F32),
                  p + "attn_q.weight": ((q, H), trunk_type), p + "attn_k.weight": ((kv, H), trunk_type),
                  p + "attn_v.weight": ((kv, H), trunk_type), p + "attn_output.weight": ((H, q), trunk_type),
                  p + "attn_q.bias": ((q,), T.F32), p + "attn_k.bias": ((kv,), T.F32), p + "attn_v.bias": ((kv,), T.F32),
                  p + "attn_output.bias": ((H,), T.F32), p + "attn_sinks.weight": ((s.heads,), T.F32),
                  p + "ffn_gate_inp.weight": ((E, H), T.F32), p + "ffn_gate_inp.bias": ((E,), T.F32),
                  p + "ffn_gate_exps.weight": ((E, F, H), expert_type), p + "ffn_up_exps.weight": ((E, F, H), expert_type),
                  p + "ffn_down_exps.weight": ((E, H, F), expert_type),
                  p + "ffn_gate_exps.bias": ((E, F), T.F32), p + "ffn_up_exps.bias": ((E, F), T.F32),
                  p + "ffn_down_exps.bias": ((E, H), T.F32)})
    return t


def nbytes(shape: tuple[int, ...], qtype: T) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    return int(np.prod(shape)) // block * size


def write_gpt_oss_header(name: str, path: Path) -> Path:
    s = SHAPES[name]
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    w.add_name(name)
    w.add_block_count(s.layers)
    w.add_context_length(s.context)
    w.add_embedding_length(s.hidden)
    w.add_feed_forward_length(s.expert_ff)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_dimension_count(s.head_dim)
    w.add_rope_freq_base(150000.0)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(32.0)
    w.add_rope_scaling_orig_ctx_len(4096)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_expert_count(s.experts)
    w.add_expert_used_count(s.used)
    w.add_expert_feed_forward_length(s.expert_ff)
    w.add_sliding_window(s.window)
    w.add_vocab_size(s.vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_MXFP4_MOE)
    for tname, (shape, qtype) in gpt_oss_tensors(s).items():
        if qtype == T.F32:
            w.add_tensor_info(tname, shape, np.dtype(np.float32), nbytes(shape, qtype))
        else:  # the writer takes a block type's shape in bytes per row
            block, size = GGML_QUANT_SIZES[qtype]
            w.add_tensor_info(tname, (*shape[:-1], shape[-1] // block * size), np.dtype(np.uint8),
                              nbytes(shape, qtype), raw_dtype=qtype)
    w.write_header_to_file(path=path)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    return path


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in SHAPES:
        print(f"usage: python bench/headers.py {{{','.join(SHAPES)}}} OUT.gguf", file=sys.stderr)
        return 2
    path = write_gpt_oss_header(argv[0], Path(argv[1]))
    total = sum(nbytes(shape, qtype) for shape, qtype in gpt_oss_tensors(SHAPES[argv[0]]).values())
    print(f"{path}: header of {argv[0]}, {total / 1e9:.1f} GB of tensors as published (not written)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
