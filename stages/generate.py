"""Text generation in one process over `StageModel.step`: chunked prefill, batched decode, sampling,
end-of-generation tokens and stop strings, streamed text deltas. Several prompts run as one batch.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch

from moeray.errors import MoerayError
from moeray.stages.sampling import SamplingParams, StopStringStream, sample


@dataclass
class Completion:
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)  # every sampled token, the end token included
    text: str = ""
    finish_reason: str | None = None  # "stop" (end token or stop string) | "length"


@dataclass
class GenerationStats:
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_tokens: int = 0  # tokens fed through decode steps, summed over sequences
    decode_steps: int = 0
    decode_s: float = 0.0

    @property
    def prefill_tok_s(self) -> float:
        return self.prefill_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0


# on_text(sequence index, newly released text)
TextCallback = Callable[[int, str], None]


class Generator:
    def __init__(self, model, tokenizer, prefill_chunk: int = 256):
        self.model = model
        self.tokenizer = tokenizer
        self.prefill_chunk = prefill_chunk
        self.stats = GenerationStats()  # of the last generate() call

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
        on_text: TextCallback | None = None,
    ) -> list[Completion]:
        """Run all prompts (token ids) to completion as one batch; `on_text` gets text as it is released."""
        completions = [Completion(list(p)) for p in prompts]
        for seq, delta in self._run(completions, params):
            if on_text is not None and delta:
                on_text(seq, delta)
        return completions

    def stream(self, prompt: Sequence[int], params: SamplingParams = SamplingParams()) -> Iterator[str]:
        """Text deltas of one prompt as they are released; `self.stats` is filled when it ends."""
        for _, delta in self._run([Completion(list(prompt))], params):
            if delta:
                yield delta

    @torch.inference_mode()
    def _run(self, completions: list[Completion], params) -> Iterator[tuple[int, str]]:
        n = len(completions)
        params = [params] * n if isinstance(params, SamplingParams) else list(params)
        if len(params) != n:
            raise ValueError(f"{n} prompts but {len(params)} sampling params")
        if any(not c.prompt_ids for c in completions):
            raise MoerayError("an empty prompt cannot be continued; give at least one token")
        context = self.model.config.context_length
        for c in completions:
            if len(c.prompt_ids) >= context:
                raise MoerayError(f"prompt of {len(c.prompt_ids)} tokens does not fit the context of {context}")
        # Never generate past the model's context.
        budgets = [min(p.max_tokens, context - len(c.prompt_ids)) for c, p in zip(completions, params)]
        max_len = max(len(c.prompt_ids) + b for c, b in zip(completions, budgets))
        kv = self.model.new_kv_cache(max_seqs=n, max_len=max_len)
        generators = [p.new_generator() for p in params]
        texts = [StopStringStream(self.tokenizer, p.stop) for p in params]
        stats = self.stats = GenerationStats()

        # Prefill: every prompt advances by one chunk per step, batched; a prompt's logits are those
        # of the step that consumed its last chunk.
        last_logits: list[torch.Tensor | None] = [None] * n
        t0 = time.perf_counter()
        for start in range(0, max(len(c.prompt_ids) for c in completions), self.prefill_chunk):
            seqs = [i for i, c in enumerate(completions) if len(c.prompt_ids) > start]
            chunks = [completions[i].prompt_ids[start:start + self.prefill_chunk] for i in seqs]
            logits = self.model.step(chunks, seqs, kv)
            for row, i in enumerate(seqs):
                last_logits[i] = logits[row]
            stats.prefill_tokens += sum(len(ch) for ch in chunks)
        stats.prefill_s = time.perf_counter() - t0

        logits = torch.stack(last_logits)
        active = list(range(n))
        t0 = time.perf_counter()
        while True:
            next_ids = sample(logits, [params[i] for i in active], [generators[i] for i in active])
            still = []
            for i, tok in zip(active, next_ids):
                c, p = completions[i], params[i]
                c.token_ids.append(tok)
                if tok in self.tokenizer.end_ids and not p.ignore_eos:
                    c.finish_reason = "stop"
                    yield i, texts[i].finish()
                else:
                    yield i, texts[i].push(tok)
                    if texts[i].stopped:
                        c.finish_reason = "stop"
                    elif len(c.token_ids) >= budgets[i]:
                        c.finish_reason = "length"
                        yield i, texts[i].finish()
                    else:
                        still.append(i)
                c.text = texts[i].text
            active = still
            if not active:
                break
            logits = self.model.step([[completions[i].token_ids[-1]] for i in active], active, kv)
            stats.decode_tokens += len(active)
            stats.decode_steps += 1
        stats.decode_s = time.perf_counter() - t0
