"""Write a transformers causal LM to GGUF the way llama.cpp's convert_hf_to_gguf.py does.

Supported: the transformers classes each architecture module lists (stages/arch/*.py
`hf_classes`): LlamaForCausalLM (dense), MixtralForCausalLM (stored as arch "llama" with
ffn_gate_inp + ffn_{gate,up,down}_exps, which is how llama.cpp stores Mixtral),
Qwen2MoeForCausalLM ("qwen2moe"), Qwen3MoeForCausalLM ("qwen3moe") and GptOssForCausalLM
("gpt-oss": its own tensor layout in stages/arch/gpt_oss.py `hf_tensor`; `expert_type="MXFP4"`
writes its experts as the published files hold them), DeepseekV3ForCausalLM ("deepseek2":
kv_b_proj split into attn_k_b / attn_v_b as the current converter does) and Glm4MoeForCausalLM
("glm4moe", with the MTP layer the converter appends). A family's own layout is its module's
`hf_tensor` / `hf_tensor_from_gguf` / `hf_extra_tensors` / `write_metadata`.

The conventions copied from llama.cpp, because files written here must run there too:
- llama q/k rows are permuted (LlamaModel.permute) so that RoPE rotates adjacent pairs; qwen
  models are stored unpermuted and rotated NeoX-style (halves).
- experts are stacked: ffn_gate_exps / ffn_up_exps [E, F, H], ffn_down_exps [E, H, F] (numpy
  order); transformers 5's fused `experts.gate_up_proj` [E, 2F, H] holds gate then up.
- 1-D tensors, *_norm weights, biases and the routers (ffn_gate_inp, ffn_gate_inp_shexp) stay F32
  whatever the file type; a matrix whose rows do not split into whole quant blocks falls back to F16.
- the shared-expert gate [1, H] is stored 1-D, as llama.cpp's converter (squeeze) did and as
  transformers' GGUF loader expects.

`dequantized_state_dict` reads a written file back into a transformers state dict, so a test can
run transformers on exactly the weights (after F16 / Q8_0 rounding) that the GGUF holds.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

import gguf
from gguf import GGMLQuantizationType as QT

from moeray.stages.arch import by_hf_class

FILE_TYPES = {  # name -> (weight type for quantisable matrices, general.file_type)
    "F32": (QT.F32, gguf.LlamaFileType.ALL_F32),
    "F16": (QT.F16, gguf.LlamaFileType.MOSTLY_F16),
    "Q8_0": (QT.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
}

# Per-layer HF name (after "model.layers.{i}.") -> GGUF name (after "blk.{i}.").
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_FUSED_GATE_UP = "mlp.experts.gate_up_proj"
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
# Tensors llama.cpp keeps in F32 whatever the requested file type.
_ALWAYS_F32 = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight")


def llama_permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: reorder q/k rows so RoPE pairs become adjacent."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_unpermute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """Inverse of llama_permute."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _add_rope(w: gguf.GGUFWriter, config: Any) -> None:
    """rope.freq_base, and rope.scaling.* for YaRN as llama.cpp's TextModel writes them."""
    params = getattr(config, "rope_parameters", None) or {}
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    w.add_rope_freq_base(float(theta if theta is not None else 10000.0))
    kind = params.get("rope_type", "default")
    if kind in ("default", None):
        return
    if kind != "yarn":
        raise ValueError(f"rope type {kind!r} is not written by this converter")
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(float(params["factor"]))
    w.add_rope_scaling_orig_ctx_len(int(params["original_max_position_embeddings"]))
    if params.get("attention_factor") is not None:
        w.add_rope_scaling_yarn_attn_factor(float(params["attention_factor"]))
    for key, setter in (("beta_fast", w.add_rope_scaling_yarn_beta_fast), ("beta_slow", w.add_rope_scaling_yarn_beta_slow)):
        if params.get(key) is not None:
            setter(float(params[key]))


def _n_experts(config: Any) -> int:
    return int(getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0)


def _gguf_names(hf_key: str) -> list[str]:
    """GGUF tensor name(s) for one transformers state-dict key (two for the fused gate_up)."""
    if hf_key in _GLOBAL_NAMES:
        return [_GLOBAL_NAMES[hf_key]]
    m = _LAYER_RE.fullmatch(hf_key)
    if m:
        bid, rest = m.groups()
        if rest == _FUSED_GATE_UP:
            return [f"blk.{bid}.ffn_gate_exps.weight", f"blk.{bid}.ffn_up_exps.weight"]
        if rest in _LAYER_NAMES:
            return [f"blk.{bid}.{_LAYER_NAMES[rest]}"]
    raise ValueError(f"no GGUF name for transformers tensor {hf_key!r}")


