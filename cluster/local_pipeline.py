"""A pipeline of one stage: the whole model in this process (`moeray serve --local`, `moeray generate`).

The engine (cluster/engine.py) drives it like RayPipeline, through submit, result and recover;
here a step is computed when it is submitted, so its handle is its result.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from moeray.cache.attach import load_profile
from moeray.cluster.step_clock import expert_layers
from moeray.stages.gguf.reader import read_gguf_header
from moeray.stages.runtime.actor import StageActor
from moeray.stages.runtime.device import measure_miss_ms
from moeray.stages.runtime.draft_model import DraftModel
from moeray.stages.runtime.mtp import MTPHead
from moeray.stages.runtime.runner import StageRunner
from moeray.stages.runtime.step import StepBatch, StepOutput


class LocalPipeline:
    """The whole model in this process, one stage. `from_file` loads it as a StageActor does (a
    device budget; an expert cache when the device holds every expert, else every expert computed
    from the host copy: StageActor.load's `whole_cache_only`): `moeray serve --local`.
    `from_model` runs a model already loaded (its cache attached by the caller): `moeray generate`."""

    n_stages = 1
    verifies = True  # its stage accepts drafted tokens (StepBatch.drafts): speculative decoding

    def __init__(self, stage, kv_blocks: int | None = None, state_slots: int = 0, state_checkpoints: int = 0,
                 host_blocks: int = 0):
        self.stage = stage  # a StageActor or a StageRunner: step(StepBatch) -> StepOutput
        self.kv_blocks = kv_blocks  # blocks of its KV pool: the engine's budget
        self.host_blocks = host_blocks  # blocks of its host tier (stages/blocks/host_kv.py), 0: none
        self.state_slots = state_slots  # sequence states it holds (recurrent layers), 0 for none
        self.state_checkpoints = state_checkpoints  # and checkpoint slots after them
        self.load_report = None
        # Each MoE layer's routing heat and the price of reading an expert (cluster/step_clock.py):
        # the expert part of a step's price, which speculation's draft lengths pay.
        self.step_experts: tuple = ()
        # A draft model on the (only) stage (stages/runtime/draft_model.py): speculation drafts with it.
        self.draft_model, self.draft_token_ms = False, 0.0
        # A next-token-prediction layer (stages/runtime/mtp.py): speculation drafts with what it proposes.
        self.mtp, self.mtp_token_ms = False, 0.0

    @classmethod
    def from_file(cls, path: str, kv_blocks: int, simulated_budget: int | None = None,
                  profile: str | None = None, cache_policy: str = "static", max_seqs: int = 1,
                  options=None, draft: str | None = None, mtp: bool = False,
                  state_checkpoints: int = 0, host_checkpoints: int = 0, kv_types=None,
                  host_blocks: int = 0) -> "LocalPipeline":
        """`options`: the StageOptions it computes with (None: this process's); `draft`: a draft
        model's GGUF, run beside it; `mtp`: run the file's next-token-prediction layer;
        `state_checkpoints`: a hybrid model's checkpoint slots of the state on the device
        (cluster/state_checkpoints.py), `host_checkpoints` more in host memory (the engine's ledger
        holds them all); `kv_types`: the pool's cache types (None: the options'); `host_blocks`:
        KV blocks of its host tier."""
        stage = StageActor(0, 1, simulated_budget if simulated_budget is not None else 1 << 62, options=options)
        cfg = read_gguf_header(path).config
        hybrid = cfg.deltanet is not None
        on_card, host = (state_checkpoints, host_checkpoints) if hybrid else (0, 0)
        pipe = cls(stage, kv_blocks, max_seqs if hybrid else 0, on_card + host, host_blocks)
        pipe.load_report = stage.load(path, 0, cfg.n_layers, kv_blocks, profile=profile, cache_policy=cache_policy,
                                      state_slots=max_seqs, whole_cache_only=True, draft=draft, mtp=mtp,
                                      state_checkpoints=on_card, host_checkpoints=host, kv_types=kv_types,
                                      host_blocks=host_blocks)
        pipe.step_experts = local_step_experts(stage.model.gguf, profile)
        pipe._drafting(stage.runner.drafter, stage.runner.mtp)
        return pipe

    @classmethod
    def from_model(cls, model, kv_blocks: int, max_seqs: int = 1, draft: str | None = None,
                   mtp: bool = False, state_checkpoints: int = 0, host_checkpoints: int = 0, kv_types=None,
                   host_blocks: int = 0) -> "LocalPipeline":
        """`max_seqs`: the engine's sequence slots, each a DeltaNet state where the model has them,
        and `state_checkpoints` more state slots for checkpoints (cluster/state_checkpoints.py),
        `host_checkpoints` more in host memory;
        `draft`: a draft model's GGUF (the same vocabulary), run beside it; `mtp`: run the file's
        next-token-prediction layer; `kv_types`: the pool's cache types (None: the options');
        `host_blocks`: KV blocks of its host tier."""
        kv = model.new_kv_pool(kv_blocks, max_seqs + state_checkpoints, host_checkpoints, kv_types, host_blocks)
        hybrid = kv.state is not None
        pipe = cls(StageRunner(model, kv), kv_blocks, max_seqs if hybrid else 0,
                   state_checkpoints + host_checkpoints if hybrid else 0, host_blocks if kv.host else 0)
        if draft is not None:
            pipe.stage.drafter = DraftModel(draft, model.device, kv_blocks, model.config)
        if mtp:
            pipe.stage.mtp = MTPHead(model, kv_blocks, max_seqs)
        pipe.stage.share_host_tier()
        pipe._drafting(pipe.stage.drafter, pipe.stage.mtp)
        return pipe

    def _drafting(self, drafter, mtp) -> None:
        if drafter is not None:
            self.draft_model, self.draft_token_ms = True, drafter.token_ms()
        if mtp is not None:
            self.mtp, self.mtp_token_ms = True, mtp.token_ms()

    def submit(self, batch: StepBatch) -> Any:
        return self.stage.step(batch)  # done when it returns: the handle is the result

    def result(self, handle: Any, timeout_s: float) -> StepOutput:
        return handle

    def recover(self) -> None:
        pass


def local_step_experts(gguf, profile: str | None) -> tuple:
    """The expert part of a one-process step's price: each MoE layer's heat from the routing
    profile (uniform without one) and one measured miss time for every expert (in one process
    every expert is read from host memory, resident or not)."""
    cfg = gguf.config
    if not cfg.is_moe:
        return ()
    prof = load_profile(profile, cfg.n_layers, cfg.n_experts)
    counts = None
    if prof.counts is not None:
        counts = np.zeros((cfg.n_layers, cfg.n_experts))
        for (layer, expert), c in zip(prof.pairs, prof.counts):
            counts[layer, expert] = c
    miss = measure_miss_ms(gguf, reps=10, budget_s=0.5)
    return expert_layers(counts, cfg.moe_layers, cfg.n_experts, cfg.n_experts_used,
                         [[miss] * cfg.n_experts for _ in cfg.moe_layers])
