"""StageRunner: one stage's compute over its model and KV pool, without Ray (the step's contract
is stages/runtime/step.py)."""
from __future__ import annotations

import time
from typing import Any

import torch

from moeray.errors import MoerayError
from moeray.stages.runtime.step import StepBatch, StepOutput
from moeray.stages.runtime.trunk_graph import MultiGraph
from moeray.stages.text.grammar import GrammarMasks, token_bytes
from moeray.stages.text.reasoning_budget import ReasoningBudgets
from moeray.stages.text import sampling  # called through the module: a test watches sampling.sample
from moeray.stages.text.tokenizer import Tokenizer
from moeray.stages.text.verify import verify_row


class StageRunner:
    """One stage's compute over its model and KV pool: start a micro-batch (new sequences get a new
    sampler; positions and KV rows from the batch's starts and block tables), run the layers, and,
    on the last stage, sample one token per sequence that wants one. StageActor runs it between a
    receive and a send; a one-process pipeline (moeray generate) runs the whole model with it."""

    def __init__(self, model, kv):
        self.model, self.kv = model, kv  # kv: a KVPool
        self.drafter = None  # the first stage's draft model (stages/runtime/draft_model.py), if any
        self.mtp = None  # the last stage's next-token-prediction layer (stages/runtime/mtp.py), if any
        self.params: dict[int, Any] = {}  # slot -> its sequence's SamplingParams (sent once, on its fresh row)
        self.generators: dict[int, Any] = {}  # slot -> the torch.Generator of its sequence
        self.grammars = None  # stages/text/grammar.py GrammarMasks, made on the first constrained request
        self.budgets = None  # stages/text/reasoning_budget.py ReasoningBudgets, made on the first budgeted request
        self.tokenizer = None  # the model's, read from its GGUF for the first of those
        # slot -> its sequence's TokenHistory (penalties), or the (prompt, output) it is built from
        # on the sequence's first sampled row (where the vocabulary and the device are known)
        self.histories: dict[int, Any] = {}
        self._built = 0  # MultiGraph.built when the step began: the step is cold where it moved

    def share_host_tier(self) -> None:
        """A draft model's and an MTP layer's pools follow the target pool's host tier (the same
        block tables, so the same saves and loads), each in its own bytes."""
        host = self.kv.host
        if host is None:
            return
        from moeray.stages.blocks.host_kv import HostBlocks

        for owner in (self.drafter, self.mtp):
            pool = getattr(owner, "kv", None)
            if pool is not None and pool.host is None:
                pool.host = HostBlocks(pool, host.n_slots)

    def begin(self, batch: StepBatch):
        self._built = MultiGraph.built
        for slot in batch.ended or ():  # sequences that ended: what the stage kept for them goes
            self._forget(slot)
        for i, (slot, fresh) in enumerate(zip(batch.slots, batch.fresh)):
            if fresh:  # a new sequence in this slot: its params, a sampler from its own seed
                self._forget(slot)
                if batch.params is not None and batch.params[i] is not None:
                    self.params[slot] = batch.params[i]
                if batch.history is not None and batch.history[i] is not None:
                    self.histories[slot] = batch.history[i]
                if self.mtp is not None:
                    self.mtp.reset(slot)
        if batch.starts is None or batch.tables is None:
            raise MoerayError("a step needs its sequences' start positions and KV block tables")
        pools = [p for p in (self.kv, getattr(self.drafter, "kv", None), getattr(self.mtp, "kv", None)) if p is not None]
        if batch.kv_save or batch.kv_load:  # the host tier first: a save reads a block before anything rewrites it
            for pool in pools:
                if pool.host is None and pool is self.kv and pool.k:  # (a stage of DeltaNet layers only has no rows)
                    raise MoerayError("a step moves KV blocks to or from the host tier, and this stage keeps none")
                if pool.host is not None:
                    pool.host.save(batch.kv_save or [])
                    pool.host.load(batch.kv_load or [])
        if batch.copies:  # every pool addressed by the tables: the target's, a draft model's, the MTP layer's
            for pool in pools:
                pool.copy_rows(batch.copies)
        return self.model.table_meta(batch.n_new, batch.starts, batch.tables, self.kv, batch.slots,
                                     state_before=batch.state_before, state_after=batch.state_after)

    def _forget(self, slot: int) -> None:
        """Drop what the stage keeps for the sequence in `slot`: params, sampler, history, grammar,
        reasoning budget."""
        self.params.pop(slot, None)
        self.generators.pop(slot, None)
        self.histories.pop(slot, None)
        if self.grammars is not None:
            self.grammars.reset(slot)
        if self.budgets is not None:
            self.budgets.reset(slot)

    def row_params(self, batch: StepBatch) -> list:
        """Each row's sampling params where it wants a token (kept from its sequence's fresh row),
        else None."""
        if batch.sample is None:
            return [None] * len(batch.slots)
        out = []
        for slot, want in zip(batch.slots, batch.sample):
            if not want:
                out.append(None)
            elif (p := self.params.get(slot)) is not None:
                out.append(p)
            else:
                raise MoerayError(f"slot {slot}: a token is wanted but the sequence's sampling parameters never "
                                  "came (they travel on its first row; a restarted stage gets them again when "
                                  "its sequences are admitted again)")
        return out

    def layers(self, x, meta, batch: StepBatch | None = None):
        """The stage's layers over x. batch: on the last stage, the step's batch; then only the rows
        its head reads (head_rows) leave the last layer, and `sample` takes them as they are."""
        rows = None if batch is None or self.traced() else self.head_rows(batch, meta)
        return self.model.run_layers(x, meta, self.kv, rows)

    def traced(self) -> bool:
        """Routing is being recorded (--record-routing): then every row runs the last layer's
        experts, so the trace holds every layer's picks for every token (a profile made from it
        weighs the last layer as the others), at the cost of that layer's FFN for all rows."""
        experts = self.model.experts
        return getattr(experts, "trace_writer", None) is not None or getattr(experts, "on_route", None) is not None

    def head_rows(self, batch: StepBatch, meta) -> list[int] | None:
        """The packed rows the last stage's head reads this step, ascending: each sampling row's last
        position, every position of a verify row's drafts and its last token; None where every row
        is read (the next-token-prediction layer catches up on all of them). A step that samples
        nothing (a prompt's middle chunk) still keeps its last row: a graph needs one."""
        if self.mtp is not None and batch.mtp_k is not None:
            return None
        last = meta.last_index.tolist()
        rows = []
        for i, want in enumerate(batch.sample or ()):
            if want:
                k = len(batch.drafts[i]) if batch.drafts is not None and batch.drafts[i] else 0
                rows.extend(range(last[i] - k, last[i] + 1))
        if len(rows) == meta.n_tokens:  # a decode step in which every row samples: no gather to build
            return None
        return rows or [last[-1]]

    def sample(self, batch: StepBatch, x, meta) -> StepOutput:
        """The step's tokens (`_sample`) and, with a next-token-prediction layer, its KV kept up with
        the step and its proposals for each row's next step (StepOutput.proposals)."""
        out = self._sample(batch, x, meta)
        out.cold = MultiGraph.built != self._built
        if self.mtp is None or batch.mtp_k is None:
            return out
        out.proposals = self._propose(batch, x, meta, out.tokens)
        return out

    def _propose(self, batch: StepBatch, x, meta, tokens) -> list:
        """The MTP layer's catch-up over every row, then, where asked, its tokens after what each
        row emitted (from the target state at the row's last kept position)."""
        rows = [(i, slot, start, list(toks), table, fresh) for i, (slot, start, toks, table, fresh) in
                enumerate(zip(batch.slots, batch.starts, batch.tokens, batch.tables, batch.fresh))]
        states = self.mtp.catch_up(rows, x, meta)
        proposals: list = [None] * len(batch.slots)
        asks = []
        for i, tok in enumerate(tokens):
            if tok is None:
                continue
            emitted = tok if isinstance(tok, list) else [tok]
            drafted = len(batch.drafts[i]) if batch.drafts is not None else 0
            kept = batch.n_new[i] - drafted + len(emitted) - 1  # the row's positions the sequence keeps
            state = states[i][kept - 1]
            self.mtp.settle(batch.slots[i], state)
            if batch.mtp_k[i] > 0:
                asks.append((i, (batch.tables[i], batch.starts[i] + kept, emitted[-1], state, batch.mtp_k[i])))
        for (i, _), d in zip(asks, self.mtp.draft([a for _, a in asks])):
            proposals[i] = d
        return proposals

    def _sample(self, batch: StepBatch, x, meta) -> StepOutput:
        """A token per sequence whose params ask for one (its prompt is fully fed), else None, and
        the log-probabilities of those whose params ask for them. A sequence with a grammar
        samples only among the tokens its grammar allows next, from the same logits; one with
        penalties reads its TokenHistory, which counts each token it samples here. A verify row
        (batch.drafts: k drafted tokens after its last token) gets a list: the drafted tokens the
        target accepts and one of its own (stages/text/verify.py), with a log-probability each."""
        by_row = self.row_params(batch)
        want = [i for i, p in enumerate(by_row) if p is not None]
        out: list = [None] * len(batch.slots)
        if not want:
            return StepOutput(out)
        drafts = batch.drafts
        if drafts is not None and any(drafts[i] for i in want):
            return self._verify(batch, x, meta, want, by_row)
        logits = self.model.head(self._rows(x, meta.last_index[want]))
        params = [by_row[i] for i in want]
        slots = [batch.slots[i] for i in want]
        histories = self._prepare(slots, params, logits)
        allowed = self._masks(slots, params, logits.shape[-1])
        toks = sampling.sample(logits, params, [self.generators[slot] for slot in slots], allowed, histories)
        for i, slot, p, tok in zip(want, slots, params, toks):
            out[i] = tok
            self._took(slot, p, [tok])
        if all(p.logprobs is None for p in params):
            return StepOutput(out)
        logprobs = [None] * len(batch.slots)
        for row, (i, p, tok) in enumerate(zip(want, params, toks)):
            if p.logprobs is not None:
                logprobs[i] = sampling.token_logprobs(logits[row], tok, p.logprobs)
        return StepOutput(out, logprobs)

    @staticmethod
    def _rows(x, index):
        """The head's rows of x: x itself where it holds only them (`layers` kept head_rows, which
        are these; or a decode step in which every row samples), else gathered from every row."""
        return x if x.shape[0] == len(index) else x[index]

    def _prepare(self, slots: list[int], params: list, logits) -> list | None:
        """Each sequence's sampler (from its own seed) and, where its penalties read them, its
        TokenHistory (made from the tokens it holds on its first sampled row); the histories by
        row, or None when no row has penalties."""
        for slot, p in zip(slots, params):
            if slot not in self.generators:
                self.generators[slot] = p.new_generator()
            if p.needs_history:
                if isinstance(self.histories.get(slot), tuple):  # its first sampled row: count what it holds
                    prompt, output = self.histories[slot]
                    self.histories[slot] = sampling.TokenHistory(logits.shape[-1], prompt, output, logits.device)
                elif slot not in self.histories:
                    raise MoerayError(f"slot {slot}: penalties asked for, but the sequence's tokens never came")
        return [self.histories.get(slot) for slot in slots] if any(p.needs_history for p in params) else None

    def _verify(self, batch: StepBatch, x, meta, want: list[int], by_row: list) -> StepOutput:
        """A step with verify rows: every position of a verify row goes through the head (the
        target's distribution after each drafted token), one position of a plain row; each verify
        row's tokens are its accepted drafts and one more, each plain row's its sampled token."""
        last = meta.last_index.tolist()
        index, spans = [], []
        for i in want:
            k = len(batch.drafts[i])
            spans.append((len(index), k + 1))
            index.extend(range(last[i] - k, last[i] + 1))
        logits = self.model.head(self._rows(x, torch.tensor(index, device=x.device)))
        out: list = [None] * len(batch.slots)
        logprobs: list = [None] * len(batch.slots)
        params = [by_row[i] for i in want]
        slots = [batch.slots[i] for i in want]
        histories = self._prepare(slots, params, logits) or [None] * len(want)
        n_vocab = logits.shape[-1]
        plain = [n for n, i in enumerate(want) if not batch.drafts[i]]
        if plain:  # the plain rows together, as a step without drafts samples them
            rows = [spans[n][0] for n in plain]
            ps, ss, hs = [params[n] for n in plain], [slots[n] for n in plain], [histories[n] for n in plain]
            allowed = self._masks(ss, ps, n_vocab)
            toks = sampling.sample(logits[rows], ps, [self.generators[s] for s in ss], allowed,
                          hs if any(h is not None for h in hs) else None)
            for n, row, tok in zip(plain, rows, toks):
                out[want[n]] = tok
                self._took(slots[n], params[n], [tok])
                if params[n].logprobs is not None:
                    logprobs[want[n]] = sampling.token_logprobs(logits[row], tok, params[n].logprobs)
        for n, i in enumerate(want):
            draft = batch.drafts[i]
            if not draft:
                continue
            p, slot = params[n], slots[n]
            off, m = spans[n]
            rows = logits[off:off + m]
            masks = self._grammars(n_vocab).allowed_along(slot, p.grammar, draft) if p.grammar else None
            if p.reasoning:
                forced = self._budgets(n_vocab).forced_along(slot, p.reasoning, draft)
                masks = [with_forced(m, f, n_vocab) for m, f in zip(masks or [None] * len(forced), forced)]
            toks = verify_row(rows, draft, p, self.generators[slot], masks, histories[n])
            out[i] = toks
            self._took(slot, p, toks)
            if p.logprobs is not None:
                logprobs[i] = [sampling.token_logprobs(rows[j], tok, p.logprobs) for j, tok in enumerate(toks)]
        if all(by_row[i].logprobs is None for i in want):
            return StepOutput(out)
        return StepOutput(out, logprobs)

    def _took(self, slot: int, params, tokens: list[int]) -> None:
        """A sequence's new tokens: its grammar, its reasoning budget and its penalties' history move past them."""
        for tok in tokens:
            if params.grammar:
                self.grammars.advance(slot, tok)
            if params.reasoning:
                self.budgets.advance(slot, params.reasoning, tok)
            if params.needs_history:
                self.histories[slot].add(tok)

    def _masks(self, slots: list[int], params: list, n_vocab: int) -> list | None:
        """Each row's allowed tokens (bool [n_vocab], None: any): its grammar's mask, narrowed to the
        token its reasoning budget forces; None when no row has either."""
        if not any(p.grammar or p.reasoning for p in params):
            return None
        out = []
        for slot, p in zip(slots, params):
            mask = self._grammars(n_vocab).allowed(slot, p.grammar) if p.grammar else None
            forced = self._budgets(n_vocab).forced(slot, p.reasoning) if p.reasoning else None
            out.append(with_forced(mask, forced, n_vocab))
        return out

    def _tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            self.tokenizer = Tokenizer.from_metadata(self.model.gguf.metadata, source=self.model.gguf.path)
        return self.tokenizer

    def _grammars(self, n_vocab: int):
        if self.grammars is None:
            self.grammars = GrammarMasks(self._tokenizer(), n_vocab)
        return self.grammars

    def _budgets(self, n_vocab: int):
        if self.budgets is None:
            self.budgets = ReasoningBudgets(token_bytes(self._tokenizer(), n_vocab))
        return self.budgets

    def draft(self, batch: StepBatch) -> list[list[int]] | None:
        """The draft model's tokens for the rows that ask (first stage), None without one."""
        if self.drafter is None or batch.draft_k is None:
            return None
        return self.drafter.draft(batch.slots, batch.starts, batch.tokens, batch.tables, batch.fresh, batch.draft_k)

    def step(self, batch: StepBatch) -> StepOutput:
        """The whole model in this process: draft (a draft model's rows), embed, every layer, sample."""
        meta = self.begin(batch)
        drafts = self.draft(batch)
        if drafts is not None:
            batch = batch.model_drafted(drafts)
        x = self.layers(self.model.embed(batch.tokens), meta, batch)
        t = time.perf_counter_ns()
        out = self.sample(batch, x, meta)
        out.sample_ns = time.perf_counter_ns() - t
        return out


def with_forced(mask, forced: int | None, n_vocab: int):
    """A row's mask narrowed to the one token a reasoning budget forces; where the grammar forbids
    that token, the grammar's mask stands (the budget gives way, stages/text/reasoning_budget.py)."""
    if forced is None or (mask is not None and not bool(mask[forced])):
        return mask
    out = torch.zeros(n_vocab, dtype=torch.bool)
    out[forced] = True
    return out
