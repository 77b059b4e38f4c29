"""The scheduler: who runs, what each step feeds, and when a request is done.

Requests wait until a sequence slot and the KV blocks of their prompt are free, then run. The
scheduler owns the block accounting (cluster/kv_blocks.py): it gives each sequence its blocks,
reuses the cached blocks of a prompt prefix another request computed, and sends every step's
block tables to the stages. When a decode step finds no free block, the youngest sequence is
preempted: its blocks are freed and it waits to be prefilled again (prompt and output so far),
so the client sees latency, not an error.

Each running request belongs to one of `micro_batches` lanes; every lane has at most one step in
flight (cluster/engine.py keeps that rule). A lane's step packs one decode token per decoding
request, then prompt chunks (at most `prefill_chunk` tokens of a prompt per step, chunked
prefill) until the step's `token_budget` is spent, so a long prompt never stalls the decodes
that share its lane. While no sequence decodes (a lone long prompt, or prompts arriving together)
nothing waits on a step, so chunks and budget grow to `prefill_alone` (llama.cpp's ubatch):
fewer, bigger steps.

`Scheduler.postprocess` owns every finish rule: the end token, the length, and stop strings,
which it finds in the text it detokenises as tokens arrive (`Request.text`: released text only,
never a partial stop string or character). Callers forward that text; none of them decodes.
"""
from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Optional, Sequence

from moeray.cluster.config import EngineConfig
from moeray.cluster.kv_blocks import BlockManager, consecutive
from moeray.cluster.state_checkpoints import CheckpointLedger
from moeray.cluster.speculation import SeqSpec, Speculation
from moeray.cluster.timeline import Timeline
from moeray.errors import MoerayError
from moeray.stages.blocks.kv_cache import BLOCK_SIZE, blocks_for
from moeray.stages.runtime.step import LOOPED, StepBatch, StepOutput
from moeray.stages.text.detokenize import StopStringStream
from moeray.stages.text.sampling import SamplingParams, TokenLogprob


class RequestStatus(Enum):
    WAITING = "waiting"  # in line for a sequence slot and its prompt's KV blocks (again, after a preemption)
    RUNNING = "running"  # holds a slot and blocks; its rows go into its lane's steps
    FINISHED = "finished"  # end token, length, stop string or abort: `finish_reason` says which
    FAILED = "failed"  # its KV state was lost with a stage: `error` says why


@dataclass
class Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    max_new: int  # params.max_tokens capped by the KV length
    detok: Optional[StopStringStream] = None  # None: an engine without a tokenizer (token ids only)
    output: list[int] = field(default_factory=list)  # every sampled token, the end token included
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: Optional[str] = None  # "stop" (end token or stop string) | "length" | "abort"
    error: Optional[str] = None
    slot: int = -1
    lane: int = -1
    fed: int = 0  # tokens of `prefill` handed to the pipeline so far
    prefill: list[int] = field(default_factory=list)  # what to prefill: the prompt (+ output after a preemption)
    table: list[int] = field(default_factory=list)  # KV blocks, in order
    kv_len: int = 0  # tokens whose KV the steps handed out so far write
    cached_tokens: int = 0  # prompt tokens whose KV was reused from a cached prefix (first admission)
    copy: Optional[tuple[int, int, int]] = None  # (block, own block, rows) to copy before its first chunk
    # (block, own block, rows): its shared prefix (and tail) copied into a consecutive run of its own
    # before its first chunk, each source held until then (cluster/kv_blocks.py, "Where blocks go")
    moves: list[tuple[int, int, int]] = field(default_factory=list)
    renamed: int = 0  # of them, the blocks whose prefix names moved with them (pending until copied)
    # (host slot, own block): prefix blocks the host tier holds, copied back before its first chunk
    loads: list[tuple[int, int]] = field(default_factory=list)
    # (host slot, own block, rows): a tail the host tier holds, loaded after `loads` (no copy found on the device)
    tail_load: Optional[tuple[int, int, int]] = None
    # Recurrent state (hybrid models, cluster/state_checkpoints.py): the checkpoint slot to restore
    # before its first chunk; the slot it keeps its latest block boundary's state in while it
    # decodes; the prompt's block boundary to checkpoint at (its chunk is cut there)
    restore: Optional[int] = None
    rolling: Optional[int] = None
    checkpoint_at: Optional[int] = None
    # Speculation on a hybrid model (docs/speculative.md): the spare state slot its verify row's
    # snapshot is in (the state before the row), and after a rejected draft the kept tokens before
    # its last one that its next row feeds again over that snapshot, restored into its slot
    spare: Optional[int] = None
    refeed: int = 0
    preemptions: int = 0
    fresh: bool = False  # admitted, its first row not yet scheduled: the stages start its sampler over
    t_admit: int = -1  # admission order: the youngest is preempted first
    in_flight: int = 0  # its micro-batches in flight (two while a chained decode runs ahead: cluster/engine.py)
    t_arrive: float = field(default_factory=time.perf_counter)
    t_admitted: Optional[float] = None  # when it first took a sequence slot
    t_first: Optional[float] = None
    t_done: Optional[float] = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per output token, when params.logprobs is set
    spec: Optional[SeqSpec] = None  # its drafter and acceptance record, when it drafts (cluster/speculation.py)
    timeline: Optional[Timeline] = None  # where a served request's time goes (cluster/timeline.py)
    # What the last stage is sent, once, on its fresh row: params without the stop strings (the engine's)
    stage_params: Optional[SamplingParams] = None

    def __post_init__(self) -> None:
        if self.stage_params is None:
            self.stage_params = replace(self.params, stop=()) if self.params.stop else self.params

    @property
    def done(self) -> bool:
        return self.status in (RequestStatus.FINISHED, RequestStatus.FAILED)

    @property
    def busy(self) -> bool:
        """In a micro-batch that is in flight."""
        return self.in_flight > 0

    @property
    def text(self) -> str:
        """The text released so far (final once done); grows only by appending."""
        return self.detok.text if self.detok is not None else ""


