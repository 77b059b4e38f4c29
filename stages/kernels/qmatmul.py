"""Quantised matrices: a weight W [N, K] kept in its GGUF block form, multiplied without ever
expanding it to float32 for good.

A `QMatrix` holds the stored bytes (a view of the file mapping for host experts, an owned copy for
trunk weights and cache slots) and computes y = x @ W.T by one of three backends:

- "ggml": ggml's CPU kernels (the ones llama.cpp runs) straight on the blocks, through the
  `ggml-python` binding. Activations are quantised to 8 bits inside, as llama.cpp does, so results
  differ from float32 by ~5e-3 relative. Fastest on CPU for every block type we meet (docs/kernels.md).
- "dequant": dequantise the blocks on each use (stages/gguf/quant.py) and run F.linear. The pure-torch
  fallback when ggml is not installed. On CUDA devices the blocks are read on the card by the
  Triton kernels of stages/kernels/triton_kernels.py instead, when triton imports (StageOptions.triton).
- "exact": dequantised to float32 once at load (4 bytes a weight). For debugging and for parity
  tests against float references (`--exact`); never the serving default.

The backend is one of the stage's options, chosen and logged in stages/kernels/backend.py; ggml's
threads are stages/kernels/threads.py's, its graphs and their scratch stages/kernels/graphs.py's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from moeray.errors import MoerayError
from moeray.stages.kernels import repack
from moeray.stages.kernels.backend import _card_kernels, current_backend
from moeray.stages.kernels.ggml_lib import load_once
from moeray.stages.kernels.graphs import _activations, _graph, graph_weight
from moeray.stages.kernels.host_memory import weight_buffer
from moeray.stages.gguf.quant import as_uint8_tensor, dequantize

_G = load_once()[0]  # ggml-python's module (None without it: the ggml backend is never chosen then)

# Types kept as plain float tensors whatever the backend: they are tiny (norms, routers, biases) or
# already a float format a torch matmul reads directly.
FLOAT_TYPES = frozenset((T.F32, T.F64))


def _ggml_linear(w: "QMatrix", x: torch.Tensor, norm: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    """x @ W.T as one graph; with `norm`, (rms_norm(x) * norm) @ W.T, as llama.cpp's head: the norm
    its two nodes there, where torch's rms_norm is ~10 ops (~0.15 ms a decode step, from cold caches)."""
    M, (N, K) = x.shape[0], w.shape

    def build(ctx):
        wt = graph_weight(ctx, w)
        xt = _activations(ctx, K, M, [w])
        if norm is None:
            return [wt, xt], _G.ggml_mul_mat(ctx, wt, xt), []
        nt = _G.ggml_new_tensor_1d(ctx, _G.GGML_TYPE_F32, K)
        h = _G.ggml_mul(ctx, _G.ggml_rms_norm(ctx, xt, eps), nt)
        return [wt, xt, nt], _G.ggml_mul_mat(ctx, wt, h), None  # None: the norm's nodes get scratch

    key = ("linear", w.graph_key, M) if norm is None else ("norm_linear", w.graph_key, M, eps)
    out = torch.empty(M, N)
    _graph(key, build)([w.graph_ptr, x.data_ptr()] + ([] if norm is None else [norm.data_ptr()]), out.data_ptr())
    return out


