"""The reasoning budget's bookkeeping (stages/text/reasoning_budget.py), token by token on a made-up
vocabulary: when counting starts and stops, the closing marker's tokens forced one at a time once
the budget is spent, never between the bytes of a character, markers matched across token
boundaries, a grammar that overrules it, and the same answers along a verify row's drafts. The
budget on a real model, with every family's template and a forced call: tests/e2e/test_forced_calls.py."""
from __future__ import annotations

import pytest

from moeray.stages.text.reasoning_budget import BudgetState, ReasoningBudget, ReasoningBudgets

# A vocabulary whose tokens are these texts; the closer is written "</think>" in two tokens.
VOCAB = [b"a", b"b", b" ", b"<think>", b"</", b"think>", b"\xe6", b"\x9d\xb1", b"ok", b"\n"]
A, B, SPACE, OPEN, CLOSE_1, CLOSE_2, HALF_1, HALF_2, OK, NL = range(len(VOCAB))
FORCED = (NL, CLOSE_1, CLOSE_2)  # what the format writes when the budget is spent: "\n</think>"


def budget(tokens: int, inside: bool = False) -> ReasoningBudget:
    return ReasoningBudget(tokens, "<think>", "</think>", FORCED, inside)


def run(state: BudgetState, tokens: list[int]) -> list:
    """The forced token before each of `tokens`, taking them in turn; the last entry: after all."""
    out = []
    for t in tokens:
        out.append(state.forced())
        state.advance(t, VOCAB[t])
    return out + [state.forced()]


def test_a_prompt_left_inside_counts_from_the_first_token_and_the_closer_follows_the_budget():
    s = BudgetState(budget(3, inside=True))
    assert run(s, [A, B, A]) == [None, None, None, NL]
    assert run(s, [NL, CLOSE_1, CLOSE_2, A, B]) == [NL, CLOSE_1, CLOSE_2, None, None, None]  # then free
    assert s.mode == "done"


def test_counting_starts_at_the_opener_and_a_closed_block_is_not_counted():
    s = BudgetState(budget(2))
    assert run(s, [A, B, A, SPACE]) == [None] * 5  # no block: any length
    assert run(s, [OPEN, A]) == [None, None, None]
    assert s.forced() is None and s.spent == 1
    s.advance(B, VOCAB[B])
    assert s.forced() == NL  # two tokens inside: spent
    # A block the model closes itself within its budget costs nothing more; the next gets a fresh one.
    s = BudgetState(budget(3))
    assert run(s, [OPEN, A, CLOSE_1, CLOSE_2, A, B, A, A]) == [None] * 9
    assert run(s, [OPEN, A, A]) == [None, None, None, None]
    s.advance(A, VOCAB[A])
    assert s.forced() == NL


def test_a_budget_of_zero_closes_the_block_at_once():
    assert BudgetState(budget(0, inside=True)).forced() == NL
    s = BudgetState(budget(0))
    assert run(s, [A, OPEN]) == [None, None, NL]


def test_the_closer_never_splits_a_character():
    s = BudgetState(budget(2, inside=True))
    assert run(s, [A, HALF_1]) == [None, None, None]  # spent, but "東" is half written
    assert run(s, [HALF_2]) == [None, NL]


def test_markers_are_found_in_the_text_whatever_the_tokens():
    """'<' '/think>' and '</' 'think>' and one token: the same marker."""
    vocab = VOCAB + [b"<", b"/think>", b"</think>", b"<th", b"ink>"]
    lt, slash_think, whole, th, ink = range(len(VOCAB), len(vocab))

    def feed(s, tokens):
        for t in tokens:
            s.advance(t, vocab[t])

    for spelling in ([lt, slash_think], [CLOSE_1, CLOSE_2], [whole]):
        s = BudgetState(budget(50, inside=True))
        feed(s, [A, *spelling])
        assert s.mode == "done", spelling
    s = BudgetState(budget(1))
    feed(s, [th, ink])
    assert s.mode == "thinking"


def test_a_grammar_that_takes_another_token_ends_the_forcing():
    s = BudgetState(budget(1, inside=True))
    s.advance(A, VOCAB[A])
    assert s.forced() == NL
    s.advance(OK, VOCAB[OK])  # the grammar forbade the closer there: the budget gives way
    assert s.forced() is None and s.mode == "done"


def test_the_stage_keeps_one_state_per_slot_and_a_verify_row_sees_each_position():
    budgets = ReasoningBudgets(lambda t: VOCAB[t])
    b = budget(2, inside=True)
    budgets.advance(0, b, A)
    assert budgets.forced(0, b) is None and budgets.forced(1, b) is None
    # Along drafts A, NL, CLOSE_1: forced nothing now, the closer's tokens after the budget is spent.
    assert budgets.forced_along(0, b, [A, NL, CLOSE_1]) == [None, NL, CLOSE_1, CLOSE_2]
    assert budgets.forced(0, b) is None  # the drafts moved nothing
    budgets.advance(0, b, A)
    assert budgets.forced(0, b) == NL
    budgets.reset(0)
    assert budgets.forced(0, b) is None  # a new sequence in the slot: a new count
    assert budgets.forced(0, budget(0, inside=True)) == NL  # other params: other state


def test_a_budget_needs_the_closer_and_a_count():
    with pytest.raises(ValueError, match=">= 0"):
        budget(-1)
    with pytest.raises(ValueError, match="closing marker"):
        ReasoningBudget(5, "<think>", "</think>", ())
