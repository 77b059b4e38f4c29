"""StageActor: one pipeline stage, one device, one Ray actor.

Life of a stage:
  1. `probe(path)`      before any weight is loaded: the device (name, total/free bytes, node),
                         the measured ms per dense layer and per missed expert at the model's real
                         dimensions (a layer whose files are on this node), and which of the
                         model's files (parts) are here.
  2. `connect(...)`     join the stages' process group (activations go stage to stage over it).
  3. `check_parts(...)` once planned: the size and sampled hash of each file its layers need, as
                         this node sees it (the driver compares the nodes and names what is missing).
  4. `load(...)`        load only layers [first, end) (+ embedding / head), mapping only the files
                         holding them, and allocate the KV pool.
  5. `step(batch)`      run one micro-batch through this stage's layers (StageRunner).

The driver hands each call the model's header (metadata and every part's tensor directory, as it
read them): a node needs only the files its stage reads, not the others' headers. It computes as
the StageOptions it is constructed with say (stages/kernels/settings.py: backend, threads,
layouts, graphs): the driver's, sent to every stage whatever node it runs on. Its own environment
is never read; `options()` reports what it runs with.

The class is plain Python; the driver wraps it with `ray.remote` when it spawns stages, so
unit tests can also drive it in-process. What it reports (ProbeReport, LoadReport, StageStats)
are dataclasses: the driver reads fields, the HTTP API turns them into JSON at its edge.
"""
from __future__ import annotations

import hashlib
import os
import time
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any, Optional

from moeray.stages.kernels.settings import StageOptions
from moeray.stages.runtime.device import DeviceInfo, device_ledger, measure_speed, probe_device
from moeray.errors import MoerayError

if TYPE_CHECKING:
    from moeray.stages.text.sampling import SamplingParams


@dataclass(kw_only=True)
class StepBatch:
    """One micro-batch of one engine step, as a stage sees it: one entry per sequence in each list,
    built by keyword (cluster/scheduler.py ScheduledStep.batch).

    Every stage gets the same slots, token counts, start positions and KV block tables (the engine
    owns the block accounting; stages/blocks/kv_cache.py); only stage 0 gets the token ids and only the
    last stage the sampling params and the token histories its penalties read.
    """
    step_id: int
    slots: list[int]
    n_new: list[int]  # new tokens per sequence: a prefill chunk or 1
    fresh: list[bool]  # this chunk starts a new sequence in its slot: reset KV and sampler first
    tokens: list[list[int]] | None = None  # stage 0 only
    sample: list[SamplingParams | None] | None = None  # last stage only; None: no token wanted yet
    starts: list[int] | None = None  # tokens each sequence holds in KV before this step
    tables: list[list[int]] | None = None  # each sequence's KV blocks, at least up to its last new token
    # (block, block, rows): copy the first rows of a written block into another before the step (a
    # prompt that goes on with tokens another sequence wrote: cluster/kv_blocks.py, match_tail)
    copies: list[tuple[int, int, int]] | None = None
    # (slot, slot): recurrent state copied from one state slot into another, every recurrent layer
    # of the stage, before the step (a checkpoint restored into a sequence's slot) and after it (a
    # sequence's state at a block boundary checkpointed): cluster/state_checkpoints.py
    state_before: list[tuple[int, int]] | None = None
    state_after: list[tuple[int, int]] | None = None
    # last stage only: (prompt, output so far) of a sequence starting in its slot whose params have
    # penalties (SamplingParams.needs_history), else None; the stage then counts what it samples
    history: list[tuple[list[int], list[int]] | None] | None = None
    # Last stage only: per sequence, the drafted tokens its row carries after its last token (a
    # verify row: stages/text/verify.py); [] for a plain row; None when no row carries one.
    drafts: list[list[int]] | None = None
    # First and last stage, with a draft model (stages/runtime/draft_model.py): per sequence, the
    # tokens it drafts into its row (placeholders in `tokens` and `drafts` until the first stage
    # drafts them), 0 for a row it only mirrors, -1 for a sequence it does not serve; None: none.
    draft_k: list[int] | None = None
    # Last stage only, with a next-token-prediction layer (stages/runtime/mtp.py): per sequence, the
    # tokens it proposes for the row's next step (0: none, its KV still kept); None: no such layer.
    # The last stage then gets the token ids too (the layer reads them).
    mtp_k: list[int] | None = None

    def for_stage(self, stage: int, n_stages: int) -> "StepBatch":
        last = stage == n_stages - 1
        return replace(self, tokens=self.tokens if stage == 0 or (last and self.mtp_k is not None) else None,
                       sample=self.sample if last else None,
                       history=self.history if last else None, drafts=self.drafts if last else None,
                       draft_k=self.draft_k if stage == 0 or last else None, mtp_k=self.mtp_k if last else None)

    def model_drafted(self, drafts: list[list[int]]) -> "StepBatch":
        """This step with the draft model's tokens in its rows (placeholders replaced): in the token
        ids the first stage embeds and in the drafts the last stage verifies."""
        k = self.draft_k or [0] * len(self.slots)
        tokens = None if self.tokens is None else [
            [t[0]] + d if n > 0 else t for t, d, n in zip(self.tokens, drafts, k)]
        verified = None if self.drafts is None else [
            d if n > 0 else v for v, d, n in zip(self.drafts, drafts, k)]
        return replace(self, tokens=tokens, drafts=verified)