def _ggml_rows(w: "QMatrix", ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of W dequantised by ggml_get_rows, as llama.cpp reads its token embedding: one
    graph call a step where torch's dequantisation is ~10 ops (~0.2 ms a decode step, run while
    the caches are cold from the step before)."""
    n, K = ids.numel(), w.shape[1]

    def build(ctx):
        wt = graph_weight(ctx, w)
        it = _G.ggml_new_tensor_1d(ctx, _G.GGML_TYPE_I32, n)
        return [wt, it], _G.ggml_get_rows(ctx, wt, it), []

    g = _graph(("rows", w.graph_key, n), build)
    idx = ids.to(torch.int32).contiguous()
    out = torch.empty(n, K)
    g([w.graph_ptr, idx.data_ptr()], out.data_ptr())
    return out


def _ggml_swiglu(gate: "QMatrix", up: "QMatrix", down: "QMatrix", x: torch.Tensor, act: "GLU",
                 bias: "ExpertBias | None") -> torch.Tensor:
    """down(act(gate x [+ b_g], up x [+ b_u])) [+ b_d] as one graph: one call from Python for the
    three matmuls (ggml_swiglu_oai is ggml's own kernel for gpt-oss's clamped form)."""
    M, (Fd, K), H = x.shape[0], gate.shape, down.shape[0]

    def build(ctx):
        wg, wu, wd = graph_weight(ctx, gate), graph_weight(ctx, up), graph_weight(ctx, down)
        xt = _activations(ctx, K, M, [gate, up, down])  # h, from x, keeps its planes for down
        inputs, scratch = [wg, wu, wd, xt], []
        g = _G.ggml_mul_mat(ctx, wg, xt)
        u = _G.ggml_mul_mat(ctx, wu, xt)
        scratch += [g, u]
        if bias is not None:
            bg, bu, bd = (_G.ggml_new_tensor_1d(ctx, _G.GGML_TYPE_F32, n) for n in (Fd, Fd, H))
            inputs += [bg, bu, bd]
            g, u = _G.ggml_add(ctx, g, bg), _G.ggml_add(ctx, u, bu)
            scratch += [g, u]
        if act.kind == "swiglu_oai":
            h = _G.ggml_swiglu_oai(ctx, g, u, act.alpha, act.limit)
            scratch.append(h)
        else:
            s = _G.ggml_silu(ctx, g)
            h = _G.ggml_mul(ctx, s, u)
            scratch += [s, h]
        y = _G.ggml_mul_mat(ctx, wd, h)
        if bias is not None:
            scratch.append(y)
            y = _G.ggml_add(ctx, y, bd)
        return inputs, y, scratch

    key = ("swiglu", gate.graph_key, up.graph_key, down.graph_key, M, act, bias is not None)
    g = _graph(key, build)
    out = torch.empty(M, H)
    ptrs = [gate.graph_ptr, up.graph_ptr, down.graph_ptr, x.data_ptr()]
    if bias is not None:
        ptrs += [b.data_ptr() for b in bias]
    g(ptrs, out.data_ptr())
    return out


# --- device copies ---------------------------------------------------------------------------------

def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """An owned copy of `t` on `device`. Host to CUDA goes through pinned memory with an
    asynchronous copy: from pageable memory CUDA first waits for the card's queued work (a stream
    sync per copy: per slot swap, per missed expert's result)."""
    device = torch.device(device)
    if t.device.type == "cpu" and device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)  # the pinned block is held until the copy ends
    return t.to(device=device, copy=True)


# The most float32 scratch one dequantised matmul may take on a card: a larger weight (the
# default model's head is 49152 x 576, 113 MiB as float32) is expanded and multiplied a block of
# rows at a time, so the card's transient use stays within what the plan's reserve allows.
DEVICE_SCRATCH_BYTES = 16 << 20


