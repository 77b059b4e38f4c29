"""Gated DeltaNet: the linear-attention token mixer of Qwen3-Next and Qwen3.5/3.6-MoE.

Per sequence a layer keeps a fixed-size state instead of KV rows:
- the conv state: the last K-1 inputs of the short causal depthwise conv1d, [C, K-1] (time last,
  as ggml_ssm_conv reads it; C = 2·key_dim + value_dim channels of q, k, v);
- the recurrent state S: [H_v, D_k, D_v] per sequence (float32).

The gated delta rule, per value head h and token t (q, k L2-normalised, q scaled by D_k^-1/2):
    S = exp(g_t) · S;   S += k_t ⊗ (β_t · (v_t − Sᵀk_t));   o_t = Sᵀ q_t
Decode runs that step once per token for the whole batch; prefill runs the chunked form (chunks
of 64 tokens, as transformers' and fla's references do): within a chunk the recurrence is solved
as one unit-lower-triangular system (the UT transform), so a Python loop runs once per chunk,
never once per token. Both take a state in and give one out, so a prompt prefilled in pieces
resumes exactly where the last piece stopped.

Heads: q and k have H_k heads, v has H_v (a multiple of H_k). Which k head a v head reads is the
file's V-head order: "grouped" (transformers, and llama.cpp's qwen3next: v head h reads k head
h // (H_v/H_k)) or "tiled" (llama.cpp's converter reorders qwen35moe's V heads so that v head h
reads k head h % H_k: ggml broadcasts that way without a copy).

On the ggml backend the layer runs the rule as ggml_gated_delta_net (llama.cpp's CPU op: the same
step in C, one pass over the tokens): measured 2-3x faster than torch's chunked rule for prefill
and 1.6x at decode batch 16 (bench/deltanet.py, docs/hybrid.md).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from moeray.stages.arch.deltanet_shape import DeltaNetShape

CHUNK = 64  # tokens per chunk of the chunked rule (the references' default)


# --- the short causal conv ------------------------------------------------------------------

def causal_conv(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv1d + SiLU over one sequence's new tokens.

    x [T, C], conv_state [C, K-1] (the K-1 inputs before x; zeros for a fresh sequence),
    weight [C, K] (ssm_conv1d as the GGUF stores it) -> (silu(conv) [T, C], new conv_state [C, K-1]).
    """
    T, C = x.shape
    xx = torch.cat((conv_state, x.t()), dim=1)  # [C, K-1+T]
    y = F.conv1d(xx.unsqueeze(0), weight.unsqueeze(1), groups=C).squeeze(0)  # [C, T]
    return F.silu(y.t()), xx[:, T:].contiguous()