@dataclass
class Row:
    """One request's part of a step."""
    req: Request
    tokens: list[int]  # a prompt chunk, or the last sampled token
    start: int  # tokens of the sequence in KV before this row
    fresh: bool  # the prompt's first chunk: the slot's KV and sampler start over
    sample: bool  # the prompt is fully fed with this row: a token comes back
    draft: list[int] = field(default_factory=list)  # drafted tokens after the last one (a verify row)
    model_k: int = 0  # of those, how many the first stage's draft model fills in (placeholders here)
    mtp_k: int = 0  # tokens the last stage's next-token-prediction layer proposes after this row
    # A hybrid model's decode row that may not carry a draft: it re-feeds tokens after a rejected
    # one, or its state is checkpointed after the step (a draft would move where the row ends)
    no_draft: bool = False


@dataclass
class ScheduledStep:
    id: int
    lane: int
    rows: list[Row]  # in slot order: a lane's neighbouring slots read the KV cache as one view
    copies: list[tuple[int, int, int]] = field(default_factory=list)  # KV rows the stages copy first
    # blocks the stages save into their host tier, then load back from it, before the step (cluster/kv_blocks.py)
    kv_save: list[tuple[int, int]] = field(default_factory=list)
    kv_load: list[tuple[int, int]] = field(default_factory=list)
    state_before: list[tuple[int, int]] = field(default_factory=list)  # state slots copied before the step
    state_after: list[tuple[int, int]] = field(default_factory=list)  # ... and after it
    # The pipeline's extra drafters, which keep KV of every row: a draft model on the first stage,
    # a next-token-prediction layer on the last (cluster/speculation.py).
    draft_model: bool = False
    mtp: bool = False
    ended: list[int] = field(default_factory=list)  # slots whose sequences ended since the last step
    # A chained decode (cluster/engine.py): the last stage sends this step's tokens to the first
    # stage, for the step that continues it; `chained`: this step is such a continuation
    loop_back: bool = False
    chained: bool = False

    @property
    def plain_decode(self) -> bool:
        """Every row a plain decode (one token, sampled; no draft), nothing copied around the step:
        a step the same rows can continue one token later."""
        return (not self.copies and not self.kv_save and not self.kv_load and not self.state_before
                and not self.state_after and not self.draft_model and not self.mtp
                and all(r.sample and len(r.tokens) == 1 and not r.draft for r in self.rows))

    def batch(self) -> StepBatch:
        # A sequence with penalties starts its last stage's TokenHistory from what it holds: the
        # prompt, and the output so far when it was preempted (prefilled again as prompt + output).
        history = [(list(r.req.prompt), list(r.req.output)) if r.fresh and r.req.params.needs_history else None
                   for r in self.rows]
        fresh = [r.fresh for r in self.rows]
        return StepBatch(step_id=self.id, slots=[r.req.slot for r in self.rows],
                         n_new=[len(r.tokens) for r in self.rows], fresh=fresh,
                         tokens=[r.tokens for r in self.rows],
                         sample=[r.sample for r in self.rows],
                         # a sequence's params once, with its fresh row (the stage keeps them)
                         params=[r.req.stage_params if r.fresh else None for r in self.rows] if any(fresh) else None,
                         ended=self.ended or None, loop_back=self.loop_back,
                         starts=[r.start for r in self.rows],
                         tables=[r.req.table[:blocks_for(r.start + len(r.tokens))] for r in self.rows],
                         copies=self.copies or None, kv_save=self.kv_save or None, kv_load=self.kv_load or None,
                         state_before=self.state_before or None,
                         state_after=self.state_after or None, history=history if any(history) else None,
                         drafts=[r.draft for r in self.rows] if any(r.draft for r in self.rows) else None,
                         draft_k=[r.model_k for r in self.rows] if self.draft_model else None,
                         mtp_k=[r.mtp_k for r in self.rows] if self.mtp else None)