@dataclass(frozen=True)
class FileFingerprint:
    size: int
    sha256_sampled: str


@dataclass
class ProbeReport:
    """What a stage tells the planner before any weight is loaded."""
    stage: int
    pid: int
    device: DeviceInfo
    layer_ms: float  # measured ms per dense layer at the model's dimensions
    miss_ms: float  # measured ms per expert computed from the host copy
    measure_s: float
    parts_here: list[int] = field(default_factory=list)  # the model's files (parts) complete on this node
    # host memory this node offers state checkpoints (planner/kv.py host_checkpoint_room), shared by its stages
    host_checkpoint_bytes: int = 0


@dataclass
class LoadReport:
    stage: int
    layers: tuple[int, int]  # [first, end)
    load_s: float
    placed: dict[str, int]  # device bytes by what holds them (KV pool, trunk, expert cache)
    free_bytes: int  # left on the device after loading
    host_resident_bytes: int
    cache_slots: int = 0
    cache_resident: int = 0
    draft_token_ms: float = 0.0  # the first stage's draft model: ms of one drafted token (0: none)
    mtp_token_ms: float = 0.0  # the last stage's next-token-prediction layer: ms of one proposed token


@dataclass
class StageStats:
    """A stage's live numbers; `cache` is its expert cache's own report (None: no cache)."""
    stage: int
    device: str
    node_ip: str
    layers: Optional[tuple[int, int]] = None  # None before load
    placed: dict[str, int] = field(default_factory=dict)
    free_bytes: int = 0
    steps: int = 0
    step_s: float = 0.0  # time in steps, incl. waiting for the previous stage's activations
    tokens_in: int = 0
    backend: str = ""  # the kernels the stage runs: ggml | dequant | exact
    options: dict = field(default_factory=dict)  # the StageOptions it runs with, as `StageActor.options()`
    trunk_held_bytes: int = 0  # what the trunk really holds on the device ...
    trunk_gguf_bytes: int = 0  # ... and the same tensors' bytes in the GGUF
    cache: Optional[dict[str, Any]] = None
    kv: Optional[dict[str, Any]] = None  # the KV pool: blocks, bytes (the engine adds used/free: it owns the ledger)
    predicted_hit_rate: Optional[float] = None  # the plan's, set by the driver: shown beside cache["hit_rate"]
    pid: int = 0  # the stage's process (bench/chaos.py kills it)
    node_id: str = ""  # its Ray node
    parts_opened: list[int] = field(default_factory=list)  # the model's files (parts) this stage mapped


