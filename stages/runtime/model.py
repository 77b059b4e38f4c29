"""StageModel: layers [first, end) of a GGUF model, the unit a pipeline stage runs.

The trunk (attention, norms, router, shared expert, dense FFN, embedding, head) is copied onto the
stage's device in its stored block form (`QMatrix`); only vectors and the router are float32.
Routed experts stay in the file mapping; each MoE block computes them through the `Experts` the
model is built with (the host copy, or an expert cache in front of it). Only the tensors of the
requested layers are read.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace

import torch

from moeray.errors import MoerayError
from moeray.stages.arch import arch_of
from moeray.stages.blocks.deltanet import DeltaState, GatedDeltaNet
from moeray.stages.gguf.reader import GGUFFile, tensor_role, trunk_bytes
from moeray.planner.kv import KVTypes
from moeray.stages.blocks.kv_cache import KVCache, KVPool, stage_kv_types
from moeray.stages.blocks.attention import Attention, BatchMeta, GatedAttention, make_batch_meta, rms_norm, slot_batch_meta
from moeray.stages.blocks.mla import MLAttention
from moeray.stages.blocks.moe import DenseFFN, Experts, HostExperts, MoEBlock
from moeray.stages.kernels import repack, settings
from moeray.stages.kernels.host_memory import process_rss_bytes
from moeray.stages.kernels.backend import announce, current_backend
from moeray.stages.kernels.qmatmul import QMatrix
from moeray.stages.blocks.rope import RoPE
from moeray.stages.runtime.trunk_graph import Dense, LayerSpec, Routed, TrunkGraphs, supports
from moeray.stages.gguf.quant import dequantize

log = logging.getLogger("moeray.kernels")

# The most tokens a step may have to run the stage's layers as one graph: decode steps; prefill
# chunks keep one graph per layer (a stage graph per prompt length would be built for one use).
STAGE_TOKENS = 32


@dataclass(frozen=True)
class RunPath:
    """How a stage runs its layers, chosen once at load (its options, backend, device and layer
    kinds) and logged; a step then only asks whether its shape has the graph form.

    graphs  each layer's trunk (attention, norms, router) as one ggml graph; else torch's ops
            between the matmuls, as for every step whose shape has no graph form (sequences adding
            different token counts: mixed prefill and decode)
    fused   with graphs: an MoE layer's routing, routed experts (where one stack serves every
            pick), shared expert and a dense layer's FFN inside that graph
    stage   with fused: a step of at most STAGE_TOKENS tokens whose layers all run whole inside
            runs the stage's layers as ONE graph, as llama.cpp runs a token
    why     why `graphs` is off ("" when on)"""
    graphs: bool
    fused: bool = False
    stage: bool = False
    why: str = ""

    def line(self, first: int, end: int) -> str:
        where = f"moeray: layers {first}-{end - 1} run"
        if not self.graphs:
            return f"{where} as torch ops between the matmuls ({self.why})"
        ffn = ("the routing, experts and FFN inside each layer's graph" if self.fused else
               "each layer's trunk as a ggml graph, its routing and experts after it (fused_moe off)")
        stage = (f"; a step of <= {STAGE_TOKENS} tokens whose layers all run whole inside as one stage graph"
                 if self.stage else "")
        return f"{where} as ggml graphs: {ffn}{stage}; steps without a graph form as torch ops"


class TransformerLayer(torch.nn.Module):
    def __init__(self, attn_norm: torch.Tensor, attn: Attention, ffn_norm: torch.Tensor,
                 ffn: DenseFFN | MoEBlock):
        super().__init__()
        self.register_buffer("attn_norm", attn_norm, persistent=False)
        self.register_buffer("ffn_norm", ffn_norm, persistent=False)
        self.attn, self.ffn = attn, ffn


class StageModel(torch.nn.Module):
    """Layers [first, end) of a GGUF model; embedding if first == 0; final norm + lm_head if end == n_layers."""

    def __init__(self, gguf: GGUFFile, first: int, end: int, device: str | torch.device = "cpu",
                 experts: Experts | None = None, backend: str | None = None):
        super().__init__()
        cfg = gguf.config
        if not 0 <= first < end <= cfg.n_layers:
            raise MoerayError(f"{gguf.path}: layer range [{first}, {end}) is not within the model's "
                              f"{cfg.n_layers} layers")
        self.gguf, self.config, self.first, self.end = gguf, cfg, first, end
        self.device = torch.device(device)
        self.has_embedding, self.has_head = first == 0, end == cfg.n_layers
        self.rope = RoPE.from_config(cfg, device=self.device)
        self.backend = backend or current_backend()
        announce(self.backend, self.device)
        self.experts: Experts = experts if experts is not None else HostExperts(gguf, self.backend)
        host = getattr(self.experts, "host", self.experts)
        if isinstance(host, HostExperts):
            host.prepare(first, end)  # host_experts "repacked": the copy is made at load

        self.tok_embd = self._matrix("token_embd.weight") if self.has_embedding else None
        self.layers = torch.nn.ModuleList(self._load_layer(i) for i in range(first, end))
        self.path = self._run_path(settings.current())
        log.info(self.path.line(first, end))
        self.trunk = (TrunkGraphs(cfg, {getattr(l.attn, "window", 0) for l in self.layers} - {0})
                      if self.path.graphs else None)
        self._specs = None  # each layer's trunk_graph.LayerSpec, made at the first graph step
        self._step_specs_for = None  # (each layer's OneStack, the specs made for them)
        self._count_plan = None  # (the specs, has a tail, how their step is counted): _count_stage
        self.register_buffer("out_norm", None, persistent=False)
        self.w_out = None
        if self.has_head:
            self.out_norm = self._vector("output_norm.weight")
            if cfg.tie_embeddings:
                self.w_out = self.tok_embd if self.tok_embd is not None else self._matrix("token_embd.weight")
            else:
                self.w_out = self._matrix("output.weight")
        self._repack_trunk()

    # --- loading ---------------------------------------------------------------------------

    def _run_path(self, opts: settings.StageOptions) -> RunPath:
        """The run path of this stage's layers (RunPath), from its options and what its layers allow."""
        if self.backend != "ggml":
            why = f"the {self.backend} backend"
        elif self.device.type != "cpu":
            why = f"ggml runs on the host, the stage on {self.device}"
        elif not opts.trunk_graph:
            why = "trunk_graph off"
        else:
            kinds = sorted({type(l.attn).__name__ for l in self.layers if not supports(l.attn, self.config)})
            why = f"{', '.join(kinds)} layers have no graph form here" if kinds else ""
        if why:
            return RunPath(False, why=why)
        return RunPath(True, opts.fused_moe, opts.fused_moe and opts.stage_graph)

    # Switches of the run path (tests and bench/graph_families.py compare the paths on one model)
    @property
    def fuse_moe(self) -> bool:
        return self.path.fused

    @fuse_moe.setter
    def fuse_moe(self, on: bool) -> None:
        self.path = replace(self.path, fused=bool(on))

    @property
    def stage_graph(self) -> bool:
        return self.path.stage

    @stage_graph.setter
    def stage_graph(self, on: bool) -> None:
        self.path = replace(self.path, stage=bool(on))

    def _repack_trunk(self) -> None:
        """Every trunk matrix in ggml's repacked layout where the setting and ggml allow it
        (stages/kernels/repack.py), once the load has cut and concatenated the plain bytes. The embedding
        stays plain: it is read as rows. A tied head is that same matrix, so it stays plain too
        (llama.cpp loads a second, repacked copy; moeray does not double a head's memory)."""
        if self.tok_embd is not None:
            self.tok_embd.keep_plain = True
        mats = self.matrices()
        self.repacked = sum(w.repack() for w in mats)
        if self.backend == "ggml":
            log.info(f"moeray: trunk layout: {self.repacked} of {len(mats)} matrices repacked "
                     f"(repack {repack.mode()})")

    def _vector(self, name: str) -> torch.Tensor:
        """Norm weights, biases, routers: small, float32, an owned copy (never the read-only mapping)."""
        info = self.gguf.info(name)
        return dequantize(self.gguf.raw(name), info.ggml_type, info.shape).to(self.device, copy=True).contiguous()

    def _matrix(self, name: str) -> QMatrix:
        """A weight matrix copied onto the device in its stored block form (a 3-D tensor, e.g.
        MLA's per-head attn_k_b, as its rows stacked: [heads * rows, row])."""
        info = self.gguf.info(name)
        rows = 1
        for d in info.shape[:-1]:
            rows *= d
        return QMatrix.from_raw(self.gguf.raw(name), info.ggml_type, (rows, info.shape[-1]), self.backend,
                                device=self.device)

    def _load_layer(self, i: int) -> TransformerLayer:
        """Layer i from the shared blocks its architecture names: an attention kind and an FFN kind."""
        arch, p, v = arch_of(self.config), f"blk.{i}.", self._vector
        attn = _ATTENTION[arch.attention_kind(self.config, i)](self, i)
        ffn = _FFN[arch.ffn_kind(self.config, i)](self, i)
        return TransformerLayer(v(p + "attn_norm.weight"), attn, v(p + f"{arch.ffn_norm_name}.weight"), ffn)

    def _gqa(self, i: int) -> Attention:
        cfg, p, m, v = self.config, f"blk.{i}.", self._matrix, self._vector
        qkv = [m(p + "attn_q.weight"), m(p + "attn_k.weight"), m(p + "attn_v.weight")]
        fused = QMatrix.cat_rows(qkv)  # one matmul when q, k and v share a block type
        b_qkv = None
        if cfg.qkv_bias:
            b_qkv = torch.cat((v(p + "attn_q.bias"), v(p + "attn_k.bias"), v(p + "attn_v.bias")))
        q_norm = v(p + "attn_q_norm.weight") if cfg.qk_norm else None
        k_norm = v(p + "attn_k_norm.weight") if cfg.qk_norm else None
        return Attention(cfg, i, [fused] if fused is not None else qkv, b_qkv, m(p + "attn_output.weight"),
                         q_norm, k_norm, b_o=v(p + "attn_output.bias") if cfg.attn_out_bias else None,
                         sinks=v(p + "attn_sinks.weight") if cfg.attn_sinks else None,
                         window=arch_of(cfg).attention_window(cfg, i))

    def _gated_gqa(self, i: int) -> GatedAttention:
        """Full attention with a per-head output gate in attn_q (qwen3next): q/k norms, no biases."""
        cfg, p, m, v = self.config, f"blk.{i}.", self._matrix, self._vector
        qkv = [m(p + "attn_q.weight"), m(p + "attn_k.weight"), m(p + "attn_v.weight")]
        fused = QMatrix.cat_rows(qkv)
        return GatedAttention(cfg, i, [fused] if fused is not None else qkv, None, m(p + "attn_output.weight"),
                              v(p + "attn_q_norm.weight"), v(p + "attn_k_norm.weight"))

    def _deltanet(self, i: int) -> GatedDeltaNet:
        """A Gated DeltaNet layer: [qkv; z; beta; alpha] fused into one matrix where the block types
        allow (beta and alpha are the rows of ssm_ba or ssm_beta/ssm_alpha its arch names)."""
        cfg, p, m, v = self.config, f"blk.{i}.", self._matrix, self._vector
        parts = [m(p + "attn_qkv.weight"), m(p + "attn_gate.weight")]
        for name, rows in arch_of(cfg).beta_alpha_rows(cfg, i):
            parts.append(self._matrix_rows(name, rows))
        fused = QMatrix.cat_rows(parts)
        return GatedDeltaNet(cfg.deltanet, i, [fused] if fused is not None else parts, v(p + "ssm_conv1d.weight"),
                             v(p + "ssm_dt.bias"), v(p + "ssm_a"), v(p + "ssm_norm.weight"),
                             m(p + "ssm_out.weight"), cfg.rms_eps)

    def _matrix_rows(self, name: str, rows) -> QMatrix:
        """Rows `rows` (None: all) of a stored matrix, still in its block form (block rows are
        independent, so a row permutation is a permutation of their bytes)."""
        w = self._matrix(name)
        if rows is None:
            return w
        idx = torch.as_tensor(rows, dtype=torch.long, device=w.data.device)
        per_row = w.data.view(w.shape[0], -1)
        return QMatrix(per_row[idx].reshape(-1) if w.backend != "exact" else w.data[idx], w.ggml_type,
                       (len(idx), w.shape[1]), w.backend)

    def _mla(self, i: int) -> MLAttention:
        cfg, p, m, v = self.config, f"blk.{i}.", self._matrix, self._vector
        lora = cfg.q_lora_rank > 0
        k_b, v_b = m(p + "attn_k_b.weight"), m(p + "attn_v_b.weight")
        k_b.keep_plain = v_b.keep_plain = True  # dequantised per use (per-head batched products)
        return MLAttention(cfg, i, None if lora else m(p + "attn_q.weight"),
                           m(p + "attn_q_a.weight") if lora else None, v(p + "attn_q_a_norm.weight") if lora else None,
                           m(p + "attn_q_b.weight") if lora else None, m(p + "attn_kv_a_mqa.weight"),
                           v(p + "attn_kv_a_norm.weight"), k_b, v_b, m(p + "attn_output.weight"))

    def _dense_ffn(self, i: int) -> DenseFFN:
        p, m = f"blk.{i}.", self._matrix
        return DenseFFN(m(p + "ffn_gate.weight"), m(p + "ffn_up.weight"), m(p + "ffn_down.weight"))

    def _moe(self, i: int) -> MoEBlock:
        cfg, p, m, v = self.config, f"blk.{i}.", self._matrix, self._vector
        shared = gate = None
        if cfg.shared_expert_ffn_dim:
            shared = DenseFFN(m(p + "ffn_gate_shexp.weight"), m(p + "ffn_up_shexp.weight"),
                              m(p + "ffn_down_shexp.weight"))
            if cfg.shared_expert_gate:
                gate = v(p + "ffn_gate_inp_shexp.weight").reshape(-1)
        # the routing function's bias: DeepSeek's / GLM's score correction, or gpt-oss's logit bias
        bias = (v(p + "exp_probs_b.bias") if cfg.score_bias else
                v(p + "ffn_gate_inp.bias") if cfg.router_bias else None)
        return MoEBlock(cfg, i, v(p + "ffn_gate_inp.weight"), self.experts, shared, gate, router_bias=bias)

    @classmethod
    def from_gguf(cls, path_or_gguf: str | os.PathLike | GGUFFile, layers: tuple[int, int] | None = None,
                  device: str | torch.device = "cpu", experts: Experts | None = None,
                  backend: str | None = None) -> "StageModel":
        gguf = path_or_gguf if isinstance(path_or_gguf, GGUFFile) else GGUFFile(path_or_gguf)
        first, end = layers if layers is not None else (0, gguf.config.n_layers)
        return cls(gguf, first, end, device, experts, backend)

    def matrices(self) -> list[QMatrix]:
        """Every trunk weight matrix this stage holds, each once (a tied head is the embedding)."""
        found: dict[int, QMatrix] = {}
        for w in (self.tok_embd, self.w_out):
            if w is not None:
                found[id(w)] = w
        for module in self.modules():
            for value in vars(module).values():
                items = value if isinstance(value, list) else [value]
                for w in items:
                    if isinstance(w, QMatrix):
                        found[id(w)] = w
        return list(found.values())

    def trunk_bytes(self) -> int:
        """Bytes the trunk really holds on the device: its matrices plus float vectors."""
        vectors = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in self.buffers()
                   if t is not None}
        return sum(w.nbytes for w in self.matrices()) + sum(vectors.values())

    # --- running ---------------------------------------------------------------------------

    def new_kv_cache(self, max_seqs: int, max_len: int, types: KVTypes | None = None) -> KVCache:
        """Fixed slots of max_len tokens: the one-shot path (step, logits_all); a hybrid model's
        DeltaNet state has a slot for each KV slot. `types`: the cache types (None: kv_types())."""
        heads, k_dim, v_dim = self._kv_shape()
        return KVCache(self.first, self.end - self.first, max_seqs, heads, max_len, k_dim, device=self.device,
                       kv_layers=self.kv_layers(), state=self._state(max_seqs), v_dim=v_dim,
                       types=self.kv_types(types))

    def new_kv_pool(self, n_blocks: int, state_slots: int = 1, host_state_slots: int = 0,
                    types: KVTypes | None = None, host_blocks: int = 0) -> KVPool:
        """A pool of `n_blocks` blocks, addressed by the engine's block tables (the serving path),
        and `state_slots` DeltaNet states (one per sequence slot of the engine, then the
        checkpoints on the device) and `host_state_slots` more in host memory (checkpoints) when
        the stage holds recurrent layers; `types`: its cache types (None: kv_types());
        `host_blocks`: blocks of the host tier (stages/blocks/host_kv.py)."""
        heads, k_dim, v_dim = self._kv_shape()
        return KVPool(self.first, self.end - self.first, n_blocks, heads, k_dim, device=self.device,
                      kv_layers=self.kv_layers(), state=self._state(state_slots, host_state_slots), v_dim=v_dim,
                      types=self.kv_types(types), host_blocks=host_blocks)

    def kv_types(self, asked: KVTypes | None = None) -> KVTypes:
        """The cache types this stage's pool holds: `asked` (the plan's), else this process's
        options (StageOptions.cache_type_k / _v, "auto" the default), checked against its layers."""
        return stage_kv_types(self.config, range(self.first, self.end), self.device, asked)

    def _kv_shape(self) -> tuple[int, int, int]:
        """(heads, key width, value width) of this stage's KV pool: its architecture's layout
        (MLA: one latent row per token, no separate value)."""
        c, layers = self.config, self.kv_layers()
        return arch_of(c).kv_layout(c, layers[0]) if layers else (c.n_kv_heads, c.head_dim, c.head_dim)

    def kv_layers(self) -> list[int]:
        """This stage's layers that keep KV (all but a hybrid model's recurrent ones)."""
        arch = arch_of(self.config)
        return [l for l in range(self.first, self.end) if arch.kv_values(self.config, l) > 0]

    def recurrent_layers(self) -> list[int]:
        arch = arch_of(self.config)
        return [l for l in range(self.first, self.end) if arch.state_bytes(self.config, l) > 0]

    def _state(self, n_slots: int, host_slots: int = 0) -> DeltaState | None:
        layers = self.recurrent_layers()
        return DeltaState(layers, n_slots, self.config.deltanet, self.device, host_slots) if layers else None

    def batch_meta(self, n_new: list[int], slots: list[int], kv: KVCache) -> BatchMeta:
        """Where each new token goes in a fixed-slot cache, from the slots' own lengths."""
        return slot_batch_meta(n_new, slots, kv, self.device)

    def table_meta(self, n_new: list[int], starts: list[int], tables: list[list[int]], kv: KVPool,
                   slots: list[int] | None = None, state_before: list[tuple[int, int]] | None = None,
                   state_after: list[tuple[int, int]] | None = None) -> BatchMeta:
        """Where each new token goes in a block pool: the engine says where each sequence starts
        and which blocks hold it, and (recurrent layers) which state slot it continues: its
        sequence slot; and which state slots are copied before and after the step (checkpoints:
        run_layers does it)."""
        kv.check_tables(tables, [s + n for s, n in zip(starts, n_new)])
        if kv.state is not None:
            if slots is None:
                raise MoerayError("a step through recurrent (DeltaNet) layers needs each sequence's state slot")
            kv.state.check_slots(slots)
        meta = make_batch_meta(n_new, starts, tables, self.device, state_slots=slots)
        meta.state_before, meta.state_after = state_before, state_after
        return meta

    def embed(self, tokens: list[list[int]] | torch.Tensor) -> torch.Tensor:
        """Token ids (a list per sequence, or a flat tensor) -> packed hidden states [N, hidden]."""
        if not self.has_embedding:
            raise MoerayError(f"stage [{self.first}, {self.end}) has no embedding; feed it hidden states")
        if not isinstance(tokens, torch.Tensor):
            tokens = torch.tensor([t for seq in tokens for t in seq], dtype=torch.long)
        return self.tok_embd.rows(tokens.to(self.device))

    @torch.inference_mode()
    def run_layers(self, hidden: torch.Tensor, meta: BatchMeta, kv: KVPool,
                   out_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Packed hidden [N, hidden] through this stage's layers; appends the step's k/v to `kv`.
        On the ggml backend a GQA stage runs each layer's trunk as one graph (stages/runtime/trunk_graph.py)
        when the step's shape has one; otherwise (and on the other backends) the torch ops below.

        out_rows: the packed rows the caller reads (the head's, on the last stage), ascending, or
        None for all; then the last layer's FFN runs for those rows only (its attention still
        writes every row's keys) and the result is [len(out_rows), hidden], those rows in order,
        with the bits of the same rows run in full (each FFN row depends on its own row only)."""
        if out_rows is not None:
            out_rows = torch.as_tensor(out_rows, dtype=torch.long).to(hidden.device)
            if out_rows.numel() == 0:
                raise ValueError("run_layers: out_rows is empty; pass None for every row, or at least one row")
            if out_rows.numel() == hidden.shape[0]:  # every row, in order (ascending, distinct)
                out_rows = None
        state = kv.state
        if state is not None:
            if meta.state_before:  # checkpoints restored into their sequences' slots
                state.copy(meta.state_before)
            if meta.state_slots is not None:  # sequences that start over begin from zeros
                fresh = [slot for slot, start in zip(meta.state_slots, meta.starts) if start == 0]
                if fresh:
                    state.clear(fresh)
        step = self.trunk.step(meta, kv, out_rows) if self.trunk is not None else None
        if step is not None:
            x = self._run_graphs(hidden.float().contiguous(), step, kv)
        else:
            x = self._run_torch(hidden, meta, kv, out_rows)
        if state is not None and meta.state_after:  # block boundaries' states checkpointed
            state.copy(meta.state_after)
        if meta.slots is not None:  # a fixed-slot cache keeps its own lengths
            kv.advance(meta.slots, meta.n_new)
        return x

    def _run_graphs(self, x: torch.Tensor, step, kv: KVPool) -> torch.Tensor:
        """Each layer's trunk in one graph, the previous layer's FFN output added inside it. An
        MoE layer's routing runs in that graph too where its rule has a graph form, and so do its
        routed experts when one stack serves every pick (MoEBlock.one_stack: the host path, or
        every expert resident): one call per layer; a shared expert and a dense layer's FFN run
        inside as well. A layer split between slots and the mapping runs its routed experts after
        the graph (at most two expert graphs), from the graph's ids. When every
        layer runs whole inside, a decode-sized step runs the stage's layers as ONE graph
        (TrunkGraphs.stage), as llama.cpp runs a token."""
        specs = self._step_specs()
        if self.path.stage and step.n <= STAGE_TOKENS and all(s.whole for s in specs):
            got = self.trunk.stage(step, x, specs, kv)
            if got is not None:
                x, ids, weights, tail = got
                self._count_stage(specs, ids, weights, tail)  # int32: the counters read it as numpy
                return x
        r = None
        last = len(specs) - 1
        for i, ((ffn, _, _), spec) in enumerate(zip(self._specs, specs)):
            out = self.trunk.layer(step, x, r, spec, kv, last=i == last)
            x = out.x
            if out.ffn is not None:  # the whole FFN ran inside (an MoE layer's experts counted now)
                r = out.ffn
                if spec.routed is not None:
                    ffn.count_graph(out.ids.long(), out.weights, spec.routed.one)
            elif spec.routed is not None:
                r = ffn.after_graph(out.h, out.ids.long(), out.weights, spec.routed.one, out.experts, out.shared)
            else:
                r = ffn(out.h, out.logits) if spec.router is not None else ffn(out.h)
        return x + r

    def _step_specs(self) -> list:
        """Each layer's LayerSpec for this step: its routing (and routed experts where one stack
        serves every pick) inside the graph. Made again only when a layer's stack changes (a slot
        filled or emptied), not per step: 30-60 layers of spec and key building cost ~0.5 ms."""
        if self._specs is None:  # once, after load: each layer's FFN and fixed graph inputs
            self._specs = [self._graph_spec(l) for l in self.layers]
        fused = self.path.fused
        ones = [ffn.one_stack() if fused and base.router is not None and ffn.graph_routing is not None
                else None for ffn, base, _ in self._specs]
        kept = self._step_specs_for
        if kept is not None and all(a is b for a, b in zip(kept[0], ones)):
            return kept[1]
        specs = []
        for (ffn, base, dense), one in zip(self._specs, ones):
            if not fused:
                specs.append(base)
            elif base.router is None:  # a dense layer: its FFN inside where it has a graph form
                specs.append(base if dense is None else base.with_routed(None, dense))
            elif ffn.graph_routing is None:
                specs.append(base)
            else:  # the shared expert runs inside whether the routed experts do or not
                keep_h = one is None or (ffn.shared is not None and dense is None)
                specs.append(base.with_routed(Routed(ffn.graph_routing, one, keep_h, ffn.router_bias), dense))
        self._step_specs_for = (ones, specs)
        return specs

    def _count_stage(self, specs: list, ids: torch.Tensor, weights: torch.Tensor, tail=None) -> None:
        """The experts' counting for a step that ran as one stage graph (ids, weights [M, N, k] of
        its M MoE layers in order; tail: the last layer's (ids, weights) where it ran for fewer
        rows, TrunkGraphs.stage), in layer order: in one call where the experts count a whole
        stage at once."""
        plan = self._count_plan
        if plan is None or plan[0] is not specs or plan[1] != (tail is not None):
            plan = self._count_plan = (specs, tail is not None, *self._counting(specs, tail is not None))
        _, _, moe, last, layers, ones = plan
        if layers is not None:
            self.experts.after_stage(layers, ids, weights, ones)
        else:
            for (ffn, spec), i, w in zip(moe, ids, weights):
                ffn.count_graph(i, w, spec.routed.one)
        if last is not None:
            last[0].count_graph(tail[0].long(), tail[1], last[1].routed.one)

    def _counting(self, specs: list, has_tail: bool) -> tuple:
        """How a stage graph's step over `specs` is counted, made once per specs (a decode step's
        per-layer lists cost ~0.1 ms from cold caches): the MoE layers (FFN, spec) counted one by
        one, the tail layer's, and where the experts count the others at once their layers and
        stacks (else None, None)."""
        moe = [(ffn, spec) for (ffn, _, _), spec in zip(self._specs, specs) if spec.routed is not None]
        last = moe.pop() if has_tail else None
        at_once = (moe and getattr(self.experts, "after_stage", None) is not None
                   and all(ffn.experts is self.experts for ffn, _ in moe))
        if not at_once:
            return moe, last, None, None
        return moe, last, [ffn.layer for ffn, _ in moe], [spec.routed.one for _, spec in moe]

    @staticmethod
    def _graph_spec(layer: TransformerLayer) -> tuple:
        """(the layer's FFN, its trunk_graph.LayerSpec, the graph form of its dense FFN or shared
        expert: None where it has none or its weights are not on the ggml backend)."""
        ffn = layer.ffn
        moe = isinstance(ffn, MoEBlock)
        spec = LayerSpec(layer.attn_norm, layer.attn, layer.ffn_norm, ffn.w_router if moe else None)
        d = ffn.shared if moe else ffn
        dense = None if d is None else Dense.of(d.gate, d.up, d.down, ffn.w_shared_gate if moe else None)
        return ffn, spec, dense

    def _run_torch(self, hidden: torch.Tensor, meta: BatchMeta, kv: KVPool,
                   out_rows: torch.Tensor | None = None) -> torch.Tensor:
        eps = self.config.rms_eps
        cos_sin = self.rope.cos_sin(meta.positions)
        x = hidden
        for i, layer in enumerate(self.layers):
            x = x + layer.attn(rms_norm(x, layer.attn_norm, eps), meta, kv, self.rope, cos_sin)
            if out_rows is not None and i == len(self.layers) - 1:  # as the graphs: the rows read only
                x = x[out_rows]
            x = x + layer.ffn(rms_norm(x, layer.ffn_norm, eps))
        return x

    @torch.inference_mode()
    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + lm_head: [n, hidden] -> [n, vocab] float32."""
        if not self.has_head:
            raise MoerayError(f"stage [{self.first}, {self.end}) has no head; pass its output to the next stage")
        return self.w_out.normed(hidden, self.out_norm, self.config.rms_eps)

    @torch.inference_mode()
    def step(self, tokens: list[list[int]], slots: list[int], kv: KVCache) -> torch.Tensor:
        """Append tokens[i] to the sequence in KV slot slots[i] (a prefill chunk or one decode token);
        returns the logits of each sequence's last new position, [n_seqs, vocab]."""
        if not self.has_embedding or not self.has_head:
            raise MoerayError(f"step() needs the whole model; stage [{self.first}, {self.end}) is a part, "
                              "use embed/run_layers/head")
        if any(len(t) == 0 for t in tokens):
            raise ValueError("every sequence in a step needs at least one new token")
        meta = self.batch_meta([len(t) for t in tokens], slots, kv)
        return self.head(self.run_layers(self.embed(tokens), meta, kv, meta.last_index))

    @torch.inference_mode()
    def logits_all(self, token_ids: list[int], types: KVTypes | None = None) -> torch.Tensor:
        """Logits at every position of one fresh sequence, [T, vocab] float32 (`types`: the KV
        cache's types; None: kv_types())."""
        kv = self.new_kv_cache(1, len(token_ids), types)
        meta = self.batch_meta([len(token_ids)], [0], kv)
        return self.head(self.run_layers(self.embed([list(token_ids)]), meta, kv))


