"""Choosing the next token, and turning generated tokens into text that respects stop strings.

Sampling is per sequence: each row of a batch has its own temperature / top-k / top-p and its own
`torch.Generator`, so a seeded request draws the same tokens whether it runs alone or batched.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

MAX_TOP_LOGPROBS = 20  # alternatives per token, as OpenAI's chat API allows
NUCLEUS_LOOK = 64  # top-p: the likeliest tokens ranked before sorting the whole vocabulary


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = no top-k cut
    top_p: float = 1.0  # 1 = no nucleus cut
    seed: int | None = None  # None = nondeterministic
    stop: tuple[str, ...] = ()  # generation ends before the first of these in the text
    ignore_eos: bool = False
    logprobs: int | None = None  # None = none; n = the sampled token's log-probability and the n likeliest
    grammar: str | None = None  # an llguidance grammar (stages/text/grammar.py) the text must follow
    speculative: bool | None = None  # draft and verify tokens (cluster/speculation.py); None: the server's default

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}")
        object.__setattr__(self, "stop", tuple(s for s in self.stop if s))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def new_generator(self) -> torch.Generator | None:
        if self.greedy:
            return None
        gen = torch.Generator()
        if self.seed is None:
            gen.seed()
        else:
            gen.manual_seed(self.seed)
        return gen


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities of one row [vocab] after temperature, top-k and top-p (zeros outside the cut)."""
    logits = logits.float() / params.temperature
    if 0 < params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        # Keep the smallest prefix (likeliest first) whose mass reaches top_p: a token stays if the
        # mass before it is < top_p. The nucleus is mostly a few tokens, so the likeliest
        # NUCLEUS_LOOK are ranked first (topk, ~0.1 ms) and the whole vocabulary sorted (~1.5 ms a
        # 49k row) only when their mass falls short; the cumulative sums are the sort's own.
        n = probs.numel()
        for m in (min(n, max(NUCLEUS_LOOK, params.top_k)), n):
            top, order = torch.topk(probs, m) if m < n else torch.sort(probs, descending=True)
            mass_before = torch.cumsum(top, dim=-1) - top
            if m == n or bool(mass_before[-1] >= params.top_p):
                break
        kept = torch.zeros_like(probs)
        keep = order[mass_before < params.top_p]
        kept[keep] = probs[keep]
        probs = kept / kept.sum()
    return probs


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
    allowed: Sequence[torch.Tensor | None] | None = None,
) -> list[int]:
    """One next token per row of `logits` [n, vocab]; `allowed[row]` (bool [vocab], a grammar's
    mask) leaves only those tokens to choose from."""
    if allowed is not None and any(a is not None for a in allowed):
        logits = logits.clone()
        for row, a in enumerate(allowed):
            if a is not None:
                logits[row].masked_fill_(~a.to(logits.device), float("-inf"))
    greedy_ids = argmax_rows(logits) if any(p.greedy for p in params) else []
    out = []
    for row, (p, gen) in enumerate(zip(params, generators)):
        if p.greedy:
            out.append(int(greedy_ids[row]))
        else:
            # On the host, where the sequence's generator is: a seed then draws the same tokens
            # on a CPU and a CUDA stage (and a CUDA tensor cannot take a CPU generator).
            probs = filtered_probs(logits[row].cpu(), p)
            out.append(int(torch.multinomial(probs, 1, generator=gen).item()))
    return out


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """The first index of each row's largest logit (torch.argmax's rule, NaN counting as the
    largest, as both do). On the host through numpy: 13x faster than torch's argmax over a 49k
    vocabulary (4 against 45 us a row, measured), which a greedy batch of 16 pays every step."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return logits.numpy().argmax(axis=-1).tolist()
    return torch.argmax(logits, dim=-1).tolist()


@dataclass
class TokenLogprob:
    """A sampled token's log-probability under the model, and the `len(top)` likeliest tokens."""
    token: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, log-probability), likeliest first


