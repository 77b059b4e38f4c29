"""Generated tokens to released text, one step at a time: incremental decoding, then stop strings.

`IncrementalDecoder` turns a growing list of token ids into text at a cost that does not grow with
it: each step decodes only the tokens since the last clean point, with the few before them as
context (the offsets vLLM and TGI detokenise with), so the concatenated text is decode(all ids).
A text ending in U+FFFD is a character still being built (an incomplete UTF-8 sequence, or a
byte-fallback token's bytes): what comes before it is settled, it waits for the next tokens.

`StopMatcher` finds a request's stop strings in one pass over a step's new text: for each length
among the stop strings, the substrings that end in the new text are looked up in a set, so the
cost follows the new characters and the number of distinct lengths, not the number of strings or
their size (a compiled regex of 1,000 long stop strings takes seconds to build). It also says how
much of the text's end may still begin a stop string (held back until it cannot).

`StopStringStream` is one request's text: settled text pushed through the matcher, released in
pieces (`pieces`, appended only) when it can no longer change or begin a stop string.
"""
from __future__ import annotations

import bisect
import functools
import time
from typing import Sequence

REPLACEMENT = "\ufffd"


class IncrementalDecoder:
    """decode(ids) of a growing list of ids, returned as the settled text each push adds.

    ids[prefix:read] decode to `prefix_text` (already returned); a push decodes ids[prefix:] and
    returns what follows prefix_text, up to a trailing run of U+FFFD (a character still being
    built, returned once it is whole, or by `flush`). When the new text ends cleanly the window
    moves on: prefix to read, read to the end."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = self.read = 0
        self.prefix_text = ""
        self.sent = 0  # characters past prefix_text already returned (a window whose end is not clean)
        self.tail = ""  # past prefix_text: the last decode's text (its unsettled end included)
        self.returned = 0  # characters returned so far

    def push(self, token_ids: Sequence[int]) -> str:
        """Add tokens; returns the settled text they add ("" while a character is being built)."""
        self.ids.extend(token_ids)
        text = self.tokenizer.decode(self.ids[self.prefix:])
        if not text.startswith(self.prefix_text):
            # A decoder whose text is not additive here (none of moeray's): the window becomes the
            # whole sequence until it ends cleanly again.
            self.prefix = self.read = 0
            self.prefix_text, self.sent = "", self.returned
            text = self.tokenizer.decode(self.ids)
        tail = self.tail = text[len(self.prefix_text):]
        end = len(tail)
        while end > self.sent and tail[end - 1] == REPLACEMENT:
            end -= 1
        out = tail[self.sent:end]
        if end == len(tail):  # a clean end: the window moves on
            self.prefix, self.read = self.read, len(self.ids)
            self.prefix_text = self.tokenizer.decode(self.ids[self.prefix:self.read])
            self.sent, self.tail = 0, ""
        else:
            self.sent = end
        self.returned += len(out)
        return out

    def pending(self) -> str:
        """The text decoded but not settled yet (a character still being built)."""
        return self.tail[self.sent:]

    def flush(self) -> str:
        """The generation ended: what is still pending, as decode(all ids) ends (U+FFFD included)."""
        out = self.pending()
        self.sent += len(out)
        self.returned += len(out)
        return out

    def state(self) -> tuple:
        return len(self.ids), self.prefix, self.read, self.prefix_text, self.sent, self.tail, self.returned

    def restore(self, state: tuple) -> None:
        n, self.prefix, self.read, self.prefix_text, self.sent, self.tail, self.returned = state
        del self.ids[n:]


class StopMatcher:
    """A request's stop strings, ready for one pass per step (built once per distinct set)."""

    def __init__(self, stops: Sequence[str]):
        stops = sorted({s for s in stops if s})
        self.stops = tuple(stops)  # sorted: the strings with a given prefix are neighbours
        self.by_length: dict[int, frozenset[str]] = {}
        for s in stops:
            self.by_length.setdefault(len(s), set()).add(s)
        self.by_length = {n: frozenset(v) for n, v in sorted(self.by_length.items())}
        self.longest = max(self.by_length, default=0)
        self.first_chars = frozenset(s[0] for s in stops)

    def __bool__(self) -> bool:
        return bool(self.stops)

    def find(self, window: str, new_from: int) -> int | None:
        """The start, in `window`, of the earliest stop string that ends past `new_from` (the
        window's characters before it were checked by earlier steps), else None."""
        best = None
        n = len(window)
        for length, strings in self.by_length.items():
            first = max(0, new_from - length + 1)  # starts whose string ends in the new text
            for i in range(first, n - length + 1):
                if best is not None and i >= best:
                    break
                if window[i] in self.first_chars and window[i:i + length] in strings:
                    best = i
                    break
        return best

    def held(self, window: str, candidates_from: int) -> int:
        """Length of the longest end of `window` that begins a stop string (a proper prefix of
        one), looking only at starts from `candidates_from` on (an earlier start would have been
        held at the last step too)."""
        n = len(window)
        for i in range(max(0, candidates_from, n - self.longest + 1), n):
            if window[i] in self.first_chars:
                rest = window[i:]
                j = bisect.bisect_left(self.stops, rest)
                if j < len(self.stops) and self.stops[j].startswith(rest):
                    return n - i
        return 0