def gguf_tensors_from_hf(state_dict: dict[str, Any], config: Any) -> dict[str, np.ndarray]:
    """The float32 tensors of the GGUF (numpy order), from a transformers state dict."""
    arch = by_hf_class(config)
    permute = arch.permute_qk
    n_head, n_kv = config.num_attention_heads, config.num_key_value_heads
    out: dict[str, np.ndarray] = {}
    for key, t in state_dict.items():
        if key == "lm_head.weight" and getattr(config, "tie_word_embeddings", False):
            continue  # tied: llama.cpp reuses token_embd when output.weight is absent
        a = t.detach().to("cpu").float().numpy() if hasattr(t, "detach") else np.asarray(t, np.float32)
        m = _LAYER_RE.fullmatch(key)
        own = arch.hf_tensor(int(m.group(1)), m.group(2), a, config) if m else arch.hf_tensor(None, key, a, config)
        if own is not None:  # a family whose converter transforms this tensor (stages/arch/)
            out.update((n, np.ascontiguousarray(x, dtype=np.float32)) for n, x in own)
            continue
        names = _gguf_names(key)
        if len(names) == 2:  # fused [E, 2F, H]: gate rows first, then up rows
            f = a.shape[1] // 2
            out[names[0]] = np.ascontiguousarray(a[:, :f, :])
            out[names[1]] = np.ascontiguousarray(a[:, f:, :])
            continue
        name = names[0]
        if permute and (".attn_q." in name):
            a = llama_permute(a, n_head, n_head)
        elif permute and (".attn_k." in name):
            a = llama_permute(a, n_head, n_kv)
        if name.endswith("ffn_gate_inp_shexp.weight"):
            a = a.reshape(-1)
        out[name] = np.ascontiguousarray(a)
    return out


def tensor_type(name: str, array: np.ndarray, weight_type: QT) -> QT:
    """The GGML type llama.cpp's converter gives this tensor for the requested weight type."""
    if array.ndim <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight"):
        return QT.F32
    if any(name.endswith(s) for s in _ALWAYS_F32):
        return QT.F32
    if weight_type in (QT.F32, QT.F16):
        return weight_type
    block = gguf.GGML_QUANT_SIZES[weight_type][0]
    return weight_type if array.shape[-1] % block == 0 else QT.F16  # llama.cpp's QuantError fallback


def _encode(array: np.ndarray, qtype: QT) -> np.ndarray:
    if qtype == QT.F32:
        return array.astype(np.float32)
    if qtype == QT.F16:
        return array.astype(np.float16)
    return gguf.quants.quantize(array.astype(np.float32), qtype)