@dataclass
class EngineStats:
    steps: int = 0
    decode_tokens: int = 0
    prefill_tokens: int = 0
    failures: int = 0
    preemptions: int = 0
    draft_tokens: int = 0  # drafted tokens sent in verify rows
    accepted_tokens: int = 0  # of those, accepted by the target
    # A hybrid model's rejected drafts: the state restored from the spare snapshot, and the kept
    # tokens its next rows fed again (what rejections cost there beyond the drafted tokens)
    state_restores: int = 0
    refeed_tokens: int = 0
    chained_steps: int = 0  # decode steps issued before the one they continue came back (cluster/engine.py)


class Scheduler:
    """Who runs (sequence slots, lanes, KV blocks), what each step feeds, and when a request is done."""

    def __init__(self, config: EngineConfig, eos_ids: Sequence[int] = (), n_blocks: int | None = None,
                 checkpoints: CheckpointLedger | None = None, speculation: Optional[Speculation] = None,
                 spares: CheckpointLedger | None = None, host_blocks: int = 0):
        """`checkpoints`: a hybrid model's recurrent-state checkpoints (prefix reuse then resumes
        only where one of them holds the state); None: a model without recurrent layers.
        `spares`: a hybrid model's ledger of state slots that verify rows borrow a spare from (the
        checkpoint ledger itself, or one over the same slots when prefix reuse is off); None: a
        model without recurrent layers, whose drafts need no snapshot. `host_blocks`: the blocks
        each stage's host tier holds (cluster/kv_blocks.py HostTier; 0: none)."""
        self.config = config
        self.checkpoints = checkpoints
        self.spares = spares if spares is not None else checkpoints
        self.speculation = speculation  # None: no drafts (the pipeline cannot verify them, or speculation is off)
        if n_blocks is None and config.max_len is None:
            raise MoerayError("an engine needs a KV budget: kv_blocks, or max_len (max_seqs sequences of it)")
        # Without a plan's budget, blocks for max_seqs sequences of max_len: what a slab held.
        self.host_blocks = host_blocks  # the stages' host tier, in blocks (0: none)
        self.blocks = BlockManager(n_blocks or config.max_seqs * blocks_for(config.max_len), config.prefix_reuse,
                                   host_blocks)
        # Give each sequence the blocks of its whole output at admission (never grow, never preempt):
        # for the one-shot Generator, whose pool is sized for exactly its prompts. Equal sequences then
        # hold consecutive, equally spaced blocks, which attention reads as one view.
        self.reserve_output = False
        self.eos_ids = frozenset(eos_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Each lane owns a contiguous range of KV slots, and a micro-batch lists its slots in
        # order: a lane whose requests hold neighbouring slots reads the KV cache as one view.
        m, n = config.micro_batches, config.max_seqs
        self.lane_slots = [list(range(lane * n // m, (lane + 1) * n // m)) for lane in range(m)]
        self._steps = itertools.count()
        self._admissions = itertools.count()
        self.stats = EngineStats()
        self.ended: list[int] = []  # slots freed since the last step: the next step tells the last stage

    @property
    def n_free_slots(self) -> int:
        return sum(len(s) for s in self.lane_slots)

    @property
    def kv_tokens(self) -> int:
        """Tokens the KV pool holds at most: the longest sequence that can run."""
        return self.blocks.n_blocks * BLOCK_SIZE

    def admit(self) -> None:
        """Waiting requests, in order, take a free slot (in the lane with the most room) and the
        blocks of their prompt, reusing the cached blocks of its longest known prefix, and the
        rows of a written block that go on with it (copied into its own block by the stages)."""
        bm = self.blocks
        while self.waiting and any(self.lane_slots):
            req = self.waiting[0]
            if not req.prefill:
                req.prefill = list(req.prompt)
            shared, wait = bm.match_prefix(req.prefill)
            hosted = [] if wait else bm.match_host(req.prefill, len(shared))  # ... and on in the host tier
            restore = None
            if self.checkpoints is not None:  # recurrent layers: as far as a checkpoint holds their state
                b, restore = self.checkpoints.find(bm.prefix_hashes(req.prefill, len(shared) + len(hosted)))
                shared, hosted = shared[:b], hosted[:max(0, b - len(shared))]
                wait = False  # a prefix still being computed leaves no checkpoint to wait for
            if wait:  # a running request is computing the rest of this prefix: reuse it when written
                return
            bm.take_shared(shared)  # before allocating: a matched cached block must not be evicted
            for slot in hosted:  # ... nor a host slot it will load
                bm.host.take(slot)
            reused = len(shared) + len(hosted)
            src, n_copy = bm.match_tail(req.prefill, reused) if self.checkpoints is None else (None, 0)
            tail, n_tail = (None, 0)  # ... else the tail the host tier keeps, loaded into a block of its own
            if src is None and self.checkpoints is None:
                tail, n_tail = bm.match_host_tail(req.prefill, reused)
                if tail is not None:
                    bm.host.take(tail)
            total = len(req.prompt) + req.max_new if self.reserve_output else len(req.prefill) + 1
            need = blocks_for(total) - len(shared)  # + the first output token
            # A tail block right after the shared prefix that no one holds is taken as it is: no
            # copy, and the sequence's blocks stay consecutive (read as a view, cluster/kv_blocks.py).
            # Only a tail (a finished sequence's partly filled last block): a full block still names
            # a prefix other prompts find (a prompt sent again), so its rows are copied instead.
            steal = (src is not None and not hosted and need <= bm.n_available and bm.ref[src] == 0
                     and (not shared or src == shared[-1] + 1) and bm.is_tail(src))
            if steal:
                bm.steal(src)
                held, first = shared, [src]
            else:
                held, first = shared + ([src] if src is not None else []), []  # the source too, until copied
                bm.take_shared(held[len(shared):])
            run = None
            # A prefix that cannot go on in place is copied into a stretch of its own, where the
            # sequence will decode alone: a step of several sequences reads a view only where they
            # lie equally spaced, so beside others the copy would buy nothing but spent blocks.
            if (not steal and shared and not hosted and tail is None and not self.running
                    and not (consecutive(shared) and bm.free_after(shared[-1], need))):
                whole = blocks_for(len(req.prompt) + req.max_new)  # room to grow on in place
                run = bm.free_run(len(shared) + need, max(whole, len(shared) + need))
            if run is not None:  # the prefix's rows copied into a stretch of its own: read as a view
                bm.take(run)
                own = run[len(shared):]
            else:
                last = first[-1] if first else shared[-1] if shared else None
                rest = bm.allocate(need - len(first), after=last)
                own = None if rest is None else first + rest
            if own is None:  # wait for blocks; first come, first served
                bm.release(held + first)
                for slot in hosted + ([tail] if tail is not None else []):
                    bm.host.release(slot)
                return
            self.waiting.popleft()
            req.table = shared + own if run is None else run
            req.fed = req.kv_len = reused * BLOCK_SIZE + n_copy + n_tail
            req.copy = (src, own[len(hosted)], n_copy) if src is not None and not steal and run is None else None
            if run is not None:
                req.moves = [(b, run[i], BLOCK_SIZE) for i, b in enumerate(shared)]
                if src is not None:
                    req.moves.append((src, own[0], n_copy))
                req.renamed = bm.rename(req.moves)
            req.loads = list(zip(hosted, own))
            req.tail_load = (tail, own[len(hosted)], n_tail) if tail is not None else None
            if hosted or tail is not None:
                bm.host.stats.hits += len(hosted) + (tail is not None)
                bm.host.stats.hit_tokens += len(hosted) * BLOCK_SIZE + n_tail
            if restore is not None:  # held until the step that copies it is handed out
                self.checkpoints.take(restore)
                self.checkpoints.stats.restored += 1
                self.checkpoints.stats.restored_tokens += len(shared) * BLOCK_SIZE
            req.restore = restore
            if self.checkpoints is not None:  # the prompt's last full block before its final token
                at = (len(req.prefill) - 1) // BLOCK_SIZE * BLOCK_SIZE
                req.checkpoint_at = at if at > req.fed else None
            # Its prompt's full blocks can be found from now on; pending until a step writes them.
            bm.register(req.table, req.prefill, len(req.prefill) // BLOCK_SIZE, len(shared), pending=True)
            if req.preemptions == 0:
                req.cached_tokens = req.fed
                bm.stats.prompt_tokens += len(req.prompt)
                bm.stats.cached_tokens += req.fed
            req.lane = max(range(len(self.lane_slots)), key=lambda lane: len(self.lane_slots[lane]))
            free = self.lane_slots[req.lane]
            req.slot = free.pop(free.index(min(free)))
            req.status, req.fresh = RequestStatus.RUNNING, True
            req.t_admit = next(self._admissions)
            if req.t_admitted is None:  # its queue time ends at its first admission
                req.t_admitted = time.perf_counter()
            if req.timeline is not None:
                req.timeline.mark("admitted")
            if req.spec is None and self.speculation is not None and self.speculation.wants(req.params):
                req.spec = self.speculation.start(req.prompt + req.output)
            self.running.append(req)

    def _grow(self, req: Request, chosen: list[Request]) -> bool:
        """Room for one more token of `req`: a new block when its table is full, preempting the
        youngest sequence that is not in a step (possibly `req` itself) while none is free.
        False: `req` cannot decode this step (it was preempted, or every other sequence is busy)."""
        bm = self.blocks
        while len(req.table) * BLOCK_SIZE <= req.kv_len:
            got = bm.allocate(1, after=req.table[-1] if req.table else None)
            if got is not None:
                req.table += got
                return True
            idle = [r for r in self.running if not r.busy and not r.done and r not in chosen]
            if not idle:
                return False
            victim = max(idle, key=lambda r: r.t_admit)
            self.preempt(victim)
            if victim is req:
                return False
        return True

    def preempt(self, req: Request) -> None:
        """Free a running sequence's blocks and put it first in line to be prefilled again, prompt
        and output so far (a cached prefix of it may survive and be reused)."""
        prefill = req.prompt + req.output
        self._drop_copy(req)
        # Its blocks hold exactly the prefix of prompt + output, whatever fed them: name them.
        self.blocks.register_written(req.table, prefill, req.kv_len)
        self.blocks.release(req.table)
        self.running.remove(req)
        self.lane_slots[req.lane].append(req.slot)
        self.ended.append(req.slot)
        req.table, req.prefill, req.fed, req.kv_len = [], prefill, 0, 0
        req.status, req.slot, req.lane = RequestStatus.WAITING, -1, -1
        req.preemptions += 1
        self.stats.preemptions += 1
        self.blocks.stats.preemptions += 1
        self.waiting.appendleft(req)

    def schedule(self, lane: int) -> Optional[ScheduledStep]:
        """The lane's next step: decodes first (what users wait on between tokens), then prompt
        chunks, within the token budget. None when the lane has nothing to run."""
        budget, chunk = self.config.token_budget, self.config.prefill_chunk
        if not any(r.fed == len(r.prefill) for r in self.running if not r.done):  # no one decodes
            budget, chunk = max(budget, self.config.prefill_alone), max(chunk, self.config.prefill_alone)
        members = [r for r in self.running if r.lane == lane and not r.busy and not r.done]
        rows, chosen, before, after = [], [], [], []
        for r in members:
            if r.status is RequestStatus.RUNNING and r.fed == len(r.prefill) and budget >= 1 and self._grow(r, chosen):
                # After a rejected draft (hybrid): the state before the verify row is copied back
                # and the row feeds the kept tokens again with the new one, so the recurrent state
                # ends where a plain decode's does (attention rewrites the same KV there).
                n = r.refeed
                row = Row(r, r.output[-1 - n:], r.kv_len - n, fresh=False, sample=True, no_draft=n > 0)
                if n:
                    before.append((r.spare, r.slot))
                    self.spares.release(r.spare)  # its copy is handed out: later steps may overwrite it
                    r.spare, r.refeed = None, 0
                    self.stats.state_restores += 1
                    self.stats.refeed_tokens += n
                rows.append(row)
                chosen.append(r)
                r.kv_len += 1
                budget -= 1 + n  # may go below 0: a re-fed row never waits, the chunks and drafts do
                if self.checkpoints is not None and r.kv_len % BLOCK_SIZE == 0:  # a block boundary crossed
                    self._checkpoint(r, r.prompt + r.output, after)
                    row.no_draft = True
        n_decode = len(rows)
        copies, loads = [], []
        for r in members:
            if r.status is RequestStatus.RUNNING and r.fed < len(r.prefill) and budget >= 1:
                if r.loads:  # its first chunk: the stages load its blocks from their host tier first
                    loads += r.loads
                    for slot, _ in r.loads:
                        self.blocks.host.release(slot)
                    first = r.table.index(r.loads[0][1])  # they follow the blocks it shares on the device
                    self.blocks.written(r.table, first, first + len(r.loads))
                    r.loads = []
                if r.tail_load is not None:  # ... and the tail after them (this chunk writes the rest of its block)
                    slot, block, _ = r.tail_load
                    loads.append((slot, block))
                    self.blocks.host.release(slot)
                    r.tail_load = None
                if r.copy is not None:  # its first chunk: the stages copy the reused rows first
                    copies.append(r.copy)
                    self.blocks.release([r.copy[0]])  # later steps may write it: they run after this one
                    r.copy = None
                if r.moves:  # ... or its whole reused prefix, into its own stretch (named there now)
                    copies += r.moves
                    self.blocks.release([src for src, _, _ in r.moves])
                    self.blocks.written(r.table, 0, r.renamed)
                    r.moves = []
                if r.restore is not None:  # ... and its checkpointed state into its slot
                    before.append((r.restore, r.slot))
                    self.checkpoints.release(r.restore)
                    r.restore = None
                n = min(chunk, len(r.prefill) - r.fed, budget)
                if r.checkpoint_at is not None and r.fed < r.checkpoint_at <= r.fed + n:
                    n = r.checkpoint_at - r.fed  # the chunk ends at the boundary: its state is checkpointed
                    r.checkpoint_at = None
                    self._checkpoint(r, r.prefill[:r.fed + n], after, keep=False)
                elif (self.checkpoints is not None and r.fed + n == len(r.prefill)
                      and (r.fed + n) % BLOCK_SIZE == 0):
                    # The prompt ends on a block boundary: its state there is the sequence's first
                    # rolling checkpoint (as a decode step's boundary is), so a next turn that
                    # begins with this prompt and an answer shorter than a block resumes here.
                    self._checkpoint(r, r.prefill[:r.fed + n], after)
                rows.append(Row(r, r.prefill[r.fed:r.fed + n], r.fed, fresh=r.fresh,
                                sample=r.fed + n == len(r.prefill)))
                # This chunk's full blocks are written by this step: the stages run steps in the
                # order they are handed out, so any later step may read them.
                self.blocks.written(r.table, r.fed // BLOCK_SIZE, (r.fed + n) // BLOCK_SIZE)
                r.fed += n
                r.kv_len, r.fresh = r.fed, False
                budget -= n
        if not rows:
            return None
        if self.speculation is not None and self.speculation.mtp:
            for row in rows:  # rows that emit a token: the MTP layer's proposals after it, where drafting
                r = row.req
                if row.sample and r.spec is not None:
                    row.mtp_k = self.speculation.mtp_length(r.spec, r.max_new - len(r.output))
        self.stats.decode_tokens += n_decode
        self.stats.prefill_tokens += sum(len(row.tokens) for row in rows) - n_decode
        if self.speculation is not None and budget >= 1 and n_decode:
            self._add_drafts(rows[:n_decode], sum(len(row.tokens) for row in rows), budget, before, after)
        rows.sort(key=lambda row: row.req.slot)
        for row in rows:
            row.req.in_flight += 1
        spec = self.speculation
        ended, self.ended = self.ended, []
        return ScheduledStep(next(self._steps), lane, rows, copies, self.blocks.take_saves(), loads, before, after,
                             draft_model=spec is not None and spec.draft_model, mtp=spec is not None and spec.mtp,
                             ended=ended)

    def continue_decode(self, step: ScheduledStep) -> Optional[ScheduledStep]:
        """The step after `step`, issued before `step` comes back (a chained decode: its tokens come
        from the last stage itself, StepBatch.looped): the same sequences one token on, those that
        are not done and whose next token is within max_tokens. None when no row is left, or the
        KV pool has no free block for a row that needs one (no one is preempted for it)."""
        rows = [r.req for r in step.rows
                if not r.req.done and len(r.req.output) + r.req.in_flight < r.req.max_new]
        if not rows or self.checkpoints is not None or self.spares is not None:
            return None
        need = [r for r in rows if len(r.table) * BLOCK_SIZE <= r.kv_len]
        if need:
            if len(need) > self.blocks.n_available:
                return None
            for r in need:  # each the block after its own last where that one is free
                r.table += self.blocks.allocate(1, after=r.table[-1] if r.table else None)
        out = []
        for r in rows:
            out.append(Row(r, [LOOPED], r.kv_len, fresh=False, sample=True))
            r.kv_len += 1
            r.in_flight += 1
        self.stats.decode_tokens += len(out)
        self.stats.chained_steps += 1
        ended, self.ended = self.ended, []
        # a block taken here may have pushed a cached one out: the step carries its save to the host tier
        return ScheduledStep(next(self._steps), step.lane, out, kv_save=self.blocks.take_saves(), ended=ended,
                             chained=True)

    def _add_drafts(self, decode_rows: list[Row], n_plain: int, budget: int, before: list,
                    after: list) -> None:
        """Drafted tokens after the decode rows' last tokens, as many as the step's price says pay
        (cluster/speculation.py), each taking KV room it can get without preempting anyone. On a
        hybrid model each verify row also takes a spare state slot, its sequence's state copied
        into it before the step; a row that gets none runs plain (k = 0)."""
        rows = [row for row in decode_rows if row.req.spec is not None]
        if self.spares is not None:
            rows = [row for row in rows if not row.no_draft]
        if not rows:
            return
        free_rows = self.blocks.n_available * BLOCK_SIZE
        room = [max(0, min(r.req.max_new - len(r.req.output) - 1,  # the verify row adds one token of its own
                           len(r.req.table) * BLOCK_SIZE - r.req.kv_len + free_rows)) for r in rows]
        lengths = self.speculation.plan([r.req.spec for r in rows], room, n_plain, len(decode_rows), budget)
        for row, k in zip(rows, lengths):
            req = row.req
            if k <= 0:
                continue
            spare = None
            if self.spares is not None:
                spare = self.spares.borrow(avoid={dst for _, dst in after})
                if spare is None:  # every spare slot is held: plain decode this step
                    continue
            need = blocks_for(req.kv_len + k) - len(req.table)
            if need > 0:
                got = self.blocks.allocate(need, after=req.table[-1] if req.table else None)
                if got is None:
                    if spare is not None:
                        self.spares.release(spare)
                    continue
                req.table += got
            if spare is not None:  # the state before the row, restored should a draft be refused
                before.append((req.slot, spare))
                req.spare = spare
            if req.spec.kind == "draft":  # the first stage's draft model fills these in
                row.draft, row.model_k = [0] * k, k
            elif req.spec.kind == "mtp":  # what the last stage's MTP layer proposed after the last token
                row.draft = req.spec.proposal[:k]
            else:
                row.draft = req.spec.draft.tokens[:k]
            row.tokens = row.tokens + row.draft
            req.kv_len += k
            self.stats.draft_tokens += k

    def _checkpoint(self, req: Request, tokens: list[int], after: list, keep: bool = True) -> None:
        """The state of `req` after this step, whose row ends exactly at the block boundary
        len(tokens), into a checkpoint named by that prefix: the sequence's own rolling slot
        (`keep`: a decode boundary, overwritten at the next) or a slot left to the cache (the
        prompt's end)."""
        h = self.blocks.prefix_hashes(tokens, len(tokens) // BLOCK_SIZE)[-1]
        slot = self.checkpoints.save(h, req.rolling if keep else None)
        if slot is None:
            return
        if keep and req.rolling is None:
            self.checkpoints.take(slot)
        if keep:
            req.rolling = slot
        after.append((req.slot, slot))

    def postprocess(self, step: ScheduledStep, result: StepOutput) -> None:
        """Hand each row its sampled token (and its log-probabilities) and apply the finish rules.
        A verify row (a draft after its last token) gets the accepted drafts and one more token:
        they are appended under the same rules, so a sequence ends exactly where a plain decode
        would (an end token, a stop string or max_tokens inside the accepted run), and the KV of
        every position past its last kept token goes back (its blocks returned to the pool)."""
        self.stats.steps += 1
        now = time.perf_counter()
        logprobs = result.logprobs or [None] * len(result.tokens)
        proposals = result.proposals or [None] * len(result.tokens)
        for row, tok, lp, proposal in zip(step.rows, result.tokens, logprobs, proposals):
            req = row.req
            req.in_flight -= 1
            if req.spec is not None:  # the MTP layer's next draft: for the sequence's next row only
                req.spec.proposal = proposal or []
            if row.draft:  # until the verdict, only the row's first token is the sequence's
                req.kv_len = row.start + 1
            if req.done:  # finished or aborted while this step was in flight: the slot is free once none is
                if not req.in_flight:
                    self._release(req)
            elif tok is None:  # the row was a prompt chunk with more to come
                continue
            elif row.draft:
                self._append_verified(row, tok if isinstance(tok, list) else [tok],
                                      lp if isinstance(lp, list) else [lp], now)
            else:
                self._append(req, [tok], [lp], now)

    def _append_verified(self, row: Row, toks: list[int], lps: list, now: float) -> None:
        req = row.req
        n = self._append(req, toks, lps + [None] * (len(toks) - len(lps)), now)
        req.kv_len = row.start + n  # the KV holds the row's first token and the drafts kept
        self.speculation.observe(req.spec, len(row.draft), len(toks) - 1, n)
        self.stats.accepted_tokens += len(toks) - 1
        if req.spare is not None and not req.done:
            if len(toks) - 1 == len(row.draft):  # every draft kept: the state is the plain decode's
                self.spares.release(req.spare)
                req.spare = None
            else:  # its state absorbed refused tokens: the next row restores the snapshot, re-feeds
                req.refeed = req.kv_len - row.start
        if not req.done and not self.reserve_output:
            keep = blocks_for(req.kv_len)
            if len(req.table) > keep:  # the rejected positions' blocks go back
                self.blocks.release(req.table[keep:])
                del req.table[keep:]

    def _append(self, req: Request, toks: list[int], lps: list, now: float) -> int:
        """A row's new tokens (one, or a verify row's accepted drafts and one more) under the finish
        rules, in their order per token: an end token ends it ("stop", the token is output but not
        text), else a stop string completed by the token ("stop", the text ends before it), else
        max_tokens ("length"). The text of the kept tokens is decoded and matched in one pass.
        Returns how many tokens the sequence kept."""
        if req.t_first is None:
            req.t_first = now
        eos = self.eos_ids if not req.params.ignore_eos else ()
        room = req.max_new - len(req.output)
        n, reason = len(toks), None
        for j, tok in enumerate(toks):  # the end token and the length, before any text
            if tok in eos:
                n, reason = j + 1, "eos"
                break
            if j + 1 >= room:
                n, reason = j + 1, "length"
                break
        detok = req.detok
        if detok is not None:
            text_toks = toks[:n - 1] if reason == "eos" else toks[:n]
            if text_toks:
                taken, _ = detok.push_many(text_toks)
                if detok.stopped:  # a stop string: the sequence ends on the token completing it
                    n, reason = taken, "stop string"
        kept = toks[:n]
        req.output.extend(kept)
        if req.spec is not None:
            req.spec.drafter.extend(kept)
        if lps[0] is not None:
            req.logprobs.extend(lp for lp in lps[:n] if lp is not None)
        if reason is None:
            return n
        if detok is not None and reason != "stop string":
            detok.finish()  # the end token itself is not text; at the length, what was held back goes out
        self.finish(req, "length" if reason == "length" else "stop")
        return n

    def finish(self, req: Request, reason: str) -> None:
        req.status, req.finish_reason, req.t_done = RequestStatus.FINISHED, reason, time.perf_counter()
        if not req.in_flight:
            self._release(req)

    def abort(self, req: Request) -> None:
        if req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        if not req.done:
            self.finish(req, "abort")

    def resize_kv(self, n_blocks: int) -> None:
        """The stages were re-planned with a pool of `n_blocks` blocks (no request runs: they failed
        with the stages). Waiting requests that no longer fit fail with the reason; the others get
        an output cap within the new pool."""
        self.blocks = BlockManager(n_blocks, self.config.prefix_reuse, self.host_blocks)
        if self.checkpoints is not None:
            self.checkpoints.forget_all()
        limit = min(self.config.max_len or self.kv_tokens, self.kv_tokens)
        for req in list(self.waiting):
            room = limit - len(req.prompt) - len(req.output)
            if room < 1:
                self.waiting.remove(req)
                req.status, req.t_done = RequestStatus.FAILED, time.perf_counter()
                req.error = (f"after a re-plan the KV cache holds {self.kv_tokens} tokens, which leaves no room "
                             f"for this prompt of {len(req.prompt)} tokens")
            else:
                req.max_new = min(req.max_new, len(req.output) + room)

    def fail_running(self, message: str) -> None:
        """Every running request lost its KV state; waiting ones are untouched."""
        for req in list(self.running):
            req.status, req.error, req.in_flight, req.t_done = RequestStatus.FAILED, message, 0, time.perf_counter()
            self._release(req)
        self.blocks.forget_all()  # a restarted stage holds no KV: no cached prefix is valid
        if self.checkpoints is not None:  # ... and no state
            self.checkpoints.forget_all()

    def fail_step(self, step: ScheduledStep, message: str) -> None:
        """A step that raised before it came back: its requests fail with `message`, their slots and
        blocks go back, and blocks it may have half written are forgotten (no prefix finds them)."""
        now = time.perf_counter()
        for row in step.rows:
            req = row.req
            req.in_flight = max(req.in_flight - 1, 0)
            if req not in self.running:
                continue
            table = list(req.table)
            if not req.done:  # (one aborted while its step ran is done already)
                req.status, req.error, req.t_done = RequestStatus.FAILED, message, now
            req.kv_len = 0  # nothing it holds is to be read again
            self._release(req)
            self.blocks.forget(table)

    def _release(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
            self.lane_slots[req.lane].append(req.slot)
            self.ended.append(req.slot)
            self._drop_copy(req)
            # Its blocks (prompt and output) stay findable until they are needed.
            self.blocks.register_written(req.table, req.prompt + req.output, req.kv_len)
            self.blocks.release(req.table)
            req.table = []

    def _drop_state(self, req: Request) -> None:
        """A sequence leaves: the checkpoint it was to restore and its rolling one go back (the
        rolling one stays findable until evicted)."""
        for name in ("restore", "rolling"):
            slot = getattr(req, name)
            if slot is not None:
                self.checkpoints.release(slot)
                setattr(req, name, None)
        req.checkpoint_at = None

    def _drop_copy(self, req: Request) -> None:
        """A sequence leaves before its first chunk was handed out: the rows it was to copy were
        never written into its block; the source it held goes back."""
        if req.copy is not None:
            src, _, n = req.copy
            req.fed -= n
            req.kv_len -= n
            self.blocks.release([src])
            req.copy = None
        if req.moves:  # ... nor its prefix into its own stretch
            n = sum(rows for _, _, rows in req.moves)
            req.fed -= n
            req.kv_len -= n
            self.blocks.release([src for src, _, _ in req.moves])
            req.moves = []
        if req.loads:  # ... nor the blocks it was to load from the host tier
            for slot, _ in req.loads:
                self.blocks.host.release(slot)
            req.fed -= len(req.loads) * BLOCK_SIZE
            req.kv_len -= len(req.loads) * BLOCK_SIZE
            req.loads = []
        if req.tail_load is not None:
            slot, _, n = req.tail_load
            self.blocks.host.release(slot)
            req.fed -= n
            req.kv_len -= n
            req.tail_load = None
        if self.checkpoints is not None:
            self._drop_state(req)
        if req.spare is not None:  # a snapshot no row will restore (a re-prefill rebuilds the state)
            self.spares.release(req.spare)
            req.spare, req.refeed = None, 0
