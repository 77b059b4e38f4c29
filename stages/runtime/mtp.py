"""Multi-token prediction on the last stage: the next-token-prediction layer some files carry
(GLM-4.5's `nextn`), run as llama.cpp's `draft-mtp` runs it.

The layer reads two things at position j: the embedding of token t_j and the target's final hidden
state at j - 1 (after the output norm: the state that predicted t_j). It mixes them,

    x = eh_proj([enorm(embed(t_j)); hnorm(h_{j-1})])

runs one decoder block of the model's own kind on x (attention over its own KV of the earlier
positions, the block's MoE FFN and shared expert), and its head, `shared_head_norm` then the
model's output matrix, gives the distribution of t_{j+1}. Chained, its normed output stands in for
the target's hidden state: t_{j+2} from (d_1, its own state at j), and so on.

Two passes a step, both on the last stage, where the target's hidden states are:
  * catch-up: every position the step fed, paired with the hidden state before it (the previous
    step's last one, kept per sequence: `pending`), writes the layer's KV, so its attention sees
    the sequence as the target does (a rejected position's rows are rewritten before they are read,
    as the target's are);
  * drafting: for each sequence that asks, from the token the step emitted and the hidden state
    that chose it, k greedy tokens, returned with the step's result: the engine offers them as the
    next step's draft (cluster/speculation.py, kind "mtp"). The chain's positions lie past what the
    engine gave the sequence, so their KV goes to scratch blocks of the layer's own pool (every
    position there is rewritten by the next catch-up before anything reads it).

The layer's weights, its KV pool and (where the stage has none) the token embedding are charged to
the last stage like trunk.
"""
from __future__ import annotations

import copy
import dataclasses

import torch

from moeray.errors import MoerayError
from moeray.stages.blocks.attention import rms_norm
from moeray.stages.blocks.kv_cache import BLOCK_SIZE, blocks_for

MAX_CHAIN = 16  # tokens one sequence may draft with the layer per step (its scratch blocks' size)


def mtp_bytes(header, n_blocks: int, max_seqs: int, itemsize: int = 4, stage_has_embedding: bool = False) -> int:
    """What the layer will hold on the last stage, from the header: its tensors but the routed
    experts (computed from the host copy, as any layer's misses), the token embedding where the
    stage has none (not the first stage too, and the head not tied to it), and its KV pool (the
    target's blocks and the chains' scratch)."""
    from moeray.stages.blocks.kv_cache import kv_block_bytes

    cfg, n = header.config, header.config.n_layers
    own = sum(t.n_bytes for name, t in header.tensors.items()
              if name.startswith(f"blk.{n}.") and "_exps." not in name)
    embed = 0 if cfg.tie_embeddings or stage_has_embedding else header.tensors["token_embd.weight"].n_bytes
    view = dataclasses.replace(cfg, n_layers=n + 1)
    kv = (n_blocks + max_seqs * blocks_for(MAX_CHAIN + BLOCK_SIZE)) * kv_block_bytes(view, range(n, n + 1), itemsize)
    return own + embed + kv


def mtp_layers(gguf) -> int:
    """The next-token-prediction layers a file carries after its decoder (0: none)."""
    arch = gguf.header.arch if hasattr(gguf, "header") else gguf.arch
    n = int(gguf.metadata.get(f"{arch}.nextn_predict_layers", 0) or 0)
    return n if n and f"blk.{gguf.config.n_layers}.nextn.eh_proj.weight" in gguf.tensors else 0


