"""The step's contract: what the engine hands a stage (StepBatch), what the last stage hands back
(StepOutput), and what a stage reports to the driver (ProbeReport, LoadReport, StageStats,
FileFingerprint).

Plain dataclasses, torch-free and Ray-free: the engine, the scheduler and the driver read them
without loading either, and the HTTP API turns the reports into JSON at its edge.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Optional

from moeray.stages.runtime.device import DeviceInfo

if TYPE_CHECKING:  # annotations only: sampling.py loads torch
    from moeray.stages.text.sampling import SamplingParams, TokenLogprob

# A decode row's token the engine does not know yet: the last stage sent it to the first stage
# itself, after sampling the step before (StepBatch.loop_back, StepBatch.looped).
LOOPED = -1


@dataclass(kw_only=True)
class StepBatch:
    """One micro-batch of one engine step, as a stage sees it: one entry per sequence in each list,
    built by keyword (cluster/scheduler.py ScheduledStep.batch).

    Every stage gets the same slots, token counts, start positions and KV block tables (the engine
    owns the block accounting; stages/blocks/kv_cache.py); only stage 0 gets the token ids and only the
    last stage which rows sample, the sampling params and the token histories its penalties read.

    A sequence's sampling params (grammar, logit bias, seed, penalties: stop strings and max_tokens
    stay with the engine) travel once, on the row it starts its slot with (`fresh`: admitted, or
    admitted again after a preemption or a stage's restart); the last stage keeps them for the slot
    until the sequence ends (`ended`) or another one starts there.
    """
    step_id: int
    slots: list[int]
    n_new: list[int]  # new tokens per sequence: a prefill chunk or 1
    fresh: list[bool]  # this chunk starts a new sequence in its slot: reset KV and sampler first
    tokens: list[list[int]] | None = None  # stage 0 only
    sample: list[bool] | None = None  # last stage only: the row wants a token (its prompt is fully fed)
    # Last stage only: a sequence's sampling params on its fresh row, None on the others (None: no
    # fresh row carries any)
    params: list[SamplingParams | None] | None = None
    ended: list[int] | None = None  # last stage only: slots whose sequences ended since the last step
    # A decode step issued before the one it continues came back (cluster/engine.py, chained decode):
    # the last stage sends its sampled tokens (one per sampling row, in row order) straight to the
    # first stage (`loop_back`), and the next step the first stage runs takes them first (`looped`:
    # the slots they belong to, in that order); its rows whose token is LOOPED take their slot's.
    loop_back: bool = False  # last stage only
    looped: list[int] | None = None  # first stage only
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
                       sample=self.sample if last else None, params=self.params if last else None,
                       ended=self.ended if last else None, loop_back=self.loop_back and last,
                       looped=self.looped if stage == 0 else None,
                       history=self.history if last else None, drafts=self.drafts if last else None,
                       draft_k=self.draft_k if stage == 0 or last else None, mtp_k=self.mtp_k if last else None)

    def with_looped(self, tokens: dict[int, int]) -> "StepBatch":
        """This step with its LOOPED tokens filled in from the last stage's (slot -> token)."""
        return replace(self, tokens=[[tokens[slot] if t == LOOPED else t for t in row]
                                     for slot, row in zip(self.slots, self.tokens)])

    def model_drafted(self, drafts: list[list[int]]) -> "StepBatch":
        """This step with the draft model's tokens in its rows (placeholders replaced): in the token
        ids the first stage embeds and in the drafts the last stage verifies."""
        k = self.draft_k or [0] * len(self.slots)
        tokens = None if self.tokens is None else [
            [t[0]] + d if n > 0 else t for t, d, n in zip(self.tokens, drafts, k)]
        verified = None if self.drafts is None else [
            d if n > 0 else v for v, d, n in zip(self.drafts, drafts, k)]
        return replace(self, tokens=tokens, drafts=verified)


@dataclass
class StepOutput:
    """What the last stage returns for one micro-batch: a token per row (None: the row was a prompt
    chunk with more to come; a list for a verify row: its accepted drafts and one more token) and,
    where its params asked, that token's log-probabilities (a list of them for a verify row)."""
    tokens: list[int | list[int] | None]
    logprobs: list[TokenLogprob | list[TokenLogprob] | None] | None = None
    # a next-token-prediction layer's tokens for the row's next step (stages/runtime/mtp.py), per row
    proposals: list[list[int] | None] | None = None
    sample_ns: int = 0  # the last stage's head and sampling, nanoseconds (cluster/timeline.py)


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
    # The last steps' times: (step id, call start, input ready, layers done, output sent or sampled),
    # perf_counter_ns on the stage's host (cluster/timeline.py stage_hops)
    timings: list[tuple[int, int, int, int, int]] = field(default_factory=list)
