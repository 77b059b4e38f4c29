"""Whole requests in one process: the engine over a model loaded here, every prompt run to completion
in one batch (`moeray generate`, bench/decode.py, tests)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Sequence

from moeray.cluster.config import EngineConfig
from moeray.cluster.engine import Engine
from moeray.cluster.local_pipeline import LocalPipeline
from moeray.cluster.scheduler import Request
from moeray.errors import MoerayError
from moeray.stages.blocks.kv_cache import blocks_for
from moeray.stages.text.sampling import SamplingParams


@dataclass
class Completion:
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)  # every sampled token, the end token included
    text: str = ""
    finish_reason: Optional[str] = None  # "stop" (end token or stop string) | "length"


@dataclass
class GenerationStats:
    prefill_tokens: int = 0
    prefill_s: float = 0.0  # until every prompt has its first token
    decode_tokens: int = 0  # tokens generated after each sequence's first, summed (verified drafts included)
    decode_s: float = 0.0

    @property
    def prefill_tok_s(self) -> float:
        return self.prefill_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0


class Generator:
    """The engine over a model loaded in this process (`moeray generate`, benchmarks, tests): every
    prompt runs to completion in one batch, with a KV cache sized for exactly these prompts."""

    def __init__(self, model, tokenizer, config: EngineConfig = EngineConfig()):
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.stats = GenerationStats()  # of the last run

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
                 on_text: Optional[Callable[[int, str], None]] = None) -> list[Completion]:
        """Run all prompts (token ids) to completion, with one SamplingParams for all or one each;
        `on_text(i, delta)` as prompt i's text is released."""
        reqs = list(self._run(prompts, params, on_text))
        return [Completion(r.prompt, list(r.output), r.text, r.finish_reason) for r in reqs]

    def stream(self, prompt: Sequence[int], params: SamplingParams = SamplingParams()) -> Iterator[str]:
        """Text deltas of one prompt as they are released; `self.stats` is filled when it ends."""
        deltas: list[str] = []
        for _ in self._run([prompt], params, lambda _i, d: deltas.append(d), live=True):
            yield from deltas
            deltas.clear()

    def _run(self, prompts, params, on_text, live: bool = False) -> Iterator[Request]:
        """Steps the engine; yields after every step when `live`, else every request at the end."""
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params) != len(prompts):
            raise MoerayError(f"{len(prompts)} prompts but {len(params)} sampling params")
        context = self.model.config.context_length
        for p in prompts:
            if len(p) >= context:
                raise MoerayError(f"prompt of {len(p)} tokens does not fit the context of {context}")
        lengths = [min(context, len(p) + q.max_tokens) for p, q in zip(prompts, params)]
        # Blocks for exactly these sequences at their longest: none is ever preempted.
        n_blocks = max(1, sum(blocks_for(n + 1) for n in lengths))
        cfg = EngineConfig(max_seqs=max(1, len(prompts)), max_len=max(lengths, default=1),
                           token_budget=self.config.token_budget, prefill_chunk=self.config.prefill_chunk,
                           prefill_alone=self.config.prefill_alone,
                           micro_batches=1, kv_blocks=n_blocks, speculative=self.config.speculative,
                           max_draft=self.config.max_draft)
        engine = Engine(LocalPipeline.from_model(self.model, n_blocks, cfg.max_seqs), cfg, self.tokenizer)
        engine.scheduler.reserve_output = True
        reqs = [engine.add(p, q) for p, q in zip(prompts, params)]
        sent = [0] * len(reqs)
        t0 = t_prefilled = time.perf_counter()
        while not all(r.done for r in reqs):
            prefilling = any(r.t_first is None for r in reqs)
            engine.step()
            if prefilling:
                t_prefilled = time.perf_counter()
            for i, r in enumerate(reqs):  # the pieces of text released since the last step
                if on_text is not None and r.detok is not None and len(r.detok.pieces) > sent[i]:
                    on_text(i, "".join(r.detok.pieces[sent[i]:]))
                    sent[i] = len(r.detok.pieces)
            if live:
                yield reqs[0]
        st = engine.stats
        self.stats = GenerationStats(st.prefill_tokens, t_prefilled - t0,
                                     sum(max(0, len(r.output) - 1) for r in reqs), time.perf_counter() - t_prefilled)
        if not live:
            yield from reqs