def _dequant_linear(w: "QMatrix", x: torch.Tensor, max_scratch: int | None) -> torch.Tensor:
    """x @ W.T with W dequantised per use; at most `max_scratch` bytes of float32 W at a time."""
    N, K = w.shape
    rows = N if max_scratch is None else max(1, min(N, max_scratch // (4 * K)))
    if rows >= N:
        return F.linear(x, w.dequantize(x.dtype).to(x.device))
    per_row = w.data.view(N, -1)
    out = torch.empty(x.shape[0], N, dtype=x.dtype, device=x.device)
    for r in range(0, N, rows):
        block = per_row[r:r + rows]
        out[:, r:r + block.shape[0]] = F.linear(x, dequantize(block, w.ggml_type, (block.shape[0], K)).to(x.dtype))
    return out


# --- the matrix ------------------------------------------------------------------------------------

def row_bytes(ggml_type: T, k: int) -> int:
    block, type_size = GGML_QUANT_SIZES[T(ggml_type)]
    return k // block * type_size


class QMatrix:
    """W [N, K] in GGUF block form (`data`: uint8 [N * row_bytes]) or, on the exact backend, float32.

    `layout` is "plain" (the GGUF's bytes) or "repacked" (ggml's interleaved rows, stages/kernels/repack.py:
    `data` then holds those, as many bytes; only ggml's matmuls read them)."""

    def __init__(self, data: torch.Tensor, ggml_type: T, shape: tuple[int, int], backend: str,
                 layout: str = "plain"):
        self.ggml_type, self.shape, self.backend = T(ggml_type), (int(shape[0]), int(shape[1])), backend
        self.layout = layout
        self.rows_alone = False  # repacked, and each activation row must run alone (repack.rows_alone)
        self.keep_plain = False  # read as rows or dequantised too (embedding, MLA's k_b/v_b): never repacked
        if backend == "exact" or self.ggml_type in FLOAT_TYPES:
            self.backend = "exact"
            self.data = data if data.dtype == torch.float32 else dequantize(data, self.ggml_type, self.shape)
        else:
            if data.dtype != torch.uint8 or data.numel() != self.shape[0] * row_bytes(self.ggml_type, self.shape[1]):
                raise ValueError(f"{self.ggml_type.name} {self.shape}: got {data.numel()} bytes")
            self.data = data
            if backend == "ggml" and data.device.type != "cpu":
                self.backend = "dequant"  # ggml-python runs on the CPU only

    @classmethod
    def from_raw(cls, raw, ggml_type: T, shape: tuple[int, int], backend: str | None = None,
                 device: torch.device | str = "cpu", copy: bool = True) -> "QMatrix":
        """From stored bytes (a numpy view of the mapping). copy=False keeps the view (host experts:
        the mapping is the host copy); otherwise the bytes are copied onto `device`."""
        backend = backend or current_backend()
        b = as_uint8_tensor(raw)
        if backend == "exact" or T(ggml_type) in FLOAT_TYPES:
            w = dequantize(b, ggml_type, shape)  # F32: still a view of the mapping
            return cls(to_device(w, device) if copy or torch.device(device).type != "cpu" else w,
                       ggml_type, shape, "exact")
        if torch.device(device).type == "cpu" and copy:
            b = weight_buffer(b.numel()).copy_(b.reshape(-1))  # huge pages: a token streams it whole
        elif copy or torch.device(device).type != "cpu":
            b = to_device(b, device)
        return cls(b.reshape(-1), ggml_type, shape, backend)

    @classmethod
    def cat_rows(cls, parts: list["QMatrix"]) -> "QMatrix | None":
        """[W1; W2; ...] along N: block rows are independent, so their bytes simply concatenate
        (None when the parts differ in block type or backend)."""
        first = parts[0]
        if any(p.ggml_type != first.ggml_type or p.shape[1] != first.shape[1] or p.backend != first.backend
               or p.layout != first.layout for p in parts):
            return None
        n = sum(p.shape[0] for p in parts)
        # Repacked parts hold whole groups of 8 rows each, so their bytes concatenate too.
        out = cls(torch.cat([p.data for p in parts]), first.ggml_type, (n, first.shape[1]), first.backend,
                  first.layout)
        out.rows_alone = first.rows_alone
        return out

    def repack(self) -> bool:
        """Hold the blocks in ggml's repacked layout when the setting and ggml allow it (the ggml
        backend on the host, a type and shape ggml has kernels for); True when it now does. Same
        bytes, so memory is unchanged; the plain copy is dropped."""
        if (self.layout != "plain" or self.keep_plain or self.backend != "ggml" or self.data.device.type != "cpu"
                or not repack.wanted(self.ggml_type, *self.shape)):
            return self.layout == "repacked"
        out = weight_buffer(self.data.numel()).view(self.data.shape)  # huge pages: a token streams it whole
        repack.repack_into(out.data_ptr(), self.data.data_ptr(), self.ggml_type, *self.shape, self.nbytes)
        self.data, self.layout, self.rows_alone = out, "repacked", repack.rows_alone(self.ggml_type)
        return True

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def graph_key(self) -> tuple:
        """What a ggml graph built for this weight depends on (see graph_weight)."""
        return (int(self.ggml_type), self.shape[0], self.shape[1], self.layout, self.rows_alone)

    @property
    def graph_ptr(self) -> int:
        """The address a graph's placeholder for this weight reads (see graph_weight)."""
        return self.data.data_ptr()

    def to(self, device: torch.device | str) -> "QMatrix":
        """An owned copy on `device` (a cache slot)."""
        self._plain("copied to another device")
        return QMatrix(to_device(self.data, device), self.ggml_type, self.shape, self.backend)

    def _plain(self, what: str) -> None:
        if self.layout != "plain":
            raise MoerayError(f"a repacked {self.ggml_type.name} {self.shape} matrix cannot be {what}: only "
                              "ggml's matmuls read that layout (mark it keep_plain before repacking, or "
                              "StageOptions.repack off)")

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        self._plain("dequantised")
        if self.backend == "exact":
            return self.data.to(dtype)
        return dequantize(self.data, self.ggml_type, self.shape).to(dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of W as float32 [len(ids), K] (an embedding lookup reads only those blocks)."""
        if self.backend == "exact":
            return F.embedding(ids, self.data)
        self._plain("read as rows")
        if self.backend == "ggml":
            return _ggml_rows(self, ids)
        per_row = self.data.view(self.shape[0], -1)
        return dequantize(per_row[ids.to(per_row.device)], self.ggml_type, (ids.numel(), self.shape[1]))

    def normed(self, x: torch.Tensor, norm: torch.Tensor, eps: float) -> torch.Tensor:
        """(rms_norm(x) * norm) @ W.T, x [M, K] float32 -> [M, N] float32: a head's final norm and
        matmul, in one graph on ggml."""
        if self.backend == "ggml" and norm.dtype == torch.float32 and norm.is_contiguous():
            return _ggml_linear(self, x.contiguous(), norm, eps)
        return self(F.rms_norm(x, (x.shape[-1],), norm, eps))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] float32 -> x @ W.T [M, N] float32."""
        if self.backend == "ggml":
            return _ggml_linear(self, x.contiguous())
        if self.backend == "exact":
            return F.linear(x, self.data)
        tk = _card_kernels(self.data.device)
        if tk is not None and tk.supports(self.ggml_type):
            return tk.qlinear(self.data, int(self.ggml_type), self.shape, x)
        return _dequant_linear(self, x, DEVICE_SCRATCH_BYTES if self.data.device.type == "cuda" else None)

    def __repr__(self) -> str:
        layout = ", repacked" if self.layout == "repacked" else ""
        return f"QMatrix({self.ggml_type.name}, {self.shape}, {self.backend}{layout}, {self.nbytes} B)"


@dataclass(frozen=True)
class GLU:
    """The gated activation between an FFN's up and down projections.

    "silu" (default): silu(g) * u. "swiglu_oai" (gpt-oss): g = min(g, limit), u = clamp(u, -limit,
    limit), out = (u + 1) * g * sigmoid(alpha * g)."""
    kind: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0

    @classmethod
    def of(cls, cfg) -> "GLU":
        """The experts' activation of a ModelConfig (`expert_act`, `swiglu_alpha`, `swiglu_limit`)."""
        kind = getattr(cfg, "expert_act", "silu")
        if kind == "silu":
            return SILU
        if kind != "swiglu_oai":
            raise MoerayError(f"expert activation {kind!r} is unknown; moeray has silu and swiglu_oai")
        return cls(kind, float(cfg.swiglu_alpha), float(cfg.swiglu_limit))

    def __call__(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        if self.kind == "silu":
            return F.silu(g) * u
        g = g.clamp(max=self.limit)
        u = u.clamp(-self.limit, self.limit)
        return (u + 1) * (g * torch.sigmoid(g * self.alpha))  # transformers' GptOssExperts order


SILU = GLU()


class ExpertBias(NamedTuple):
    """Per-expert biases of gate, up ([F]) and down ([H]), float32 (gpt-oss)."""
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor


def swiglu(x: torch.Tensor, gate: QMatrix, up: QMatrix, down: QMatrix, act: GLU = SILU,
           bias: ExpertBias | None = None) -> torch.Tensor:
    """down(act(gate x + b_g, up x + b_u)) + b_d for x [M, K] (no biases: b = 0)."""
    if gate.backend == up.backend == down.backend == "ggml":
        return _ggml_swiglu(gate, up, down, x.contiguous(), act, bias)
    g, u = gate(x), up(x)
    if bias is not None:
        g, u = g + bias.gate, u + bias.up
    y = down(act(g, u))
    return y if bias is None else y + bias.down