def file_fingerprint(path: str, n_samples: int = 16, block: int = 1 << 16) -> FileFingerprint:
    """Size and a sampled sha256 (head, tail and evenly spaced blocks) of a file.

    A full hash of a 100 GB model would take minutes per node; sampled blocks catch a
    different file, a different quantisation, and a truncated or partial copy.
    """
    size = os.path.getsize(path)
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        offsets = sorted({0, max(0, size - block), *(i * size // n_samples for i in range(n_samples))})
        for off in offsets:
            f.seek(off)
            h.update(f.read(block))
    return FileFingerprint(size, h.hexdigest())


def parts_here(header) -> list[int]:
    """The model's files (0-based parts) present here at full length (a cheap stat each)."""
    return [p.index for p in header.parts if os.path.exists(p.path) and os.path.getsize(p.path) >= p.data_end]


class StageRunner:
    """One stage's compute over its model and KV pool: start a micro-batch (new sequences get a new
    sampler; positions and KV rows from the batch's starts and block tables), run the layers, and,
    on the last stage, sample one token per sequence that wants one. StageActor runs it between a
    receive and a send; a one-process pipeline (moeray generate) runs the whole model with it."""

    def __init__(self, model, kv):
        self.model, self.kv = model, kv  # kv: a KVPool
        self.drafter = None  # the first stage's draft model (stages/runtime/draft_model.py), if any
        self.mtp = None  # the last stage's next-token-prediction layer (stages/runtime/mtp.py), if any
        self.generators: dict[int, Any] = {}  # slot -> the torch.Generator of its sequence
        self.grammars = None  # stages/grammar.GrammarMasks, made on the first constrained request
        # slot -> its sequence's TokenHistory (penalties), or the (prompt, output) it is built from
        # on the sequence's first sampled row (where the vocabulary and the device are known)
        self.histories: dict[int, Any] = {}

    def begin(self, batch: StepBatch):
        for i, (slot, fresh) in enumerate(zip(batch.slots, batch.fresh)):
            if fresh:  # a new sequence in this slot: a sampler from its own seed
                self.generators.pop(slot, None)
                self.histories.pop(slot, None)
                if batch.history is not None and batch.history[i] is not None:
                    self.histories[slot] = batch.history[i]
                if self.grammars is not None:
                    self.grammars.reset(slot)
                if self.mtp is not None:
                    self.mtp.reset(slot)
        if batch.starts is None or batch.tables is None:
            raise MoerayError("a step needs its sequences' start positions and KV block tables")
        if batch.copies:  # every pool addressed by the tables: the target's, a draft model's, the MTP layer's
            for pool in (self.kv, getattr(self.drafter, "kv", None), getattr(self.mtp, "kv", None)):
                if pool is not None:
                    pool.copy_rows(batch.copies)
        return self.model.table_meta(batch.n_new, batch.starts, batch.tables, self.kv, batch.slots,
                                     state_before=batch.state_before, state_after=batch.state_after)

    def layers(self, x, meta, batch: StepBatch | None = None):
        """The stage's layers over x. batch: on the last stage, the step's batch; then only the rows
        its head reads (head_rows) leave the last layer, and `sample` takes them as they are."""
        rows = None if batch is None else self.head_rows(batch, meta)
        return self.model.run_layers(x, meta, self.kv, rows)

    def head_rows(self, batch: StepBatch, meta) -> list[int] | None:
        """The packed rows the last stage's head reads this step, ascending: each sampling row's last
        position, every position of a verify row's drafts and its last token; None where every row
        is read (the next-token-prediction layer catches up on all of them). A step that samples
        nothing (a prompt's middle chunk) still keeps its last row: a graph needs one."""
        if self.mtp is not None and batch.mtp_k is not None:
            return None
        last = meta.last_index.tolist()
        rows = []
        for i, p in enumerate(batch.sample):
            if p is not None:
                k = len(batch.drafts[i]) if batch.drafts is not None and batch.drafts[i] else 0
                rows.extend(range(last[i] - k, last[i] + 1))
        if len(rows) == meta.n_tokens:  # a decode step in which every row samples: no gather to build
            return None
        return rows or [last[-1]]

    def sample(self, batch: StepBatch, x, meta):
        """The step's tokens (`_sample`) and, with a next-token-prediction layer, its KV kept up with
        the step and its proposals for each row's next step (StepOutput.proposals)."""
        result = self._sample(batch, x, meta)
        if self.mtp is None or batch.mtp_k is None:
            return result
        from moeray.stages.text.sampling import StepOutput

        out = StepOutput.of(result)
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

    def _sample(self, batch: StepBatch, x, meta):
        """A token per sequence whose params ask for one (its prompt is fully fed), else None; a
        StepOutput when some sequence asked for log-probabilities too. A sequence with a grammar
        samples only among the tokens its grammar allows next, from the same logits; one with
        penalties reads its TokenHistory, which counts each token it samples here. A verify row
        (batch.drafts: k drafted tokens after its last token) gets a list: the drafted tokens the
        target accepts and one of its own (stages/text/verify.py), with a log-probability each."""
        from moeray.stages.text.sampling import StepOutput, sample, token_logprobs

        want = [i for i, p in enumerate(batch.sample) if p is not None]
        out: list = [None] * len(batch.slots)
        if not want:
            return out
        drafts = batch.drafts
        if drafts is not None and any(drafts[i] for i in want):
            return self._verify(batch, x, meta, want)
        logits = self.model.head(self._rows(x, meta.last_index[want]))
        params = [batch.sample[i] for i in want]
        slots = [batch.slots[i] for i in want]
        histories = self._prepare(slots, params, logits)
        allowed = None
        if any(p.grammar for p in params):
            grammars = self._grammars(logits.shape[-1])
            allowed = [grammars.allowed(slot, p.grammar) if p.grammar else None for slot, p in zip(slots, params)]
        toks = sample(logits, params, [self.generators[slot] for slot in slots], allowed, histories)
        for i, slot, p, tok in zip(want, slots, params, toks):
            out[i] = tok
            if p.needs_history:
                self.histories[slot].add(tok)
        if allowed is not None:
            for slot, p, tok in zip(slots, params, toks):
                if p.grammar:
                    self.grammars.advance(slot, tok)
        if all(p.logprobs is None for p in params):
            return out
        logprobs = [None] * len(batch.slots)
        for row, (i, p, tok) in enumerate(zip(want, params, toks)):
            if p.logprobs is not None:
                logprobs[i] = token_logprobs(logits[row], tok, p.logprobs)
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
        from moeray.stages.text.sampling import TokenHistory

        for slot, p in zip(slots, params):
            if slot not in self.generators:
                self.generators[slot] = p.new_generator()
            if p.needs_history:
                if isinstance(self.histories.get(slot), tuple):  # its first sampled row: count what it holds
                    prompt, output = self.histories[slot]
                    self.histories[slot] = TokenHistory(logits.shape[-1], prompt, output, logits.device)
                elif slot not in self.histories:
                    raise MoerayError(f"slot {slot}: penalties asked for, but the sequence's tokens never came")
        return [self.histories.get(slot) for slot in slots] if any(p.needs_history for p in params) else None

    def _verify(self, batch: StepBatch, x, meta, want: list[int]):
        """A step with verify rows: every position of a verify row goes through the head (the
        target's distribution after each drafted token), one position of a plain row; each verify
        row's tokens are its accepted drafts and one more, each plain row's its sampled token."""
        import torch

        from moeray.stages.text.sampling import StepOutput, sample, token_logprobs
        from moeray.stages.text.verify import verify_row

        last = meta.last_index.tolist()
        index, spans = [], []
        for i in want:
            k = len(batch.drafts[i])
            spans.append((len(index), k + 1))
            index.extend(range(last[i] - k, last[i] + 1))
        logits = self.model.head(self._rows(x, torch.tensor(index, device=x.device)))
        out: list = [None] * len(batch.slots)
        logprobs: list = [None] * len(batch.slots)
        params = [batch.sample[i] for i in want]
        slots = [batch.slots[i] for i in want]
        histories = self._prepare(slots, params, logits) or [None] * len(want)
        grammars = self._grammars(logits.shape[-1]) if any(p.grammar for p in params) else None
        plain = [n for n, i in enumerate(want) if not batch.drafts[i]]
        if plain:  # the plain rows together, as a step without drafts samples them
            rows = [spans[n][0] for n in plain]
            ps, ss, hs = [params[n] for n in plain], [slots[n] for n in plain], [histories[n] for n in plain]
            allowed = ([grammars.allowed(s, p.grammar) if p.grammar else None for s, p in zip(ss, ps)]
                       if grammars is not None else None)
            toks = sample(logits[rows], ps, [self.generators[s] for s in ss], allowed,
                          hs if any(h is not None for h in hs) else None)
            for n, row, tok in zip(plain, rows, toks):
                out[want[n]] = tok
                self._took(slots[n], params[n], [tok], grammars)
                if params[n].logprobs is not None:
                    logprobs[want[n]] = token_logprobs(logits[row], tok, params[n].logprobs)
        for n, i in enumerate(want):
            draft = batch.drafts[i]
            if not draft:
                continue
            p, slot = params[n], slots[n]
            off, m = spans[n]
            rows = logits[off:off + m]
            masks = grammars.allowed_along(slot, p.grammar, draft) if p.grammar else None
            toks = verify_row(rows, draft, p, self.generators[slot], masks, histories[n])
            out[i] = toks
            self._took(slot, p, toks, grammars)
            if p.logprobs is not None:
                logprobs[i] = [token_logprobs(rows[j], tok, p.logprobs) for j, tok in enumerate(toks)]
        if all(batch.sample[i].logprobs is None for i in want):
            return out
        return StepOutput(out, logprobs)

    def _took(self, slot: int, params, tokens: list[int], grammars) -> None:
        """A sequence's new tokens: its grammar and its penalties' history move past them."""
        for tok in tokens:
            if params.grammar:
                grammars.advance(slot, tok)
            if params.needs_history:
                self.histories[slot].add(tok)

    def _grammars(self, n_vocab: int):
        if self.grammars is None:
            from moeray.stages.text.grammar import GrammarMasks
            from moeray.stages.text.tokenizer import Tokenizer

            tokenizer = Tokenizer.from_metadata(self.model.gguf.metadata, source=self.model.gguf.path)
            self.grammars = GrammarMasks(tokenizer, n_vocab)
        return self.grammars

    def draft(self, batch: StepBatch) -> list[list[int]] | None:
        """The draft model's tokens for the rows that ask (first stage), None without one."""
        if self.drafter is None or batch.draft_k is None:
            return None
        return self.drafter.draft(batch.slots, batch.starts, batch.tokens, batch.tables, batch.fresh, batch.draft_k)

    def step(self, batch: StepBatch):
        """The whole model in this process: draft (a draft model's rows), embed, every layer, sample."""
        meta = self.begin(batch)
        drafts = self.draft(batch)
        if drafts is not None:
            batch = batch.model_drafted(drafts)
        return self.sample(batch, self.layers(self.model.embed(batch.tokens), meta, batch), meta)


def _split(carry: list[int], batch: StepBatch) -> list[list[int]]:
    """The last stage's view of the draft model's tokens: each drafting row's k of them, in row order."""
    out, at = [], 0
    for k in batch.draft_k or [0] * len(batch.slots):
        out.append(carry[at:at + k] if k > 0 else [])
        at += max(k, 0)
    return out


def _nvml_process_bytes(pci_bus_id: str) -> tuple[int | None, str]:
    """NVML's used memory of this process on the card at `pci_bus_id` (context and allocator
    cache included), or None and the reason (no NVML; another PID namespace hides our pid)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByPciBusId(pci_bus_id.encode())
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if p.pid == os.getpid():
                    return (None if p.usedGpuMemory is None else int(p.usedGpuMemory)), "nvml"
            return None, f"NVML lists no process {os.getpid()} on {pci_bus_id} (a container's PID namespace?)"
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:  # noqa: BLE001 - reported beside torch's numbers, never fatal
        return None, f"NVML: {type(exc).__name__}: {exc}"


class StageActor:
    def __init__(self, stage: int, n_stages: int, simulated_budget: int | None = None,
                 torch_threads: int | None = None, options: StageOptions | None = None, card_share: float = 1.0):
        import torch

        from moeray.stages.kernels import settings

        if options is not None:  # the driver's decision: this process's, whatever its environment says
            settings.use(options)
        if torch_threads is None and simulated_budget is None:
            # A CUDA stage computes its misses on the host, but Ray starts an actor that reserves no
            # CPU with OMP_NUM_THREADS=1: give it its part of the node's cores instead.
            from moeray.stages.runtime.device import host_threads_for_stage

            torch_threads = host_threads_for_stage(card_share, n_stages)
        if torch_threads:
            # Simulated stages share the host's cores; without this each grabs all of them.
            torch.set_num_threads(torch_threads)
        self.stage, self.n_stages = stage, n_stages
        self.simulated_budget = simulated_budget
        self.card_share = card_share  # the part of its GPU Ray gave this stage (0.5: two stages per card)
        self.device: DeviceInfo = probe_device(simulated_budget, index=stage, card_share=card_share)
        self.memory = device_ledger(self.device, stage)
        self.link = None
        self.model = None

    def __repr__(self) -> str:
        """Who this stage is, e.g. `StageActor(stage=1/4, layers=7-16, hit=93%)`.

        Ray records an actor's repr once, when its constructor returns: that is the name the Ray
        dashboard's actor table and the `(StageActor(stage=1/4, ...) pid=...)` log prefix show, so
        there it names the stage and its device (layers are planned after the probe). Read later
        (ray.get(actor.describe.remote()), logs, tests) it carries the live layers and hit rate.
        """
        parts = [f"stage={self.stage}/{self.n_stages}"]
        if self.model is None:
            parts.append(f"device={self.device.name}")
        else:
            parts.append(f"layers={self.model.first}-{self.model.end - 1}")
            hit_rate = getattr(self.model.experts, "hit_rate", None)
            if callable(hit_rate):
                parts.append(f"hit={100 * hit_rate():.0f}%")
        return f"StageActor({', '.join(parts)})"

    def describe(self) -> str:
        """repr(self), for callers on the other side of Ray (whose handles repr as ActorHandle)."""
        return repr(self)

    def options(self) -> dict[str, Any]:
        """The StageOptions this stage computes with, each as its kernels resolve it now: the
        backend "auto" names the one it picked, threads the count ggml runs, ggml_tiled whether its
        ggml takes llama.cpp's tiled GEMM (docs/kernels.md#tiled-gemm), ggml_sgemm whether it has
        llamafile's sgemm; `run_path` the
        loaded layers' (StageModel.path), None before loading."""
        from moeray.stages.kernels import repack, settings
        from moeray.stages.kernels.backend import current_backend, ggml_available
        from moeray.stages.kernels.ggml_lib import sgemm_built, tiled_gemm
        from moeray.stages.kernels.threads import ggml_threads, thread_settings

        out = settings.current().as_dict()
        ts = thread_settings()
        out.update(backend=current_backend(), repack=repack.mode(), host_experts=repack.host_experts(),
                   ggml_poll=ts.poll, ggml_parallel_kb=ts.parallel_bytes >> 10, ggml_adapt=ts.adapt)
        if ggml_available():
            out["threads"] = ggml_threads()
            out["ggml_tiled"] = tiled_gemm()  # llama.cpp's tiled K/IQ-quant GEMM: on, off or absent
            out["ggml_sgemm"] = sgemm_built()  # llamafile's sgemm built in (taken at sgemm_rows+ rows)
        out["run_path"] = None if self.model is None else asdict(self.model.path)
        return out

    # ---------------------------------------------------------------- before loading

    def probe(self, path: str, header=None) -> ProbeReport:
        """Everything the planner needs from this stage, measured here, before any weight is loaded.
        `header`: the model's (the driver's reading), else read from `path` on this node."""
        from moeray.stages.gguf.reader import GGUFFile, read_gguf_header

        t = time.perf_counter()
        header = header or read_gguf_header(path)
        here = parts_here(header)
        where = f"stage {self.stage} on {self.device.node_ip or self.device.hostname}"
        if not here:
            raise MoerayError(f"{header.parts[0].path}: {where} finds none of the model's "
                              f"{len(header.parts)} file(s) there; copy the files its layers need to that path on "
                              "that node (`moeray plan` lists each stage's parts), or mount them there")
        within = [l for l in range(header.config.n_layers) if set(header.stage_parts(l, l + 1)) <= set(here)]
        if not within:
            raise MoerayError(f"{header.parts[0].path}: {where} holds parts {', '.join(str(i + 1) for i in here)} of "
                              f"{len(header.parts)}, no whole layer to time; copy the parts of its layers there "
                              "(`moeray plan` lists each stage's parts)")
        speed = measure_speed(GGUFFile(path, header, parts=()), self.device.torch_device,
                              within=None if len(within) == header.config.n_layers else within)
        if self.device.kind == "cuda":
            import torch

            torch.cuda.empty_cache()  # hand the timing's scratch back before reading free memory
        self.device = probe_device(self.simulated_budget, index=self.stage,  # free memory now, after timing
                                   card_share=self.card_share)
        self.memory = device_ledger(self.device, self.stage)
        from moeray.planner.kv import host_checkpoint_room
        from moeray.stages.kernels.repack import mem_available

        host_room = host_checkpoint_room(mem_available(), sum(header.parts[i].size for i in here))
        return ProbeReport(self.stage, os.getpid(), self.device, speed.layer_ms, speed.miss_ms,
                           time.perf_counter() - t, here, host_room)

    def check_parts(self, header, parts: list[int]) -> dict[int, FileFingerprint | str]:
        """Each of the model's files `parts` (0-based) as this node sees it: its size and sampled
        hash, or what is wrong with it (missing, cut short, another file under its name)."""
        from moeray.stages.gguf.reader import GGUFFile

        g = GGUFFile(header.path, header, parts=())
        out: dict[int, FileFingerprint | str] = {}
        for i in parts:
            try:
                g.check_part(i)
            except MoerayError as exc:
                out[i] = str(exc)
                continue
            out[i] = file_fingerprint(header.parts[i].path)
        return out

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def free_port(self) -> int:
        from moeray.stages.runtime.transport import free_port

        return free_port()

    # ---------------------------------------------------------------- wiring

    def connect(self, master_addr: str, master_port: int, timeout_s: float = 30.0,
                backend: str | None = None) -> int:
        """Join the stages' process group. backend: the driver's choice for the whole group
        (transport.link_backend: gloo when stages share a card); None: nccl on CUDA, else gloo."""
        from moeray.stages.runtime.transport import StageLink

        backend = backend or ("nccl" if self.device.kind == "cuda" else "gloo")
        self.link = StageLink(master_addr, master_port, self.stage, self.n_stages, timeout_s, backend,
                              compute_device=self.device.torch_device)
        return self.stage

    def ping(self) -> int:
        return os.getpid()

    # ---------------------------------------------------------------- loading and running

    def load(self, path: str, first: int, end: int, kv_blocks: int,
             trunk_on_card: int | None = None, profile: str | None = None,
             cache_policy: str = "static", state_slots: int = 1, whole_cache_only: bool = False,
             state_checkpoints: int = 0, header=None, draft: str | None = None, mtp: bool = False,
             host_checkpoints: int = 0) -> LoadReport:
        """Load layers [first, end) (+ embedding / head at the ends) and allocate a KV pool of
        `kv_blocks` blocks (stages/blocks/kv_cache.py) and, for recurrent (DeltaNet) layers, `state_slots`
        sequence states (one per engine sequence slot: stages/blocks/deltanet.py) and
        `state_checkpoints` more (cluster/state_checkpoints.py), charging all of it to this device's
        budget (a simulated device refuses what does not fit); `host_checkpoints` more checkpoints in
        host memory (numbered after those), not charged.

        `trunk_on_card` is the trunk the plan put on the card, in the bytes the planner priced
        (as stored in the GGUF); None charges the resident size of everything loaded. Routed
        experts are not loaded: they stay in the file mapping, and what is left of the device
        after KV and trunk becomes this stage's expert cache, filled hottest-first from `profile`
        (a path every node can read; None = uniform) and kept by `cache_policy`.

        `whole_cache_only` (`moeray serve --local`): cache the experts only when the room left holds
        every one of them (stages/runtime/model.py load_cached, the one stage builder, says why).

        `header`: the model's (the driver's reading), else read from `path`. Only the files (parts)
        holding this stage's tensors are checked and mapped.
        """
        from moeray.stages.gguf.reader import GGUFFile, read_gguf_header
        from moeray.stages.arch import arch_of
        from moeray.stages.blocks.kv_cache import BLOCK_SIZE, kv_block_bytes, kv_dtype
        from moeray.stages.runtime.model import load_cached, stage_trunk_bytes

        t = time.perf_counter()
        self.model = None
        self.memory = device_ledger(self.device, self.stage)
        header = header or read_gguf_header(path)
        gguf = GGUFFile(path, header, parts=header.stage_parts(first, end))
        cfg = gguf.config
        # Charge KV and trunk from the header first: what is left is the expert cache's budget, and
        # the MoE blocks are built with that cache in front of the host copy.
        itemsize = 2 if kv_dtype(self.device.torch_device).itemsize == 2 else 4
        self.memory.charge(kv_blocks * kv_block_bytes(cfg, range(first, end), itemsize),
                           f"KV pool ({kv_blocks} blocks, {kv_blocks * BLOCK_SIZE} tokens)")
        state = (state_slots + state_checkpoints) * sum(arch_of(cfg).state_bytes(cfg, l) for l in range(first, end))
        if state:
            self.memory.charge(state, f"DeltaNet state ({state_slots} sequence slots, {state_checkpoints} checkpoints)")
        trunk = stage_trunk_bytes(gguf, first, end)
        self.memory.charge(trunk if trunk_on_card is None else trunk_on_card, f"trunk of layers {first}-{end - 1}")
        drafter = None
        if draft is not None:  # speculative decoding's draft model: on the first stage, charged like trunk
            from moeray.stages.runtime.draft_model import DraftModel

            if first != 0:
                raise MoerayError(f"stage {self.stage}: a draft model runs on the first stage only")
            drafter = DraftModel(draft, self.device.torch_device, kv_blocks, cfg)
            self.memory.charge(drafter.nbytes(), f"draft model {os.path.basename(draft)} (weights and KV)")
        if mtp:  # speculative decoding's next-token-prediction layer, on the last stage: priced from the
            from moeray.stages.runtime.mtp import mtp_bytes  # header before the cache takes the rest

            if end != cfg.n_layers:
                raise MoerayError(f"stage {self.stage}: the next-token-prediction layer runs on the last stage only")
            self.memory.charge(mtp_bytes(header, kv_blocks, max(1, state_slots), itemsize, first == 0),
                               "next-token-prediction layer (weights and KV)")
        model, cache = load_cached(gguf, (first, end), self.device.torch_device, budget_bytes=self.memory.free,
                                   profile=profile, policy=cache_policy, layout="per-layer",
                                   whole_cache_only=whole_cache_only)
        if cache is not None:
            self.memory.charge(cache.budget.capacity, f"expert cache ({cache.slots.n_slots} slots)")
        resident = model.trunk_bytes()
        if resident > trunk:  # the header's price is the runtime's size by construction; say so if not
            raise MoerayError(f"stage {self.stage}: the trunk of layers {first}-{end - 1} holds {resident} bytes, "
                              f"{trunk} were charged")
        kv = model.new_kv_pool(kv_blocks, state_slots + state_checkpoints, host_checkpoints)
        self.model, self.runner = model, StageRunner(model, kv)
        self.runner.drafter = drafter
        if mtp:
            from moeray.stages.runtime.mtp import MTPHead

            self.runner.mtp = MTPHead(model, kv_blocks, max(1, state_slots))
        # Fixed once loaded: measured here, not again on every stats poll.
        self.trunk_bytes = (resident, stage_trunk_bytes(gguf, first, end, backend=None))
        self.steps, self.step_s, self.tokens_in = 0, 0.0, 0
        self.hidden = model.config.hidden
        return LoadReport(self.stage, (first, end), time.perf_counter() - t, dict(self.memory.parts),
                          self.memory.free, resident, cache.slots.n_slots if cache else 0,
                          cache.core.n_resident if cache else 0, drafter.token_ms() if drafter else 0.0,
                          self.runner.mtp.token_ms() if self.runner.mtp else 0.0)

    def step(self, batch: StepBatch) -> list[int | None] | None:
        """Run one micro-batch through this stage. The last stage returns a token per sequence
        (None where the sequence is still mid-prompt); the others send their activations on."""
        if self.model is None:
            raise MoerayError(f"stage {self.stage}: step before load")
        first, last = self.stage == 0, self.stage == self.n_stages - 1
        n_rows = sum(batch.n_new)
        sent = False
        t0 = time.perf_counter()
        self.steps += 1
        self.tokens_in += n_rows
        try:
            meta = self.runner.begin(batch)
            carry = None  # the draft model's tokens, from the first stage to the last (StageLink)
            if first:
                drafts = self.runner.draft(batch)
                if drafts is not None:
                    batch = batch.model_drafted(drafts)
                    carry = [t for d, k in zip(drafts, batch.draft_k) if k > 0 for t in d]
                x = self.model.embed(batch.tokens)
            else:
                x, carry = self.link.recv(n_rows, self.hidden, carried=True)
            if carry and last and not first:  # the drafted tokens, in the order of the rows that drafted them
                batch = batch.model_drafted(_split(carry, batch))
            x = self.runner.layers(x, meta, batch if last else None)
            if not last:
                sent = True
                self.link.send(x, carry)
                return None
            return self.runner.sample(batch, x, meta)
        except Exception:
            if not last and not sent and self.link is not None:
                try:  # let the stages after this one fail this step now instead of timing out
                    self.link.send_failure(n_rows, self.hidden)
                except Exception:
                    pass
            raise
        finally:
            self.step_s += time.perf_counter() - t0

    def device_memory(self) -> dict[str, Any]:
        """What this stage was charged against what its device really holds: the ledger's parts
        (what the plan priced), the bytes its tensors hold (trunk, KV cache, filled slots), and on
        CUDA torch's allocator (now and peak) and NVML's count for this process (its context
        included). bench/device_check.py compares them."""
        out: dict[str, Any] = {"stage": self.stage, "device": self.device.torch_device,
                               "charged": dict(self.memory.parts), "charged_bytes": self.memory.used,
                               "reserve_bytes": self.device.reserve_bytes, "card_share": self.device.card_share}
        if self.model is not None:
            cache = self.model.experts
            slots = getattr(cache, "budget", None)
            out["held"] = {"trunk": self.model.trunk_bytes(), "kv": self.runner.kv.nbytes(),
                           "slots": slots.used if slots is not None else 0}
            out["held_bytes"] = sum(out["held"].values())
        if self.device.kind == "cuda":
            import torch

            dev = torch.device(self.device.torch_device)
            out["torch_allocated_bytes"] = torch.cuda.memory_allocated(dev)
            out["torch_peak_bytes"] = torch.cuda.max_memory_allocated(dev)
            out["torch_reserved_bytes"] = torch.cuda.memory_reserved(dev)
            out["nvml_process_bytes"], out["nvml_note"] = _nvml_process_bytes(self.device.pci_bus_id)
        return out

    def reset_peak_memory(self) -> None:
        """Start the device's peak count afresh (CUDA), e.g. before a measured run."""
        if self.device.kind == "cuda":
            import torch

            torch.cuda.reset_peak_memory_stats(torch.device(self.device.torch_device))

    def record_routing(self, path: str) -> None:
        """Append every routing decision of this stage's expert cache to the trace file `path`
        (flushed whenever stats are polled), so served traffic can be replayed offline."""
        from moeray.cache.attach import routing_trace

        cache = self.model.experts if self.model is not None else None
        if not hasattr(cache, "trace_writer"):
            raise MoerayError(f"stage {self.stage}: no expert cache loaded, nothing to record")
        if cache.trace_writer is not None:
            cache.trace_writer.close()
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        cache.trace_writer = routing_trace(path, self.model.config, self.model.first, self.model.end)

    def stats(self) -> StageStats:
        """This stage's live numbers: layers, device bytes, steps, time in steps (incl. waiting for
        the previous stage's activations), and its expert cache's lookups and hits when it has one."""
        out = StageStats(self.stage, self.device.name, self.device.node_ip, placed=dict(self.memory.parts),
                         free_bytes=self.memory.free, pid=os.getpid(), node_id=self.device.node_id)
        out.options = self.options()
        if self.model is not None:
            out.parts_opened = self.model.gguf.opened
        if self.model is not None:
            out.layers, out.steps, out.step_s, out.tokens_in = ((self.model.first, self.model.end), self.steps,
                                                                 self.step_s, self.tokens_in)
            out.backend, (out.trunk_held_bytes, out.trunk_gguf_bytes) = self.model.backend, self.trunk_bytes
            cache = getattr(self.model.experts, "stats", None)
            if callable(cache):
                out.cache = cache()
            kv = self.runner.kv
            out.kv = {"blocks": kv.n_blocks, "block_tokens": kv.block_size, "bytes": kv.nbytes(),
                      "dtype": str(kv.dtype).removeprefix("torch.")}
        return out

    # ---------------------------------------------------------------- transport micro-benchmarks

    def link_check(self, rows: int, hidden: int, reps: int) -> dict[str, Any]:
        """Pass a known [rows, hidden] float32 tensor down the pipeline `reps` times over the process
        group (every stage calls this at once). The last stage checks every copy arrived intact and
        reports the mean ms per pass: the transport cost of one step with this activation size."""
        import torch

        # On the stage's own device, as activations are: the pass costs what a step's hop costs
        # (on CUDA incl. the copies to and from the host when the group runs gloo).
        dev = self.link.compute_device
        expected = torch.arange(rows * hidden, dtype=torch.float32, device=dev).reshape(rows, hidden)
        intact = True
        t = time.perf_counter()
        for _ in range(reps):
            x = expected if self.link.is_first else self.link.recv(rows, hidden)
            if not self.link.is_last:
                self.link.send(x)
            else:
                intact = intact and bool(torch.equal(x, expected))  # .item() inside: waits for the copy
        return {"stage": self.stage, "ms_per_pass": (time.perf_counter() - t) * 1e3 / reps, "intact": intact,
                "backend": self.link.backend, "device": str(dev)}

    def relay(self, x, rest: list | None = None):
        """Ray-call chaining, for comparison: each stage hands x on by calling the next one."""
        import ray

        if not rest:
            return x
        return ray.get(rest[0].relay.remote(x, rest[1:]), timeout=30)
