"""Random valid GGUF blocks of any quant type, and ggml's own dequantisation of them.

"Valid": every float16 scale field (the E8M0 exponent of MXFP4) holds a sane finite value, so the
references stay finite; every other bit (codes, grid indices, signs, sub-block scales) is random.
"""
from __future__ import annotations

import ctypes

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT

# Where each type keeps its float16 scales: (byte offset, count) of consecutive halves.
_F16_FIELDS = {
    QT.Q8_0: (0, 1), QT.Q4_0: (0, 1), QT.Q5_0: (0, 1), QT.Q4_1: (0, 2), QT.Q5_1: (0, 2),
    QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q2_K: (-4, 2), QT.Q3_K: (-2, 1), QT.Q6_K: (-2, 1),
    QT.IQ4_NL: (0, 1), QT.IQ4_XS: (0, 1), QT.IQ2_XXS: (0, 1), QT.IQ2_XS: (0, 1), QT.IQ2_S: (0, 1),
    QT.IQ3_XXS: (0, 1), QT.IQ3_S: (0, 1), QT.IQ1_S: (0, 1),
}


def random_blocks(qtype: QT, n_blocks: int, rng: np.random.Generator, scale: float = 1.0) -> np.ndarray:
    """uint8 [n_blocks, type_size]; float16 scales uniform in [-scale, scale]."""
    _, size = GGML_QUANT_SIZES[qtype]
    b = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    halves = rng.uniform(-scale, scale, size=(n_blocks, 2)).astype(np.float16)
    if qtype == QT.MXFP4:  # E8M0 exponent 2^(e-128), for values (up to 6x it) around `scale`
        mid = 128 + int(round(np.log2(scale / 6)))
        b[:, 0] = rng.integers(mid - 4, mid + 4, size=n_blocks)
    elif qtype == QT.IQ1_M:  # the block's fp16 scale is spread over the top nibbles of 4 uint16
        sc = b[:, 48:56].copy().view(np.uint16)
        d = halves[:, 0].view(np.uint16)
        for i in range(4):
            sc[:, i] = (sc[:, i] & 0x0FFF) | (((d >> (4 * i)) & 0xF) << 12)
        b[:, 48:56] = sc.view(np.uint8)
    elif qtype in _F16_FIELDS:
        start, count = _F16_FIELDS[qtype]
        start %= size
        b[:, start:start + 2 * count] = halves[:, :count].view(np.uint8)
    return b


def ggml_to_float(raw: np.ndarray, qtype: QT) -> np.ndarray:
    """ggml's own dequantisation (its type traits' to_float), float32 [n_values]."""
    from ggml import ggml as G
    block, size = GGML_QUANT_SIZES[qtype]
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    out = np.empty(raw.size // size * block, dtype=np.float32)
    traits = G.ggml_get_type_traits(int(qtype)).contents
    traits.to_float(raw.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), out.size)
    return out


def with_random_experts(src, dst, qtype: QT, rng: np.random.Generator, scale: float = 0.01):
    """Copy the GGUF `src` to `dst` with every routed expert tensor replaced by random valid
    `qtype` blocks (gguf-py cannot quantise to the IQ types; the bits need not mean anything for a
    model to run and be priced)."""
    import gguf
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(field.name, field.contents(), vtype, sub)
    block, size = GGML_QUANT_SIZES[qtype]
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))  # numpy order
        if t.name.endswith("_exps.weight"):
            rows = int(np.prod(shape[:-1]))
            data = random_blocks(qtype, rows * shape[-1] // block, rng, scale).reshape(*shape[:-1], -1)
            w.add_tensor(t.name, data, raw_dtype=qtype)
        else:
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst
