"""A reasoning budget: at most N tokens inside a thinking block, then its closing marker is written
for the model, as llama-server's --reasoning-budget and vLLM's thinking_token_budget do.

The budget travels with a sequence's SamplingParams (`reasoning`: a ReasoningBudget, built by the
server from the chat format: the family's markers and the tokens of its closing marker). The last
stage keeps one BudgetState per sequence and watches the text it samples: an opening marker (or a
prompt that ended inside one) starts the count, the closing marker ends it; once the count reaches
the budget (and the text is whole UTF-8), the closing marker's tokens are the only tokens allowed,
one per step, and the reply goes on after it as the family writes it (an answer, or the call a
forced tool choice's grammar asks for). The markers are matched in the text, not as token ids,
so a model that spells `</think>` in several tokens is read right too. A grammar that forbids the
closing marker where it is due wins (the budget gives way, rather than break the grammar).

A budget of 0 closes the block as soon as it opens; the server also turns the family's thinking
switch off where the template has one (ChatFormat.thinking_off), so no block opens at all.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable, Optional, Sequence


@dataclass(frozen=True)
class ReasoningBudget:
    tokens: int  # thinking tokens allowed in a block (0: closed as soon as it opens)
    opener: str  # the text that opens a thinking block in the reply
    closer: str  # the text that closes one
    forced: tuple[int, ...]  # the tokens written for the model once the budget is spent (the closer as the family writes it)
    inside: bool = False  # the prompt ended inside a thinking block: the reply starts in one

    def __post_init__(self) -> None:
        if self.tokens < 0:
            raise ValueError(f"a reasoning budget is a number of tokens >= 0, got {self.tokens}")
        if not self.forced or not self.closer:
            raise ValueError("a reasoning budget needs the closing marker and its tokens")


class BudgetState:
    """One sequence's place in its budget: outside a block, thinking (`spent` tokens so far),
    forcing the closer (`at`: the next of its tokens), or done (until another block opens)."""

    def __init__(self, budget: ReasoningBudget):
        self.budget = budget
        self.opener, self.closer = budget.opener.encode(), budget.closer.encode()
        self.keep = max(len(self.opener), len(self.closer)) - 1  # tail bytes a marker may straddle
        self.tail = b""
        self.partial = 0  # continuation bytes the last character still needs (0: whole UTF-8)
        self.mode, self.spent, self.at = "idle", 0, 0
        if budget.inside:
            self._open()

    def _open(self) -> None:
        self.mode, self.spent, self.tail = "thinking", 0, b""
        if self.budget.tokens == 0:
            self._spent()

    def _spent(self) -> None:
        if self.partial == 0:  # never between the bytes of one character
            self.mode, self.at = "forcing", 0

    def forced(self) -> Optional[int]:
        """The token the sequence must take next (None: any)."""
        return self.budget.forced[self.at] if self.mode == "forcing" else None

    def advance(self, token: int, data: bytes) -> None:
        """The sequence took `token`, whose text is `data`."""
        self._utf8(data)  # (a budget spent in the middle of a character closes after it: _spent)
        if self.mode == "forcing":
            if token == self.budget.forced[self.at]:
                self.at += 1
                if self.at < len(self.budget.forced):
                    return
            # closed, or another token won (a grammar that forbids the closer there): the block is over
            self.mode, self.tail = "done", b""
            return
        text = self.tail + data
        self.tail = text[-self.keep:] if self.keep else b""
        if self.mode == "thinking":
            if self.closer in text:
                self.mode, self.tail = "done", text[text.rindex(self.closer) + len(self.closer):][-self.keep:]
                return
            self.spent += 1
            if self.spent >= self.budget.tokens:
                self._spent()
        elif self.opener and self.opener in text:  # idle or done: a block opens (each gets the whole budget)
            self._open()
            self.tail = text[text.rindex(self.opener) + len(self.opener):][-self.keep:]

    def _utf8(self, data: bytes) -> None:
        for b in data:
            if self.partial and b & 0xC0 == 0x80:
                self.partial -= 1
            elif b >= 0xF0:
                self.partial = 3
            elif b >= 0xE0:
                self.partial = 2
            elif b >= 0xC0:
                self.partial = 1
            else:
                self.partial = 0


class ReasoningBudgets:
    """The budget states of one stage's sequences, by KV slot. `token_bytes(id)` is a token's text."""

    def __init__(self, token_bytes: Callable[[int], bytes]):
        self.token_bytes = token_bytes
        self.states: dict[int, BudgetState] = {}

    def reset(self, slot: int) -> None:
        self.states.pop(slot, None)

    def _state(self, slot: int, budget: ReasoningBudget) -> BudgetState:
        s = self.states.get(slot)
        if s is None or s.budget is not budget and s.budget != budget:
            s = self.states[slot] = BudgetState(budget)
        return s

    def forced(self, slot: int, budget: ReasoningBudget) -> Optional[int]:
        return self._state(slot, budget).forced()

    def forced_along(self, slot: int, budget: ReasoningBudget, draft: Sequence[int]) -> list[Optional[int]]:
        """The token forced at each position of a verify row (stages/text/verify.py): now, then
        after each drafted token in turn (the state itself does not move)."""
        s = copy.copy(self._state(slot, budget))
        out = [s.forced()]
        for d in draft:
            s.advance(d, self.token_bytes(d))
            out.append(s.forced())
        return out

    def advance(self, slot: int, budget: ReasoningBudget, token: int) -> None:
        self._state(slot, budget).advance(token, self.token_bytes(token))