class MTPHead:
    def __init__(self, target, n_blocks: int, max_seqs: int):
        """`target`: the last stage's StageModel (its head and output norm are the layer's own
        where the file has no nextn.shared_head_*)."""
        from moeray.stages.runtime.model import StageModel

        gguf, cfg = target.gguf, target.config
        if not target.has_head:
            raise MoerayError("the next-token-prediction layer runs on the last stage (it needs the head)")
        if not mtp_layers(gguf):
            raise MoerayError(f"{gguf.path}: no next-token-prediction (nextn) layer in this file; "
                              "use --speculative auto, ngram or draft")
        n = cfg.n_layers
        view = copy.copy(gguf)  # the layer after the decoder, built as any decoder layer is
        view.config = dataclasses.replace(cfg, n_layers=n + 2)  # + 2: no head of its own is loaded
        self.block = StageModel(view, n, n + 1, target.device, backend=target.backend)
        p, b = f"blk.{n}.nextn.", self.block
        self.eh_proj = b._matrix(p + "eh_proj.weight")
        self.enorm, self.hnorm = b._vector(p + "enorm.weight"), b._vector(p + "hnorm.weight")
        self.head_norm = b._vector(p + "shared_head_norm.weight") if gguf.has(p + "shared_head_norm.weight") \
            else target.out_norm
        self.w_head = b._matrix(p + "shared_head_head.weight") if gguf.has(p + "shared_head_head.weight") \
            else target.w_out
        if gguf.has(p + "embed_tokens.weight"):
            self.embed = b._matrix(p + "embed_tokens.weight")
        elif target.tok_embd is not None:
            self.embed = target.tok_embd
        else:  # a last stage holds no embedding unless the head is tied to it
            self.embed = target.w_out if cfg.tie_embeddings else b._matrix("token_embd.weight")
            self.embed.keep_plain = True
        self.own = [w for w in (self.eh_proj, self.w_head, self.embed) if w is not target.w_out and w is not target.tok_embd]
        self.eps, self.hidden = cfg.rms_eps, cfg.hidden
        self.out_norm = target.out_norm  # the target's hidden state, as the layer reads it
        self.n_blocks = n_blocks
        self.scratch = blocks_for(MAX_CHAIN + BLOCK_SIZE)  # per drafting row: the chain's positions
        self.kv = self.block.new_kv_pool(n_blocks + max_seqs * self.scratch)
        self.pending: dict[int, torch.Tensor] = {}  # slot -> the target's normed state at its last position

    def nbytes(self) -> int:
        """What it holds on its device: the layer's trunk, its own matrices and its KV pool."""
        return self.block.trunk_bytes() + sum(w.nbytes for w in self.own) + self.kv.nbytes() + 3 * 4 * self.hidden

    def token_ms(self, reps: int = 5) -> float:
        """Median ms of one proposed token (a pass of the layer and the head, one row), timed in a
        scratch block."""
        import time

        times = []
        h = torch.zeros(1, self.hidden, device=self.block.device)
        for _ in range(reps):
            t = time.perf_counter()
            m, _ = self._forward([1], h, [1], [0], [[self.n_blocks]])
            self.w_head(m).argmax(-1)
            times.append((time.perf_counter() - t) * 1e3)
        return sorted(times)[len(times) // 2]

    def reset(self, slot: int) -> None:
        self.pending.pop(slot, None)

    @torch.inference_mode()
    def _forward(self, tokens: list[int], h: torch.Tensor, n_new, starts, tables):
        """The layer on rows of (token, previous state) at the given positions: its normed output
        (the chain's next state) [N, H]."""
        e = self.embed.rows(torch.tensor(tokens, dtype=torch.long, device=h.device))
        x = self.eh_proj(torch.cat([rms_norm(e.float(), self.enorm, self.eps), rms_norm(h, self.hnorm, self.eps)], -1))
        meta = self.block.table_meta(n_new, starts, tables, self.kv)
        x = self.block.run_layers(x.contiguous(), meta, self.kv)
        return rms_norm(x, self.head_norm, self.eps), meta

    def catch_up(self, rows, x: torch.Tensor, meta) -> dict[int, torch.Tensor]:
        """rows: (batch row, slot, start, tokens, table, fresh) of the step's rows; x: the target's
        final hidden states of the step [N, H]. Writes the layer's KV at every fed position and
        returns each row's normed target states [n_i, H] (what `settle` reads)."""
        if not rows:
            return {}
        hn = rms_norm(x, self.out_norm, self.eps)
        last = meta.last_index.tolist()
        states, prev, toks, n_new, starts, tables = {}, [], [], [], [], []
        for i, slot, start, tokens, table, fresh in rows:
            n = len(tokens)
            mine = hn[last[i] - n + 1:last[i] + 1]
            states[i] = mine
            before = None if fresh or start == 0 else self.pending.get(slot)
            if before is None:  # a sequence's first position has no state before it
                before = torch.zeros(self.hidden, device=x.device)
            prev.append(torch.cat([before.view(1, -1), mine[:-1]]))
            toks += tokens
            n_new.append(n)
            starts.append(start)
            tables.append(table)
            self.pending[slot] = mine[-1]  # a row that emits nothing (a prompt chunk) goes on from here
        self._forward(toks, torch.cat(prev), n_new, starts, tables)
        return states

    def settle(self, slot: int, state: torch.Tensor) -> None:
        """The target state before the sequence's next position (its last kept one: a verify row's
        rejected positions are not the sequence's)."""
        self.pending[slot] = state

    def draft(self, rows) -> list[list[int]]:
        """rows: (table, position, token, state, k): from the token the step emitted at `position`
        and the target state that chose it, k greedy tokens each."""
        if not rows:
            return []
        out: list[list[int]] = [[] for _ in rows]
        pos = [p for _, p, _, _, _ in rows]
        toks = [t for _, _, t, _, _ in rows]
        h = torch.stack([s for _, _, _, s, _ in rows])
        # A chain's positions: its sequence's blocks up to the emitted token's, then scratch blocks
        # (rows at and past the emitted token are rewritten by the next catch-up before any read).
        tables = []
        for j, (table, p, _, _, k) in enumerate(rows):
            if k > MAX_CHAIN:
                raise MoerayError(f"the next-token-prediction layer drafts at most {MAX_CHAIN} tokens a step, asked {k}")
            base = self.n_blocks + j * self.scratch
            tables.append(list(table[:min(len(table), p // BLOCK_SIZE + 1)]) + list(range(base, base + self.scratch)))
        live = list(range(len(rows)))
        while live:
            m, _ = self._forward([toks[j] for j in live], h[live], [1] * len(live), [pos[j] for j in live],
                                 [tables[j] for j in live])
            nxt = self.w_head(m).argmax(-1).tolist()
            h = h.clone()
            for r, j in enumerate(live):
                out[j].append(int(nxt[r]))
                toks[j], pos[j] = int(nxt[r]), pos[j] + 1
                h[j] = m[r]
            live = [j for j in live if len(out[j]) < rows[j][4]]
        return out
