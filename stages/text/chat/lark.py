"""Pieces of the llguidance grammars that force a tool call in a family's own format.

A marker that is an added token of the vocabulary (DeepSeek's <｜tool▁call▁begin｜>, harmony's
<|channel|>, and Qwen's <tool_call> too, though it decodes as text) is not text to the grammar
engine, which takes every added token for a special one: it is named by its id, `<[id]>`, so the
model writes it as the one token it was trained on. Any other marker is a string. Arguments are
JSON matching the function's schema (`%json`, written as people and models write it: ", " and ": ",
no free whitespace, see stages/text/grammar.py), its objects holding only the properties they list
(grammar.py `confined`), or, for the formats that write each argument on its own (Qwen3-Coder's
<parameter=...>, GLM's <arg_value>), a string argument as raw text (none of the format's markup in
it) and any other as JSON.
"""
from __future__ import annotations

import json
from typing import Optional

from moeray.stages.text.grammar import JSON_STYLE, confined


class Lark:
    def __init__(self, tokenizer):
        self.special = special_tokens(tokenizer)
        self.rules: list[str] = []
        self._n = 0

    def lit(self, *pieces: str) -> str:
        """The grammar of these texts one after another (special tokens by id)."""
        out = []
        for p in pieces:
            for part in self.split(p):
                out.append(f"<[{self.special[part]}]>" if part in self.special else json.dumps(part, ensure_ascii=False))
        return " ".join(out) or '""'

    def split(self, text: str) -> list[str]:
        """`text` cut into its added tokens and the text between them."""
        out, i = [], 0
        while i < len(text):
            hits = [(at, t) for t in self.special if (at := text.find(t, i)) >= 0]
            if not hits:
                out.append(text[i:])
                break
            at, token = min(hits, key=lambda h: (h[0], -len(h[1])))
            if at > i:
                out.append(text[i:at])
            out.append(token)
            i = at + len(token)
        return out

    def json(self, schema: Optional[dict]) -> str:
        """A JSON value matching `schema`, its objects confined to the properties they list
        (stages/text/grammar.py confined)."""
        schema = confined(schema) if isinstance(schema, dict) and schema else {"type": "object"}
        return f"%json {json.dumps({**schema, 'x-guidance': JSON_STYLE})}"

    def rule(self, body: str, options: str = "") -> str:
        """A new named rule for `body`; returns its name."""
        self._n += 1
        name = f"r{self._n}"
        self.rules.append(f"{name}{f'[{options}]' if options else ''}: {body}")
        return name

    def text_until(self, end: str, forbid: tuple[str, ...] = (), length: Optional[tuple[int, Optional[int]]] = None) -> str:
        """Any text up to and including the first `end`; with `forbid`, text that holds none of
        those markers (a string argument written raw cannot run on into the next call's markup,
        which the reader would take for the argument's end); `length`: (at least, at most) characters
        before `end` (a string argument's minLength and maxLength)."""
        first, *rest = self.split(end)
        lo, hi = length or (0, None)
        span = "*" if (lo, hi) == (0, None) else f"{{{lo},{'' if hi is None else hi}}}"
        # Free text cannot hold an added token: before one it ends where the token comes; before
        # text it is lazy, ending at the first `end`.
        token = first in self.special
        body = f"/(?s:.{span})/" if token else f"/(?s:.{span}){_regex_escape(first)}/"
        tail = self.lit(first, *rest) if token else (self.lit(*rest) if rest else "")
        if forbid:
            # The text holds none of the markers, nor the end's own marker (the reader ends the text at
            # the first one, with or without the whitespace the end writes around it); then the end.
            markers = forbid if token else (*forbid, first.strip())
            self._n += 1
            text, terminal = f"T{self._n}A", f"T{self._n}"
            pattern = "|".join(_regex_escape(m) for m in markers)
            self.rules.append(f"{text}: /(?s:.{span})/ & ~/(?s:.*)({pattern})(?s:.*)/")
            self.rules.append(f"{terminal}: {text}" + ("" if token else f" {json.dumps(first, ensure_ascii=False)}"))
            body = terminal
        text = self.rule(body, "" if token else "lazy")
        return f"{text} {tail}" if tail else text

    def grammar(self, start: str) -> str:
        from moeray.stages.text.grammar import lark_grammar

        return lark_grammar("\n".join([f"start: {start}", *self.rules]) + "\n")


def special_tokens(tokenizer) -> dict[str, int]:
    """Text -> id of the tokens the grammar engine treats as special (not text): every added token."""
    return {t.content: i for i, t in tokenizer.backend.get_added_tokens_decoder().items()}


def _regex_escape(text: str) -> str:
    out = []
    for ch in text:
        if ch == "\n":
            out.append("\\n")
        elif ch == "/":
            out.append("\\/")
        elif ch.isalnum() or ch in " _-=:,'\"<>!@#%&~`" or ord(ch) > 127:
            out.append(ch)
        else:
            out.append("\\" + ch)
    return "".join(out)


def value_rule(g: Lark, schema: Optional[dict], end: str, sep: str = "", after: str = "",
               forbid: tuple[str, ...] = ()) -> str:
    """One argument written on its own: its value, then `sep`, `end` and `after`. A string argument is
    raw text holding none of the `forbid` markers, within its minLength and maxLength (or one of its
    enum values); anything else is JSON."""
    schema = schema if isinstance(schema, dict) else {}
    if schema.get("type") == "string":
        if isinstance(schema.get("enum"), list) and all(isinstance(v, str) for v in schema["enum"]):
            return "(" + " | ".join(g.lit(v + sep + end + after) for v in schema["enum"]) + ")"
        lo, hi = schema.get("minLength"), schema.get("maxLength")
        length = (lo if isinstance(lo, int) else 0, hi if isinstance(hi, int) else None)
        text = g.text_until(sep + end, forbid, length)
        return f"{text} {g.lit(after)}" if after else text
    return f"{g.json(schema or {})} {g.lit(sep + end + after)}"


def is_string_argument(function: Optional[dict], name: str) -> bool:
    """Whether the function's schema says argument `name` is a string (then it is written raw)."""
    props = ((function or {}).get("parameters") or {}).get("properties") or {}
    spec = props.get(name)
    return isinstance(spec, dict) and spec.get("type") == "string"


def argument_value(function: Optional[dict], name: str, text: str):
    """An argument written on its own, as a JSON value: raw text for a string argument (or one the
    schema does not know, when it is not JSON), JSON otherwise (vLLM's and llama.cpp's rule)."""
    if is_string_argument(function, name):
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def find_function(tools: Optional[list[dict]], name: str) -> Optional[dict]:
    for t in tools or ():
        f = t.get("function") or {}
        if f.get("name") == name:
            return f
    return None
