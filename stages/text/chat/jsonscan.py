"""Where a JSON value ends, in text that is still arriving.

A streamed tool call sends its arguments as they are written; a format whose arguments are JSON
text inside other markup (Hermes' `{"name": ..., "arguments": {...}}`, DeepSeek's fenced block)
must know which characters belong to the arguments before the value is complete. This scanner
follows strings, escapes and bracket nesting only: it finds the end and rejects a wrong closing
bracket; json.loads still judges the finished value.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

_OPEN = {"{": "}", "[": "]"}
_WS = " \t\r\n"


@dataclass
class Scan:
    start: int  # where the value starts (after leading whitespace); == len(text) when none yet
    end: Optional[int]  # one past its last character when complete, else None
    ok: bool  # False: not the start of a JSON value (a wrong bracket, a stray character)


def scan_value(text: str, pos: int = 0) -> Scan:
    """The JSON value starting at `pos` (after whitespace) in `text`."""
    while pos < len(text) and text[pos] in _WS:
        pos += 1
    start = pos
    if pos == len(text):
        return Scan(start, None, True)
    c = text[pos]
    if c not in _OPEN and c != '"':  # a number or a literal: it ends where its characters end
        i = pos
        while i < len(text) and (text[i].isalnum() or text[i] in "+-."):
            i += 1
        if i == pos:
            return Scan(start, None, False)
        return Scan(start, i if i < len(text) else None, True)
    stack: list[str] = []
    in_string = escaped = False
    for i in range(pos, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
                if not stack:
                    return Scan(start, i + 1, True)
        elif c == '"':
            in_string = True
        elif c in _OPEN:
            stack.append(_OPEN[c])
        elif c in "}]":
            if not stack or stack.pop() != c:
                return Scan(start, None, False)
            if not stack:
                return Scan(start, i + 1, True)
    return Scan(start, None, True)