# The shared blocks a layer is built from, by the kind its architecture names (stages/arch/).
_ATTENTION = {"gqa": StageModel._gqa, "gated_gqa": StageModel._gated_gqa, "deltanet": StageModel._deltanet,
              "mla": StageModel._mla}
_FFN = {"dense": StageModel._dense_ffn, "moe": StageModel._moe}


def stage_trunk_bytes(gguf, first: int, end: int, backend: str | None = "current") -> int:
    """Bytes the trunk of layers [first, end) holds on its device on `backend` (default: this
    process's), from the header alone: what a stage is charged before anything is loaded
    (StageModel.trunk_bytes() measures the same after loading). backend=None: the GGUF's bytes."""
    if backend == "current":
        backend = current_backend()
    cfg = gguf.config
    t = trunk_bytes(gguf.tensors, cfg, backend)
    n = sum(t["layers"][first:end])
    if first == 0:
        n += t["embedding"]
    if end == cfg.n_layers:
        n += t["head"] - (t["embedding"] if first == 0 and cfg.tie_embeddings else 0)  # one shared matrix
    return n


def load_model(path: str | os.PathLike | GGUFFile, device: str | torch.device = "cpu",
               experts: Experts | None = None, backend: str | None = None) -> StageModel:
    return StageModel.from_gguf(path, None, device, experts, backend)


