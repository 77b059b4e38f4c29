"""A pipeline of one stage: the whole model in this process (`moeray serve --local`, `moeray generate`).

The engine (cluster/engine.py) drives it like RayPipeline, through submit, result and recover;
here a step is computed when it is submitted, so its handle is its result.
"""
from __future__ import annotations

from typing import Any, Optional

from moeray.stages.actor import StepBatch
from moeray.stages.sampling import StepOutput


class LocalPipeline:
    """The whole model in this process, one stage. `from_file` loads it as a StageActor does (a
    device budget, an expert cache): `moeray serve --local`. `from_model` runs a model already
    loaded (its cache attached by the caller): `moeray generate`."""

    n_stages = 1

    def __init__(self, stage, kv_blocks: int | None = None):
        self.stage = stage  # a StageActor or a StageRunner: step(StepBatch) -> tokens
        self.kv_blocks = kv_blocks  # blocks of its KV pool: the engine's budget
        self.load_report = None

    @classmethod
    def from_file(cls, path: str, kv_blocks: int, simulated_budget: int | None = None,
                  profile: str | None = None, cache_policy: str = "static") -> "LocalPipeline":
        from moeray.stages.actor import StageActor
        from moeray.stages.gguf_file import read_gguf_header

        stage = StageActor(0, 1, simulated_budget if simulated_budget is not None else 1 << 62)
        pipe = cls(stage, kv_blocks)
        n_layers = read_gguf_header(path).config.n_layers
        pipe.load_report = stage.load(path, 0, n_layers, kv_blocks, profile=profile, cache_policy=cache_policy)
        return pipe

    @classmethod
    def from_model(cls, model, kv_blocks: int) -> "LocalPipeline":
        from moeray.stages.actor import StageRunner

        return cls(StageRunner(model, model.new_kv_pool(kv_blocks)), kv_blocks)

    def submit(self, batch: StepBatch) -> Any:
        return self.stage.step(batch)  # done when it returns: the handle is the result

    def result(self, handle: Any, timeout_s: float) -> list[Optional[int]] | StepOutput:
        return handle

    def recover(self) -> None:
        pass
