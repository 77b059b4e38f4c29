"""A pipeline of one stage: the whole model in this process (`moeray serve --local`, `moeray generate`).

The engine (cluster/engine.py) drives it like RayPipeline, through submit, result and recover;
here a step is computed when it is submitted, so its handle is its result.
"""
from __future__ import annotations

from typing import Any, Optional

from moeray.stages.runtime.actor import StepBatch
from moeray.stages.text.sampling import StepOutput


class LocalPipeline:
    """The whole model in this process, one stage. `from_file` loads it as a StageActor does (a
    device budget; an expert cache when the device holds every expert, else every expert computed
    from the host copy: StageActor.load's `whole_cache_only`): `moeray serve --local`.
    `from_model` runs a model already loaded (its cache attached by the caller): `moeray generate`."""

    n_stages = 1

    def __init__(self, stage, kv_blocks: int | None = None, state_slots: int = 0, state_checkpoints: int = 0):
        self.stage = stage  # a StageActor or a StageRunner: step(StepBatch) -> tokens
        self.kv_blocks = kv_blocks  # blocks of its KV pool: the engine's budget
        self.state_slots = state_slots  # sequence states it holds (recurrent layers), 0 for none
        self.state_checkpoints = state_checkpoints  # and checkpoint slots after them
        self.load_report = None

    @classmethod
    def from_file(cls, path: str, kv_blocks: int, simulated_budget: int | None = None,
                  profile: str | None = None, cache_policy: str = "static", max_seqs: int = 1,
                  options=None, state_checkpoints: int = 0) -> "LocalPipeline":
        """`options`: the StageOptions it computes with (None: this process's)."""
        from moeray.stages.runtime.actor import StageActor
        from moeray.stages.gguf.reader import read_gguf_header

        stage = StageActor(0, 1, simulated_budget if simulated_budget is not None else 1 << 62, options=options)
        cfg = read_gguf_header(path).config
        hybrid = cfg.deltanet is not None
        pipe = cls(stage, kv_blocks, max_seqs if hybrid else 0, state_checkpoints if hybrid else 0)
        pipe.load_report = stage.load(path, 0, cfg.n_layers, kv_blocks, profile=profile, cache_policy=cache_policy,
                                      state_slots=max_seqs, whole_cache_only=True,
                                      state_checkpoints=pipe.state_checkpoints)
        return pipe

    @classmethod
    def from_model(cls, model, kv_blocks: int, max_seqs: int = 1, state_checkpoints: int = 0) -> "LocalPipeline":
        """`max_seqs`: the engine's sequence slots, each a DeltaNet state where the model has them,
        and `state_checkpoints` more state slots for checkpoints (cluster/state_checkpoints.py)."""
        from moeray.stages.runtime.actor import StageRunner

        kv = model.new_kv_pool(kv_blocks, max_seqs + state_checkpoints)
        hybrid = kv.state is not None
        return cls(StageRunner(model, kv), kv_blocks, max_seqs if hybrid else 0, state_checkpoints if hybrid else 0)

    def submit(self, batch: StepBatch) -> Any:
        return self.stage.step(batch)  # done when it returns: the handle is the result

    def result(self, handle: Any, timeout_s: float) -> list[Optional[int]] | StepOutput:
        return handle

    def recover(self) -> None:
        pass