def causal_conv_step(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence for a batch: x [B, C], conv_state [B, C, K-1] -> ([B, C], [B, C, K-1])."""
    xx = torch.cat((conv_state, x.unsqueeze(-1)), dim=-1)  # [B, C, K]
    return F.silu((xx * weight).sum(-1)), xx[..., 1:].contiguous()


# --- the gated delta rule -------------------------------------------------------------------

def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(Σx² + eps) over the last dim (fla's and transformers' form)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of B sequences. q, k [B, H, D_k] (normalised and scaled, already expanded to the
    v heads), v [B, H, D_v], g, beta [B, H], state [B, H, D_k, D_v] -> (o [B, H, D_v], new state)."""
    s = state * g.exp()[..., None, None]
    kv = torch.einsum("bhkv,bhk->bhv", s, k)
    delta = (v - kv) * beta.unsqueeze(-1)
    s = s + k.unsqueeze(-1) * delta.unsqueeze(-2)
    return torch.einsum("bhkv,bhk->bhv", s, q), s


def gated_delta_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        state: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """T tokens of one sequence. q, k [T, H, D_k] (normalised, scaled, expanded), v [T, H, D_v],
    g, beta [T, H], state [H, D_k, D_v] -> (o [T, H, D_v], state after the last token)."""
    T = q.shape[0]
    pad = (-T) % chunk
    # head-major, padded to whole chunks: a padded token has k = v = beta = g = 0, so it neither
    # writes the state nor decays it, and the final state is the last real token's.
    q, k, v = (F.pad(x.transpose(0, 1), (0, 0, 0, pad)) for x in (q, k, v))  # [H, T', D]
    g, beta = (F.pad(x.t(), (0, pad)) for x in (g, beta))  # [H, T']
    H, Tp, Dk = k.shape
    n = Tp // chunk
    q, k, v = (x.reshape(H, n, chunk, -1) for x in (q, k, v))
    g, beta = g.reshape(H, n, chunk), beta.reshape(H, n, chunk)
    k_beta, v_beta = k * beta.unsqueeze(-1), v * beta.unsqueeze(-1)

    gc = g.cumsum(-1)  # log of the decay from the chunk's start to each position
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (gc.unsqueeze(-1) - gc.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()  # [H, n, c, c]
    # (I + strictly-lower(k_beta kᵀ ∘ decay)) [u | w] = [v_beta | k_beta ∘ exp(gc)]: the UT transform
    A = (k_beta @ k.transpose(-1, -2)) * decay
    rhs = torch.cat((v_beta, k_beta * gc.exp().unsqueeze(-1)), dim=-1)
    uw = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)
    u, w = uw[..., :v.shape[-1]], uw[..., v.shape[-1]:]
    attn = (q @ k.transpose(-1, -2)) * decay  # causal within the chunk, diagonal included
    q_decayed = q * gc.exp().unsqueeze(-1)
    k_to_end = k * (gc[..., -1:] - gc).exp().unsqueeze(-1)
    chunk_decay = gc[..., -1].exp()[..., None, None]  # [H, n, 1, 1]

    s = state.to(torch.float32)
    out = torch.empty_like(u)
    for i in range(n):  # one pass per chunk
        v_new = u[:, i] - w[:, i] @ s
        out[:, i] = q_decayed[:, i] @ s + attn[:, i] @ v_new
        s = s * chunk_decay[:, i] + k_to_end[:, i].transpose(-1, -2) @ v_new
    return out.reshape(H, Tp, -1)[:, :T].transpose(0, 1), s


def gated_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The norm-gated output: RMSNorm(o)·weight · silu(z), per head over D_v (o, z [..., D_v])."""
    return F.rms_norm(o, (o.shape[-1],), weight, eps) * F.silu(z)


# --- ggml's op (the ggml backend) ---------------------------------------------------------------

def ggml_gated_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """B sequences of T tokens each through ggml_gated_delta_net (llama.cpp's CPU op).

    q, k [B, T, H_q, D_k] L2-normalised but NOT scaled (the op scales by D^-1/2 itself), with H_q
    dividing H_v: v head h reads q/k head h % H_q (ggml's tiled broadcast); v [B, T, H_v, D_v];
    g, beta [B, T, H_v]; state [B, H_v, D_k, D_v] -> (o [B, T, H_v, D_v], state [B, H_v, D_k, D_v]).
    """
    from moeray.stages.kernels.graphs import _G, _graph

    B, T, Hq, Dk = q.shape
    Hv, Dv = v.shape[2], v.shape[3]

    def build(ctx):
        f32 = _G.GGML_TYPE_F32
        tq = _G.ggml_new_tensor_4d(ctx, f32, Dk, Hq, T, B)
        tk = _G.ggml_new_tensor_4d(ctx, f32, Dk, Hq, T, B)
        tv = _G.ggml_new_tensor_4d(ctx, f32, Dv, Hv, T, B)
        tg = _G.ggml_new_tensor_4d(ctx, f32, 1, Hv, T, B)
        tb = _G.ggml_new_tensor_4d(ctx, f32, 1, Hv, T, B)
        ts = _G.ggml_new_tensor_4d(ctx, f32, Dk, Dv, Hv, B)
        return [tq, tk, tv, tg, tb, ts], _G.ggml_gated_delta_net(ctx, tq, tk, tv, tg, tb, ts, 1), []

    graph = _graph(("gated_delta_net", B, T, Hq, Hv, Dk, Dv), build)
    n_out = B * T * Hv * Dv
    out = torch.empty(n_out + B * Hv * Dk * Dv)
    # ggml keeps S transposed ([D_v, D_k] rows per head): S[i][j] at s[j * D_k + i]
    s_in = state.transpose(-1, -2).contiguous()
    args = [x.contiguous() for x in (q, k, v, g, beta)] + [s_in]
    graph([a.data_ptr() for a in args], out.data_ptr())
    return out[:n_out].view(B, T, Hv, Dv), out[n_out:].view(B, Hv, Dv, Dk).transpose(-1, -2)


# --- the state a stage keeps, and the layer ---------------------------------------------------

class DeltaState:
    """Per-sequence state slots of a stage's DeltaNet layers, float32, allocated once: per layer
    conv [slots, C, K-1] and recurrent [slots, H_v, D_v, D_k], the recurrent state S stored
    transposed (S[i][j], i < D_k, j < D_v, at [h, j, i]): ggml_gated_delta_net's own layout, so the
    stage graph reads and writes a slot's rows as they lie (stages/runtime/trunk_graph.py); the torch
    rule transposes.

    Which slot holds what is the engine's decision, carried in each step as block tables are:
    a running sequence's slot is its engine sequence slot (cluster/kv_blocks.py); slots past the
    sequences' hold checkpoints (cluster/state_checkpoints.py). A step that starts a sequence at
    position 0 begins from zeros (`clear`, before the step), so a freed slot needs no clearing and
    a re-prefill after preemption rebuilds the state exactly.

    `copy(pairs)` is the one primitive for everything else: a checkpoint taken (a sequence's slot
    into a checkpoint slot, after the step that reached a block boundary), a checkpoint restored
    (into a sequence's slot, before its first step), and speculative decoding's snapshot before a
    verify step and restore after a rejection: each a copy of one slot's rows, every layer.

    `host_slots` more slots, numbered after the device's (n_slots .. n_slots + host_slots - 1), lie
    in host memory (pinned beside a card): checkpoints the device has no room for, as llama-server
    keeps its prompt cache in RAM. Only `copy` touches them (a step reads and writes sequence
    slots, which are the device's), so a checkpoint there costs one slot's copy across the bus
    when it is taken or restored (Qwen3.6: 63 MiB, a few ms over PCIe) and no device bytes."""

    def __init__(self, layers: list[int], n_slots: int, shape: DeltaNetShape, device: str | torch.device = "cpu",
                 host_slots: int = 0):
        if n_slots < 1:
            raise ValueError(f"a DeltaNet state pool needs at least one slot, got {n_slots}")
        if host_slots < 0:
            raise ValueError(f"host_slots must be >= 0, got {host_slots}")
        self.layers, self.n_slots, self.host_slots, self.shape = list(layers), n_slots, host_slots, shape
        self._index = {layer: i for i, layer in enumerate(self.layers)}
        L = len(self.layers)
        H, Dk, Dv = shape.rec_state_shape
        self.conv = torch.zeros((L, n_slots) + shape.conv_state_shape, device=device)
        self.rec = torch.zeros((L, n_slots, H, Dv, Dk), device=device)
        # Uninitialised: a checkpoint slot is written before it is ever read (the ledger restores
        # only what it saved), so the host's pages are taken as checkpoints fill them, not at load.
        pin = torch.device(device).type == "cuda"
        self.host_conv = torch.empty((L, host_slots) + shape.conv_state_shape, pin_memory=pin)
        self.host_rec = torch.empty((L, host_slots, H, Dv, Dk), pin_memory=pin)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv [slots, C, K-1], recurrent [slots, H_v, D_v, D_k]: S transposed) of one layer."""
        i = self._index[layer]
        return self.conv[i], self.rec[i]

    def check_slots(self, slots: list[int]) -> None:
        """A step's state slots: each once, and on the device (host slots are copied, never stepped)."""
        if len(set(slots)) != len(slots):
            raise ValueError(f"a step may hold each state slot once, got {slots}")
        self._check(slots, self.n_slots)

    def _check(self, slots, limit: int | None = None) -> None:
        limit = self.n_slots + self.host_slots if limit is None else limit
        if slots and not 0 <= min(slots) <= max(slots) < limit:
            raise ValueError(f"state slots {list(slots)} name a slot outside the pool of {limit}")

    def _slot(self, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv, recurrent) of slot s over every layer: a view of the device's or the host's tensors."""
        if s < self.n_slots:
            return self.conv[:, s], self.rec[:, s]
        return self.host_conv[:, s - self.n_slots], self.host_rec[:, s - self.n_slots]

    def clear(self, slots: list[int]) -> None:
        """Zero these slots in every layer: sequences that start at position 0."""
        self._check(slots)
        for s in slots:
            for t in self._slot(s):
                t.zero_()

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """For each (src, dst), in order: slot src's state, every layer, into slot dst (either on
        the device or the host)."""
        self._check([x for p in pairs for x in p])
        for src, dst in pairs:
            if src != dst:
                for to, frm in zip(self._slot(dst), self._slot(src)):
                    to.copy_(frm)

    def slot_bytes(self) -> int:
        """Bytes of one slot over every layer: what one checkpoint (or one copy) moves."""
        return (self.conv[:, 0].numel() + self.rec[:, 0].numel()) * 4

    def nbytes(self) -> int:
        """The device's bytes (the host slots aside)."""
        return self.conv.numel() * 4 + self.rec.numel() * 4


class GatedDeltaNet(torch.nn.Module):
    """One DeltaNet token mixer, from weights in llama.cpp's layout (the arch module loads them):
    `w_in` = [qkv (conv_dim rows: q, k, v); z (value_dim); beta (H_v); alpha (H_v)] as one fused
    matrix where the block types allow (one matmul: colibri's "dnproj" trunk piece), `conv_w`
    [C, K], `dt_bias` [H_v], `a` = -exp(A_log) [H_v] (the converter stores it negated and
    exponentiated), `norm_w` [D_v], `w_out` [hidden, value_dim]."""

    def __init__(self, shape: DeltaNetShape, layer: int, w_in: list, conv_w: torch.Tensor, dt_bias: torch.Tensor,
                 a: torch.Tensor, norm_w: torch.Tensor, w_out, eps: float):
        super().__init__()
        self.shape, self.layer, self.eps = shape, layer, eps
        self.w_in, self.w_out = w_in, w_out
        for name, t in (("conv_w", conv_w), ("dt_bias", dt_bias), ("a", a), ("norm_w", norm_w)):
            self.register_buffer(name, t, persistent=False)
        s = shape
        self.splits = (s.conv_dim, s.value_dim, s.n_v_heads, s.n_v_heads)
        self.use_ggml = getattr(w_out, "backend", None) == "ggml"  # measured 5-10x faster than torch on CPU

    def _project(self, x: torch.Tensor):
        proj = self.w_in[0](x) if len(self.w_in) == 1 else torch.cat([w(x) for w in self.w_in], dim=1)
        qkv, z, b, a = torch.split(proj, self.splits, dim=1)
        g = self.a * F.softplus(a + self.dt_bias)  # log decay, <= 0
        return qkv, z, g, torch.sigmoid(b)

    def _heads(self, mixed: torch.Tensor):
        """conv output [..., C] -> q, k [..., H_k, D_k] (L2-normalised), v [..., H_v, D_v]."""
        s = self.shape
        q, k, v = torch.split(mixed, (s.key_dim, s.key_dim, s.value_dim), dim=-1)
        lead = mixed.shape[:-1]
        q = l2norm(q.reshape(*lead, s.n_k_heads, s.head_k_dim))
        k = l2norm(k.reshape(*lead, s.n_k_heads, s.head_k_dim))
        return q, k, v.reshape(*lead, s.n_v_heads, s.head_v_dim)

    def _rule(self, q, k, v, g, beta, rec):
        """[B, T, ...] batches through the gated delta rule (ggml's op or torch's)."""
        s = self.shape
        if self.use_ggml:
            if s.v_order == "grouped":
                q, k = s.expand_qk(q), s.expand_qk(k)
            return ggml_gated_delta(q, k, v, g, beta, rec)
        q, k = s.expand_qk(q) * s.head_k_dim ** -0.5, s.expand_qk(k)
        if q.shape[1] == 1:
            o, r = gated_delta_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], rec)
            return o.unsqueeze(1), r
        outs, states = zip(*(gated_delta_chunked(q[i], k[i], v[i], g[i], beta[i], rec[i]) for i in range(q.shape[0])))
        return torch.stack(outs), torch.stack(states)

    def forward(self, x: torch.Tensor, meta, kv, rope=None, cos_sin=None) -> torch.Tensor:
        """x [N, hidden]: the packed tokens of the step's sequences (`meta`, stages/blocks/attention.py);
        sequence i continues the state in slot meta.state_slots[i] of `kv.state` (from zeros when
        it starts at position 0) and leaves its new state there. RoPE plays no part here."""
        n_new, starts, slots, state = meta.n_new, meta.starts, meta.state_slots, kv.state
        s = self.shape
        qkv, z, g, beta = self._project(x)
        conv_all, rec_all = state.layer(self.layer)
        idx = torch.tensor(slots, device=x.device)
        fresh = torch.tensor([st == 0 for st in starts], device=x.device)
        conv0 = torch.where(fresh[:, None, None], 0.0, conv_all.index_select(0, idx))
        rec0 = torch.where(fresh[:, None, None, None], 0.0, rec_all.index_select(0, idx).transpose(-1, -2))
        if max(n_new) == 1:  # decode: the whole batch in one step
            mixed, conv1 = causal_conv_step(qkv, conv0, self.conv_w)
            q, k, v = self._heads(mixed.unsqueeze(1))
            o, rec1 = self._rule(q, k, v, g.unsqueeze(1), beta.unsqueeze(1), rec0)
            o = o.reshape(-1, s.n_v_heads, s.head_v_dim)
        else:  # prefill chunks (and any decode tokens beside them): one sequence at a time
            outs, convs, recs, lo = [], [], [], 0
            for i, n in enumerate(n_new):
                hi = lo + n
                mixed, c = causal_conv(qkv[lo:hi], conv0[i], self.conv_w)
                q, k, v = self._heads(mixed.unsqueeze(0))
                o, r = self._rule(q, k, v, g[lo:hi].unsqueeze(0), beta[lo:hi].unsqueeze(0), rec0[i:i + 1])
                outs.append(o[0]), convs.append(c), recs.append(r[0])
                lo = hi
            o, conv1, rec1 = torch.cat(outs), torch.stack(convs), torch.stack(recs)
        conv_all.index_copy_(0, idx, conv1)
        rec_all.index_copy_(0, idx, rec1.transpose(-1, -2).to(rec_all.dtype))
        o = gated_norm(o, z.view(-1, s.n_v_heads, s.head_v_dim), self.norm_w, self.eps)
        return self.w_out(o.reshape(-1, s.value_dim))