@functools.lru_cache(maxsize=256)
def stop_matcher(stops: tuple[str, ...]) -> StopMatcher:
    """The matcher of a stop set, built once (a server builds it off the engine thread first)."""
    return StopMatcher(stops)


class StopStringStream:
    """Incremental text of one generation, cut at the first stop string.

    The text is decode(all generated ids), released in `pieces` (appended only) when it can no
    longer change: not a character still being built, and not possibly the start of a stop
    string. `detok_ns` and `stop_ns` count the time spent decoding and matching (cluster/timeline.py)."""

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.matcher = stop_matcher(tuple(stop))
        self.stop = self.matcher.stops
        self.decoder = IncrementalDecoder(tokenizer)
        self.pieces: list[str] = []  # the released text, in the order it was released
        self.emitted = 0  # characters released
        self.window = ""  # the settled text's end the matcher still needs: released tail + held
        self.held = 0  # of the window's end, characters held back (they may begin a stop string)
        self.stopped = False
        self.detok_ns = self.stop_ns = 0
        self._text: str | None = ""

    @property
    def ids(self) -> list[int]:
        return self.decoder.ids

    @property
    def text(self) -> str:
        """The text released so far (final once stopped or finished)."""
        if self._text is None:
            self._text = "".join(self.pieces)
        return self._text

    def push(self, token_id: int) -> str:
        """Add one token; returns the newly released text ("" if held back)."""
        return self.push_many((token_id,))[1]

    def push_many(self, token_ids: Sequence[int]) -> tuple[int, str]:
        """Add a step's tokens (several for an accepted draft), decoded and matched in one pass.
        Returns how many of them were taken (all, or up to the one completing a stop string: the
        generation ends there) and the newly released text."""
        assert not self.stopped
        if len(token_ids) > 1 and self.matcher:
            saved = self._state()
            taken, text = self._push(token_ids)
            if not self.stopped:
                return taken, text
            self._restore(saved)  # a stop string: which token completed it, one at a time
            out = []
            for n, tok in enumerate(token_ids, 1):
                out.append(self._push((tok,))[1])
                if self.stopped:
                    return n, "".join(out)
            return len(token_ids), "".join(out)
        return self._push(token_ids)

    def _push(self, token_ids: Sequence[int]) -> tuple[int, str]:
        t0 = time.perf_counter_ns()
        new = self.decoder.push(token_ids)
        t1 = time.perf_counter_ns()
        self.detok_ns += t1 - t0
        out = self._settle(new) if new else ""
        self.stop_ns += time.perf_counter_ns() - t1
        return len(token_ids), out

    def _settle(self, new: str) -> str:
        """Settled text `new` through the matcher; returns what it releases."""
        if not self.matcher:
            return self._release(new)
        m = self.matcher
        checked = len(self.window)
        window = self.window + new
        cut = m.find(window, checked)
        if cut is not None:  # the text ends before the stop string
            self.stopped = True
            keep = cut - (len(self.window) - self.held)  # of the held characters and `new`, before the cut
            held_text = window[len(self.window) - self.held:]
            return self._release(held_text[:max(keep, 0)])
        held = m.held(window, checked - self.held)
        released = window[len(self.window) - self.held:len(window) - held]
        keep = m.longest - 1  # what a later stop string may span (the held characters are within it)
        self.window, self.held = window[-keep:] if keep else "", held
        return self._release(released)

    def _release(self, text: str) -> str:
        if text:
            self.pieces.append(text)
            self.emitted += len(text)
            self._text = None
        return text

    def finish(self) -> str:
        """The generation ended without a stop string: release what was held back."""
        if self.stopped:
            return ""
        self.stopped = True
        held = self.window[len(self.window) - self.held:] if self.held else ""
        return self._release(held + self.decoder.flush())

    def _state(self) -> tuple:
        return self.decoder.state(), len(self.pieces), self.emitted, self.window, self.held, self._text

    def _restore(self, state: tuple) -> None:
        decoder, n_pieces, self.emitted, self.window, self.held, self._text = state
        self.decoder.restore(decoder)
        del self.pieces[n_pieces:]
        self.stopped = False