def token_logprobs(logits: torch.Tensor, token: int, n_top: int) -> TokenLogprob:
    """From one row of the logits the token was sampled from: log-softmax of the model's own
    distribution (before temperature, top-k/top-p and any grammar mask), as vLLM reports them."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    top = torch.topk(logp, n_top) if n_top > 0 else None
    pairs = [] if top is None else list(zip(top.indices.tolist(), top.values.tolist()))
    return TokenLogprob(token, float(logp[token]), pairs)


@dataclass
class StepOutput:
    """What the last stage returns for one micro-batch: a token per row (None: the row was a prompt
    chunk with more to come; a list for a verify row: its accepted drafts and one more token) and,
    where its params asked, that token's log-probabilities (a list of them for a verify row)."""
    tokens: list[int | list[int] | None]
    logprobs: list[TokenLogprob | list[TokenLogprob] | None] | None = None

    @classmethod
    def of(cls, result) -> "StepOutput":
        """A pipeline may return a bare token list (no row asked for log-probabilities)."""
        return result if isinstance(result, StepOutput) else cls(list(result))


class WindowDecoder:
    """`tokenizer.decode(ids)` of a growing list of ids at a cost that does not grow with it.

    Decoding a prefix can change its last characters (an incomplete UTF-8 sequence), so the text is
    decoded again as tokens arrive, but only from a settled point on: the text of `ids[:base]` is
    kept once every later decode starts with it, and the tokens after it are decoded with a few
    before them as context (a SentencePiece decoder drops the leading space of a text's first
    token: the context's text is cut off, not the window's). A decode that does not start with its
    context's text falls back to the whole sequence, so the text is always decode(ids) itself.
    """

    CONTEXT = 4  # tokens decoded before the window
    SETTLE = 16  # the settled point moves up to this many tokens behind the last one

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.base, self.base_text = 0, ""  # ids[:base] decode to base_text, a prefix of every later text
        self.context_text = ""  # decode(ids[base - CONTEXT:base])

    def push(self, token_id: int) -> str:
        """Add one token; returns decode(ids)."""
        self.ids.append(token_id)
        text = self.decode()
        if len(self.ids) - self.base >= 2 * self.SETTLE and not text.endswith("\ufffd"):
            base = len(self.ids) - self.SETTLE
            head = self._window(base)
            context = self.tokenizer.decode(self.ids[max(0, base - self.CONTEXT):base])
            # Only at a clean cut: no character of the context or the head still being built (a
            # byte-fallback token's bytes decode to U+FFFD until their character is whole).
            if head is not None and "\ufffd" not in context and not head.endswith("\ufffd") and text.startswith(head):
                self.base, self.base_text, self.context_text = base, head, context
        return text

    def decode(self) -> str:
        text = self._window(len(self.ids))
        return text if text is not None else self.tokenizer.decode(self.ids)

    def _window(self, end: int) -> str | None:
        if self.base == 0:
            return self.tokenizer.decode(self.ids[:end])
        head = self.context_text
        window = self.tokenizer.decode(self.ids[max(0, self.base - self.CONTEXT):end])
        return self.base_text + window[len(head):] if window.startswith(head) else None


class StopStringStream:
    """Incremental text of one generation, cut at the first stop string.

    The text is decode(all generated ids) (WindowDecoder: a bounded window decoded per token), and
    released only when it can no longer change: not ending in a partial character, and not
    possibly the start of a stop string.
    """

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.decoder = WindowDecoder(tokenizer)
        self.emitted = 0  # characters of the decoded text already released
        self.text = ""  # the final text once stopped or finished
        self.stopped = False

    @property
    def ids(self) -> list[int]:
        return self.decoder.ids

    def push(self, token_id: int) -> str:
        """Add one token; returns the newly released text ("" if held back)."""
        assert not self.stopped
        text = self.decoder.push(token_id)
        cut = self._first_stop(text)
        if cut is not None:
            self.stopped = True
            return self._release(text, max(cut, self.emitted))
        safe = len(text)
        while safe > self.emitted and text[safe - 1] == "\ufffd":  # a character still being built
            safe -= 1
        safe -= self._held_for_stop(text[:safe])
        return self._release(text, max(safe, self.emitted))

    def finish(self) -> str:
        """The generation ended without a stop string: release what was held back."""
        if self.stopped:
            return ""
        self.stopped = True
        text = self.decoder.decode()
        return self._release(text, len(text))

    def _release(self, text: str, end: int) -> str:
        delta = text[self.emitted:end]
        self.emitted = end
        self.text = text[:end]
        return delta

    def _first_stop(self, text: str) -> int | None:
        # A stop string may straddle already-released text by up to len(stop) - 1 characters.
        hits = [i for s in self.stop if (i := text.find(s, max(0, self.emitted - len(s) + 1))) >= 0]
        return min(hits) if hits else None

    def _held_for_stop(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest
