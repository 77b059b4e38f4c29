"""The n-gram drafter: guesses a sequence's next tokens from its own past (prompt + output so far).

When a model copies (rewrites code with one change, quotes a paragraph, re-formats JSON), the
tokens after its last few tokens already appeared after the same few tokens earlier in the
sequence. The drafter finds the latest earlier occurrence of the longest suffix it can (from
`n_max` tokens down to `n_min`) and proposes the tokens that followed it, continuing through its
own proposal where the copy runs into the present (a repeated line keeps repeating), as
llama-server's ngram-simple and ngram-mod modes and vLLM's n-gram proposer do. No extra model,
no device memory; the target's verification keeps the output exact.

The index is incremental: each appended token adds one entry per n-gram length (the position of
the token that follows that n-gram), so drafting costs a few dict lookups, not a scan.

A draft says how sure it is by its match: how many tokens before it agree with the text before
its source, counted past `n_max` (up to `run_max`) once the n-gram is found. A copy in progress
(a function rewritten with one name changed, a quoted paragraph) has matched for dozens of tokens
and goes on; a 2-token match is a guess. llama-server's ngram-mod drafts only after a 24-token
match, and then 48 to 64 tokens at once; here the match length selects the acceptance record the
draft is priced with (cluster/speculation.py), so a long copy drafts long rows and a short match
short ones, or none.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NgramConfig:
    n_min: int = 2  # the shortest suffix looked up (1 would draft after any repeated token)
    n_max: int = 8  # the longest looked up; a longer match is a surer copy (the acceptance is kept per length)
    run_max: int = 64  # how far back a found match is followed to measure it (Draft.match)

    def __post_init__(self) -> None:
        if not 1 <= self.n_min <= self.n_max:
            raise ValueError(f"n-gram drafter: need 1 <= n_min <= n_max, got {self.n_min}, {self.n_max}")
        if self.run_max < self.n_max:
            raise ValueError(f"n-gram drafter: need run_max >= n_max, got {self.run_max}, {self.n_max}")


@dataclass
class Draft:
    tokens: list[int]
    match: int  # the tokens before the draft that agree with those before its source (0: no draft), at most run_max


class NgramDrafter:
    """One sequence's token history and its n-gram index."""

    def __init__(self, config: NgramConfig = NgramConfig(), tokens=()):
        self.config = config
        self.tokens: list[int] = []
        # per n: the n-gram (a tuple) -> the position of the token that followed its latest occurrence
        self.follow: list[dict[tuple, int]] = [{} for _ in range(config.n_max + 1)]
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens) -> None:
        toks, c = self.tokens, self.config
        for t in tokens:
            toks.append(int(t))
            end = len(toks) - 1  # the new token's position: it follows the n-grams ending just before it
            for n in range(c.n_min, min(c.n_max, end) + 1):
                self.follow[n][tuple(toks[end - n:end])] = end

    def draft(self, max_tokens: int) -> Draft:
        """Up to `max_tokens` guessed next tokens, from the longest suffix seen before."""
        toks, c = self.tokens, self.config
        if max_tokens < 1:
            return Draft([], 0)
        for n in range(min(c.n_max, len(toks) - 1), c.n_min - 1, -1):
            pos = self.follow[n].get(tuple(toks[-n:]))
            if pos is None:
                continue
            out: list[int] = []
            L = len(toks)
            while len(out) < max_tokens:  # toks + out, read from pos on: always behind its own end
                i = pos + len(out)
                out.append(toks[i] if i < L else out[i - L])
            match = n  # and how much further back the copy agrees
            while match < c.run_max and match < pos and toks[L - 1 - match] == toks[pos - 1 - match]:
                match += 1
            return Draft(out, match)
        return Draft([], 0)