def memory_report(model: StageModel) -> dict:
    """What loading cost: the resident trunk (block form), the quantised expert bytes left in the
    mapping, and what the same layers would take fully dequantised to float32. `process_rss` is the
    whole process (torch, Python, tokenizer, ...), for context."""
    trunk = model.trunk_bytes()
    g, cfg = model.gguf, model.config
    expert_q = dequant = stored = 0
    for name, info in g.tensors.items():
        role, layer = tensor_role(name)
        if layer is not None:
            if not model.first <= layer < model.end:
                continue
        elif role == "embedding":
            if not (model.has_embedding or (model.has_head and cfg.tie_embeddings)):
                continue
        elif not model.has_head:
            continue
        n = 1
        for d in info.shape:
            n *= d
        dequant += 4 * n
        stored += info.n_bytes
        if role == "expert":
            expert_q += info.n_bytes
    return {"trunk_resident_bytes": trunk, "experts_quantized_mapped_bytes": expert_q,
            "stored_bytes": stored, "fully_dequantized_bytes": dequant, "process_rss_bytes": process_rss_bytes()}


def load_cached(path: str | os.PathLike | GGUFFile, layers: tuple[int, int] | None = None,
                device: str | torch.device = "cpu", backend: str | None = None, *, budget_bytes: int | None = None,
                profile=None, policy: str = "static", record_routing: str | os.PathLike | None = None,
                layout: str = "per-layer", n_slots: int | None = None, copies_per_step: int | None = 1,
                whole_cache_only: bool = False):
    """The one stage builder (StageActor.load, `serve --local` through it, `moeray generate`, the
    benches): (StageModel of layers [first, end), its ExpertCache or None).

    The MoE blocks are built with an expert cache of `budget_bytes` (or `n_slots` of the largest
    expert) in front of the host copy, laid out per layer (moeray.cache.attach.build_cache has the
    arguments); no cache when neither is given or the layers hold no MoE layer. `whole_cache_only`
    (`serve --local`): a cache only when the budget holds every expert of the layers, else every
    expert computed from the host copy: a simulated device lives in the host's own memory, so a
    partial cache there reads no fewer bytes, and it splits every layer's experts between two
    stacks, which takes the layer's step out of the stage graph (the 30B-A3B shape, 4 sequences:
    355 ms a step with 24 slots a layer, 339 with 1, 315 with none; docs/architecture.md, "The expert
    cache")."""
    from moeray.cache.attach import build_cache

    gguf = path if isinstance(path, GGUFFile) else GGUFFile(path)
    cfg = gguf.config
    first, end = layers if layers is not None else (0, cfg.n_layers)
    host = HostExperts(gguf, backend or current_backend())
    moe = [l for l in range(first, end) if cfg.is_moe_layer(l)]
    cache = None
    if moe and (budget_bytes is not None or n_slots is not None):
        every = cfg.n_experts * sum(host.slot_bytes(l) for l in moe)
        if not whole_cache_only or budget_bytes is None or every <= budget_bytes:
            cache = build_cache(host, first, end, device, budget_bytes, profile, policy, record_routing,
                                layout=layout, n_slots=n_slots, copies_per_step=copies_per_step)
    return StageModel(gguf, first, end, device, host if cache is None else cache, host.backend), cache
