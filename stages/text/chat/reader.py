"""Reading a reply as it is generated: reasoning, content and tool calls, one text delta at a time.

One reader serves both kinds of response: a whole one feeds it the full text and closes it (the
Message it accumulated is the answer); a stream sends each Delta as it comes. So a streamed reply
adds up to the whole one by construction. Markers are looked for in the text itself (the
detokenizer renders the format's marker tokens, stages/text/chat/base.py), and a tail that may be
the start of a marker is held back until the next delta says whether it is one.

The generic reader covers formats built of markers around reasoning and calls:

    [<think>] reasoning </think>  content  [section-begin] call-begin CALL call-end ... [section-end]

The format (a ChatFormat) names the markers and reads one call's text (`parse_call`); harmony's
channels have their own reader (harmony.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from moeray.stages.text.chat.message import CallDelta, Delta, Message, new_call_id


def held_back(text: str, markers) -> int:
    """Length of the longest end of `text` that is the start of one of `markers` (not a whole one)."""
    longest = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), longest, -1):
            if text.endswith(m[:n]):
                longest = n
                break
    return longest


class Segments:
    """Text of one kind (content or reasoning) written in segments (between a format's markers),
    each trimmed of the whitespace at its ends and joined by a blank line. Trailing whitespace is
    held until more text shows it is inside the segment, so a stream trims exactly as a whole read."""

    SEPARATOR = "\n\n"

    def __init__(self):
        self.written = False  # any text sent yet
        self.fresh = True  # the current segment has no text yet
        self.spaces = ""  # whitespace held at the end of the current segment

    def add(self, text: str) -> str:
        if self.fresh:
            text = text.lstrip()
            if not text:
                return ""
        body = self.spaces + text
        kept = body.rstrip()
        self.spaces = body[len(kept):]
        if not kept:
            return ""
        prefix = self.SEPARATOR if self.fresh and self.written else ""
        self.fresh, self.written = False, True
        return prefix + kept

    def end(self) -> tuple[bool, str]:
        """The segment ended (a marker or the reply): its trailing whitespace is dropped. Returns
        what `resume` needs to take the segment up again (the marker was text after all)."""
        state = (self.fresh, self.spaces)
        self.fresh, self.spaces = True, ""
        return state

    def resume(self, state: tuple[bool, str]) -> None:
        self.fresh, self.spaces = state


@dataclass
class CallParse:
    """One call's text read so far: `name` once it is whole, `arguments` a prefix of the final
    arguments (the whole of them once the call is done), `id` when the model writes its own."""
    name: Optional[str] = None
    arguments: str = ""
    id: Optional[str] = None


@dataclass
class _Call:
    index: int = -1  # -1 until its name was sent
    id: str = ""
    sent: str = ""  # arguments sent so far


class Reader:
    def __init__(self, fmt, tools: Optional[list[dict]], thinking_open: bool):
        self.fmt, self.tools = fmt, tools
        self.buf = ""
        self.mode = "reasoning" if thinking_open and fmt.think else "start"
        self.content, self.reasoning = Segments(), Segments()
        self.message = Message()
        self.n_calls = 0  # indices handed out (a call gets one when its name is sent)
        self.call: Optional[_Call] = None
        self.raw = ""  # marker text consumed since the last thing sent: content again if the call breaks
        self.before = None  # the content segment a call interrupted (Segments.end), until a call succeeds
        self.broke = False  # a call of the current section was malformed: its end marker is text too
        self.cut = False  # close(cut=True): max_tokens ended the reply

    # ------------------------------------------------------------------ API
    def feed(self, text: str) -> Delta:
        self.buf += text
        return self._run(final=False)

    def close(self, cut: bool = False) -> Delta:
        """The reply ended: what was held back is decided. `cut`: max_tokens ended it (finish_reason
        "length"), so a call still open is incomplete: it is dropped (a stream already sent its first
        pieces; `broken` names it), the complete calls before it stay, and nothing of its markers
        becomes content, nor does a marker's start held back at the end."""
        self.cut = cut
        return self._run(final=True)

    # ------------------------------------------------------------------ the state machine
    def _run(self, final: bool) -> Delta:
        out = Delta()
        while getattr(self, "_" + self.mode)(out, final):
            pass
        self.message.add(out)
        return out

    def _start(self, out: Delta, final: bool) -> bool:
        """Before anything: does the reply open with reasoning?"""
        text = self.buf.lstrip()
        opener = self.fmt.think[0] if self.fmt.think else None
        if opener and text.startswith(opener):
            self.buf, self.mode = text[len(opener):], "reasoning"
            return True
        if not final and (not text or (opener and opener.startswith(text))):
            return False
        if final and self.cut and text and opener and opener.startswith(text):
            self.buf = ""  # max_tokens cut the opening marker itself
        self.mode = "content"
        return True

    def _reasoning(self, out: Delta, final: bool) -> bool:
        closer = self.fmt.think[1]
        at = self.buf.find(closer)
        if at >= 0:
            out.reasoning += self.reasoning.add(self.buf[:at])
            self.reasoning.end()
            self.buf, self.mode = self.buf[at + len(closer):], "content"
            return True
        keep = held_back(self.buf, (closer,)) if not final or self.cut else 0
        out.reasoning += self.reasoning.add(self.buf[:len(self.buf) - keep])
        self.buf = "" if final else self.buf[len(self.buf) - keep:]
        return False

    def _openers(self) -> tuple[str, ...]:
        if self.tools is None or self.fmt.call is None:
            return ()
        return (self.fmt.section[0],) if self.fmt.section else (self.fmt.call[0],)

    def _content(self, out: Delta, final: bool) -> bool:
        openers = self._openers()
        hits = [(at, m) for m in openers if (at := self.buf.find(m)) >= 0]
        if hits:
            at, marker = min(hits)
            out.content += self.content.add(self.buf[:at])
            self.before = self.content.end()
            self.buf, self.raw = self.buf[at + len(marker):], marker
            self.mode = "section" if self.fmt.section else "call"
            if not self.fmt.section:
                self.call = _Call()
            return True
        keep = held_back(self.buf, openers) if not final or self.cut else 0
        out.content += self.content.add(self.buf[:len(self.buf) - keep])
        self.buf = "" if final else self.buf[len(self.buf) - keep:]
        return False

    def _section(self, out: Delta, final: bool) -> bool:
        """Between the calls of a section: the next call, the section's end, or something else."""
        begin, end = self.fmt.call[0], self.fmt.section[1]
        text = self.buf.lstrip()
        if text.startswith(begin):
            self.raw += self.buf[:len(self.buf) - len(text)] + begin
            self.buf, self.mode, self.call = text[len(begin):], "call", _Call()
            return True
        if text.startswith(end):
            self.buf, self.mode, self.raw = text[len(end):], "content", ""
            if self.broke:
                self._as_text(out, end)
            self.content.end()
            self.broke = False
            return True
        if not final and (begin.startswith(text) or end.startswith(text)):
            return False
        if final and self.cut and (begin.startswith(text) or end.startswith(text)):
            # max_tokens ended the section between its calls: the calls stand, its markers are no text
            self.buf, self.raw, self.mode = "", "", "content"
            return False
        # Not a call after all: what was taken for markup is text.
        self._as_text(out, self.raw)
        self.mode = "content"
        return True

    def _call(self, out: Delta, final: bool) -> bool:
        closer = self.fmt.call[1]
        at = self.buf.find(closer)
        done = at >= 0 or final
        inner = self.buf[:at] if at >= 0 else self.buf
        parsed = self.fmt.parse_call(inner, done, self.tools)
        call = self.call
        if not done:
            if parsed is not None and parsed.name:
                self._send(out, call, parsed)
            return False
        if at < 0 and self.cut:
            # max_tokens ended the reply inside this call: it is incomplete, and dropped whole
            if call.index >= 0:
                out.broken.append(call.index)
            self.raw, self.call, self.buf, self.mode = "", None, "", "content"
            return False
        rest = self.buf[at + len(closer):] if at >= 0 else ""
        if parsed is None or not parsed.name or not parsed.arguments.startswith(call.sent):
            # Malformed: the call's whole text becomes content, nothing the model wrote is lost.
            if call.index >= 0:
                out.broken.append(call.index)
            self._as_text(out, self.raw + inner + (closer if at >= 0 else ""))
            self.broke = True
        else:
            self._send(out, call, parsed)
            self.before = None
        self.raw, self.call, self.buf = "", None, rest
        self.mode = "section" if self.fmt.section else "content"
        return True

    def _as_text(self, out: Delta, text: str) -> None:
        """Text taken for a call that was none: content, in its place (the interrupted segment goes on)."""
        if self.before is not None:
            self.content.resume(self.before)
            self.before = None
        out.content += self.content.add(text)
        self.raw = ""

    def _send(self, out: Delta, call: _Call, parsed: CallParse) -> None:
        if call.index < 0:
            call.index, call.id = self.n_calls, parsed.id or new_call_id()
            self.n_calls += 1
            out.calls.append(CallDelta(call.index, call.id, parsed.name, ""))
        if parsed.arguments.startswith(call.sent) and len(parsed.arguments) > len(call.sent):
            out.calls.append(CallDelta(call.index, arguments=parsed.arguments[len(call.sent):]))
            call.sent = parsed.arguments


class PlainReader:
    """No format: the reply is content, as written."""

    def __init__(self):
        self.message = Message()

    def feed(self, text: str) -> Delta:
        d = Delta(content=text)
        self.message.add(d)
        return d

    def close(self, cut: bool = False) -> Delta:
        return Delta()