def _add_metadata(w: gguf.GGUFWriter, config: Any, arch, file_type: gguf.LlamaFileType,
                  name: str) -> None:
    head_dim = _head_dim(config)
    n_experts = _n_experts(config)
    w.add_name(name)
    w.add_block_count(config.num_hidden_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(int(getattr(config, "intermediate_size", 0) or 0))
    w.add_head_count(config.num_attention_heads)
    n_kv, key_length, value_length = arch.hf_heads(config, head_dim)
    w.add_head_count_kv(n_kv)
    w.add_key_length(key_length)
    w.add_value_length(value_length)
    w.add_rope_dimension_count(arch.hf_rope_dim(config, head_dim))
    _add_rope(w, config)
    w.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    w.add_vocab_size(config.vocab_size)
    if n_experts:
        w.add_expert_count(n_experts)
        w.add_expert_used_count(int(config.num_experts_per_tok))
        moe_ffn = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        w.add_expert_feed_forward_length(int(moe_ffn))
        # llama.cpp hard-codes the renormalisation per arch (Mixtral and qwen3moe: yes, qwen2moe:
        # no); the key records what the transformers model really does, for readers that look.
        w.add_expert_weights_norm(arch.hf_norm_topk(config))
    arch.write_metadata(w, config)
    w.add_file_type(file_type)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, setter in (("bos_token_id", w.add_bos_token_id), ("eos_token_id", w.add_eos_token_id)):
        value = getattr(config, key, None)
        if isinstance(value, int):
            setter(value)


def _add_gpt2_tokenizer(w: gguf.GGUFWriter, tokenizer: Any) -> None:
    """tokenizer.ggml.* for a byte-level BPE (gpt2-style) `tokenizers` / transformers fast tokenizer."""
    import json

    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)  # transformers fast -> tokenizers
    model = json.loads(backend.to_str())["model"]
    if model.get("type") != "BPE":
        raise ValueError(f"only BPE tokenizers are written (got {model.get('type')!r})")
    vocab: dict[str, int] = dict(model["vocab"])
    added = backend.get_added_tokens_decoder()
    vocab.update({t.content: i for i, t in added.items()})
    # As llama.cpp's converter types added tokens: special ones CONTROL (never text), the others
    # USER_DEFINED (text, matched whole: Qwen's <think> and <tool_call>).
    kinds = {t.content: gguf.TokenType.CONTROL if t.special else gguf.TokenType.USER_DEFINED for t in added.values()}
    size = max(vocab.values()) + 1
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [gguf.TokenType.UNUSED] * size
    for tok, i in vocab.items():
        tokens[i] = tok
        types[i] = kinds.get(tok, gguf.TokenType.NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    chat_template = getattr(tokenizer, "chat_template", None)
    if isinstance(chat_template, str):
        w.add_chat_template(chat_template)


def write_gguf(model: Any, path: str | Path, file_type: str = "F32", tokenizer: Any = None,
               name: str | None = None, expert_type: str | None = None,
               token_roles: dict[str, str] | None = None) -> Path:
    """Write a transformers model (anything with .state_dict() and .config) to a GGUF file.

    file_type: "F32", "F16" or "Q8_0". tokenizer: an optional byte-level BPE tokenizer to embed.
    expert_type: the routed experts' own block type (e.g. "MXFP4", as gpt-oss files hold them).
    token_roles: more special ids by the token's text, e.g. {"eot": "<|user|>", "eom": "<|observation|>"}
    (GLM's files end a reply at either).
    """
    if file_type not in FILE_TYPES:
        raise ValueError(f"file_type must be one of {', '.join(FILE_TYPES)}, not {file_type!r}")
    config = model.config
    arch = by_hf_class(config)
    weight_type, ftype = FILE_TYPES[file_type]
    tensors = gguf_tensors_from_hf(model.state_dict(), config)
    _check_layers(tensors, config, arch)
    tensors.update(arch.hf_extra_tensors(config, tensors))

    path = Path(path)
    w = gguf.GGUFWriter(path, arch.name)
    _add_metadata(w, config, arch, ftype, name or f"moeray-tiny-{config.model_type}")
    if tokenizer is not None:
        _add_gpt2_tokenizer(w, tokenizer)
        for key, setter in (("bos_token_id", w.add_bos_token_id), ("eos_token_id", w.add_eos_token_id)):
            value = getattr(tokenizer, key, None)
            if getattr(config, key, None) is None and isinstance(value, int):
                setter(value)
        for role, text in (token_roles or {}).items():
            getattr(w, f"add_{role}_token_id")(tokenizer.convert_tokens_to_ids(text))
    for tname in _ordered(tensors):
        a = tensors[tname]
        qtype = tensor_type(tname, a, weight_type)
        if expert_type is not None and tname.endswith("_exps.weight"):
            qtype = tensor_type(tname, a, QT[expert_type])
        w.add_tensor(tname, _encode(a, qtype), raw_dtype=qtype if qtype not in (QT.F32, QT.F16) else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _ordered(tensors: dict[str, np.ndarray]) -> list[str]:
    """llama.cpp's order: token_embd, the blocks in layer order, then output_norm and output."""
    def key(n: str) -> tuple[int, int, str]:
        if n.startswith("blk."):
            return (1, int(n.split(".")[1]), n)
        return (0 if n.startswith("token_embd") else 2, 0, n)
    return sorted(tensors, key=key)


def _check_layers(tensors: dict[str, np.ndarray], config: Any, arch) -> None:
    """Refuse models whose layers are not what the architecture says (e.g. qwen2moe
    mlp_only_layers: llama.cpp's qwen2moe has no dense layers; DeepSeek's leading ones are fine)."""
    moe = _n_experts(config) > 0
    dense = arch.hf_dense_layers(config)
    for i in range(config.num_hidden_layers):
        kind = f"blk.{i}.ffn_gate_exps.weight" if moe and i not in dense else f"blk.{i}.ffn_gate.weight"
        if kind not in tensors:
            raise ValueError(f"layer {i} of this {arch.name} model has no {kind.split('.', 2)[2]}: "
                             "models that mix dense and MoE layers are not written")


# ---------------------------------------------------------------------------------------------
# Reading back


def read_dequantized(path: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of a GGUF, dequantised to float32 in numpy order."""
    reader = gguf.GGUFReader(path)
    out = {}
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        out[t.name] = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32).reshape(shape)
    return out


def dequantized_state_dict(path: str | Path, model: Any) -> dict[str, Any]:
    """The transformers state dict (keys and shapes of `model`) holding the GGUF's weights.

    Loading it into `model` makes transformers compute with exactly the F16 / Q8_0-rounded weights
    the file holds, which is the reference a quantised GGUF's logits should match.
    """
    import torch

    config = model.config
    permute = by_hf_class(config).permute_qk
    n_head, n_kv = config.num_attention_heads, config.num_key_value_heads
    g = read_dequantized(path)
    out = {}
    arch = by_hf_class(config)
    for key, ref in model.state_dict().items():
        own = arch.hf_tensor_from_gguf(key, g)
        if own is not None:
            a = own
        elif key == "lm_head.weight" and "output.weight" not in g:
            a = g["token_embd.weight"]
        else:
            names = _gguf_names(key)
            if len(names) == 2:
                a = np.concatenate([g[names[0]], g[names[1]]], axis=1)
            else:
                a = g[names[0]]
                if permute and ".attn_q." in names[0]:
                    a = llama_unpermute(a, n_head, n_head)
                elif permute and ".attn_k." in names[0]:
                    a = llama_unpermute(a, n_head, n_kv)
        out[key] = torch.from_numpy(np.array(a, dtype=np.float32)).reshape(ref.shape).to(ref.dtype)
    return out


# ---------------------------------------------------------------------------------------------
# Models in parts


def split_gguf(src: str | Path, prefix: str | Path, max_tensors: int = 0, max_bytes: int = 0,
               first_without_tensors: bool = False, layer_order: bool = False) -> list[Path]:
    """Cut a GGUF into parts the way llama.cpp's `llama-gguf-split --split` does: files
    `PREFIX-00001-of-0000N.gguf`..., the tensors in the file's order, a new part when this one
    holds `max_tensors` tensors or the next tensor would take it past `max_bytes` (a part holds at
    least one tensor); the first part carries the model's metadata (its bytes copied as they are),
    every part `split.no`, `split.count` and `split.tensors.count`. `first_without_tensors`: the
    first part holds the metadata alone (gguf-split's --no-tensor-first-split). `layer_order`: the
    tensors in llama.cpp's converter order (`_ordered`: embedding, layers, head) rather than the
    file's own, as published models in parts are laid out. Returns the paths.
    """
    import struct

    from moeray.stages.gguf.reader import DEFAULT_ALIGNMENT, _read_directory

    if max_tensors <= 0 and max_bytes <= 0:
        raise ValueError("give max_tensors or max_bytes (> 0)")
    d = _read_directory(str(src))
    if any(k.startswith("split.") for k in d.metadata):
        raise ValueError(f"{src} is already a part of a model in parts")
    groups: list[list[str]] = [[], []] if first_without_tensors else []  # the metadata's part, then the first of tensors
    size = 0
    for name in (_ordered(d.tensors) if layer_order else d.tensors):
        n = -(-d.tensors[name].n_bytes // DEFAULT_ALIGNMENT) * DEFAULT_ALIGNMENT  # gguf-split counts padded bytes
        if not groups or (groups[-1] and (
                (max_tensors and len(groups[-1]) >= max_tensors) or (max_bytes and size + n > max_bytes))):
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += n
    with open(src, "rb") as f:
        f.seek(d.kv_span[0])
        model_kv = f.read(d.kv_span[1] - d.kv_span[0])
    align = int(d.metadata.get("general.alignment", DEFAULT_ALIGNMENT))

    def kv_string(s: str) -> bytes:
        b = s.encode()
        return struct.pack("<Q", len(b)) + b

    def split_kv(i: int) -> tuple[bytes, int]:
        out = (kv_string("split.no") + struct.pack("<IH", gguf.GGUFValueType.UINT16, i)
               + kv_string("split.count") + struct.pack("<IH", gguf.GGUFValueType.UINT16, len(groups))
               + kv_string("split.tensors.count") + struct.pack("<Ii", gguf.GGUFValueType.INT32, len(d.tensors)))
        n = 3
        if i > 0 and align != DEFAULT_ALIGNMENT:  # the others' data is laid out at the model's alignment too
            out += kv_string("general.alignment") + struct.pack("<II", gguf.GGUFValueType.UINT32, align)
            n += 1
        return out, n

    paths = []
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    with open(src, "rb") as f:
        for i, names in enumerate(groups):
            path = Path(f"{prefix}-{i + 1:05d}-of-{len(groups):05d}.gguf")
            kv, n_kv = split_kv(i)
            if i == 0:
                kv, n_kv = model_kv + kv, n_kv + len(d.metadata)
            infos, rel = b"", 0
            for name in names:
                t = d.tensors[name]
                dims = tuple(reversed(t.shape))
                infos += kv_string(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
                infos += struct.pack("<IQ", int(t.ggml_type), rel)
                rel += (t.n_bytes + align - 1) // align * align
            head = b"GGUF" + struct.pack("<IQQ", 3, len(names), n_kv) + kv + infos
            with open(path, "wb") as out:
                out.write(head + b"\0" * (-len(head) % align))
                for name in names:
                    t = d.tensors[name]
                    f.seek(t.offset)
                    out.write(f.read(t.n_bytes))
                    out.write(b"\0" * (-t.n_bytes % align))
            paths.append(path)
    return paths
