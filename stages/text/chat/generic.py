"""Generic: tools for a model whose template has no tool format (SmolLM2, Gemma, Phi, Mistral...).

With `tools`, the tools are described in the system message and the reply is one JSON object,
as llama-server's generic format has it:

    {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}
    {"response": "It is sunny in Paris."}

A grammar holds every reply with tools to that shape (tool_choice auto: either object; required
or a named function: the calls only), so a model never trained for it still writes it. Earlier
calls go back to the template as that JSON in the assistant's content, tool results as a user
message {"tool_response": ...}; a template that refuses a system message gets the tool
description at the start of the first user message. Without tools the reply is text as written.

The reply streams as it is written: the "response" string decoded piece by piece as content, each
call's id and name first, then its arguments as the model writes them.
"""
from __future__ import annotations

import json
import re
from typing import Optional

from moeray.errors import MoerayError
from moeray.stages.text.chat.base import ChatFormat
from moeray.stages.text.chat.hermes import read_json_call
from moeray.stages.text.chat.jsonscan import scan_value
from moeray.stages.text.chat.lark import Lark
from moeray.stages.text.chat.message import CallDelta, Delta, Message, new_call_id
from moeray.stages.text.chat.reader import PlainReader, Segments

CALLS_HEAD = re.compile(r'\s*\{\s*"tool_calls"\s*:\s*\[')
RESPONSE_HEAD = re.compile(r'\s*\{\s*"response"\s*:\s*"')
# The heads without their whitespace: a reply that may still become one of them is held back.
HEADS = ('{"tool_calls":[', '{"response":"')

INSTRUCTION = (
    'Reply with one JSON object: {"tool_calls": [{"name": "<tool name>", "arguments": {<the tool\'s '
    'arguments>}}]} to call tools (one item per call), or {"response": "<your reply>"} to answer the user.')


def tools_text(tools: list[dict]) -> str:
    """The tools, one JSON object a line, and how to answer: what the system message gets."""
    lines = ["You can call these tools:"]
    for t in tools:
        f = t["function"]
        spec = {"name": f["name"], "description": f.get("description") or "",
                "parameters": f.get("parameters") or {"type": "object"}}
        lines.append(json.dumps(spec, ensure_ascii=False))
    return "\n".join(lines) + "\n\n" + INSTRUCTION


def call_schema(function: dict) -> dict:
    return {"type": "object", "properties": {"name": {"const": function["name"]},
                                             "arguments": function.get("parameters") or {"type": "object"}},
            "required": ["name", "arguments"], "additionalProperties": False}


class Generic(ChatFormat):
    name = "generic"
    summary = ('any other template: tools in the system message, the reply {"tool_calls": [...]} or '
               '{"response": "..."} (llama-server\'s generic format)')
    think = None
    calls_tools = True  # its own reader (the reply is JSON, not text around markers)

    def tools_problem(self, tokenizer) -> Optional[str]:
        return None  # the tools are described in the system message, whatever the template prints

    def template_messages(self, messages, tools):
        """Earlier calls and results as the JSON turns above (with or without tools now); the tools
        described in the system message."""
        messages, _ = super().template_messages(messages, None)
        names = {}  # call id -> function name, for the results
        out: list[dict] = []
        for m in messages:
            if m["role"] == "assistant" and m.get("tool_calls"):
                calls = []
                for c in m["tool_calls"]:
                    fn = c.get("function") or {}
                    names[c.get("id")] = fn.get("name")
                    calls.append({"name": fn.get("name"), "arguments": fn.get("arguments")})
                text = json.dumps({"tool_calls": calls}, ensure_ascii=False)
                content = m.get("content") or ""
                out.append({"role": "assistant", "content": f"{content}\n{text}" if content else text})
            elif m["role"] == "tool":
                result = {"tool_response": {"name": names.get(m.get("tool_call_id")) or m.get("name"),
                                            "id": m.get("tool_call_id"), "content": m.get("content") or ""}}
                _add_user(out, json.dumps(result, ensure_ascii=False))
            elif m["role"] == "user" and out and out[-1]["role"] == "user":  # after tool results
                _add_user(out, m.get("content") or "")
            else:
                out.append({k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")})
        if not tools:
            return out, None
        text = tools_text(tools)
        if out and out[0]["role"] == "system":
            system = out[0].get("content") or ""
            out[0] = {**out[0], "content": f"{system}\n\n{text}" if system else text}
        else:
            out.insert(0, {"role": "system", "content": text})
        return out, None

    def apply_template(self, tokenizer, messages, tools, variables):
        try:
            return super().apply_template(tokenizer, messages, tools, variables)
        except MoerayError:
            # A template that refuses a system message (Gemma's): its text opens the first user message.
            folded = _fold_system(messages)
            if folded is None:
                raise
            return super().apply_template(tokenizer, folded, tools, variables)

    def reader(self, turn):
        return GenericReader(turn.tools) if turn.tools is not None else PlainReader()

    def forced_grammar(self, turn, tokenizer, name: Optional[str] = None, parallel: bool = True) -> str:
        g = Lark(tokenizer)
        return g.grammar(g.json(self._calls(turn, name, parallel)))

    def auto_grammar(self, turn, tokenizer, parallel: bool = True) -> Optional[str]:
        """tool_choice auto: the calls or a response, nothing else."""
        response = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
                    "additionalProperties": False}
        g = Lark(tokenizer)
        return g.grammar(g.json({"anyOf": [self._calls(turn, None, parallel), response]}))

    @staticmethod
    def _calls(turn, name: Optional[str], parallel: bool) -> dict:
        items = [call_schema(t["function"]) for t in turn.tools or () if name is None or t["function"]["name"] == name]
        array = {"type": "array", "items": items[0] if len(items) == 1 else {"anyOf": items}, "minItems": 1}
        if not parallel:
            array["maxItems"] = 1
        return {"type": "object", "properties": {"tool_calls": array}, "required": ["tool_calls"],
                "additionalProperties": False}


def _add_user(out: list[dict], text: str) -> None:
    """A user message; next to another, one (templates that want turns to alternate refuse two)."""
    if out and out[-1]["role"] == "user":
        out[-1] = {**out[-1], "content": f"{out[-1].get('content') or ''}\n\n{text}"}
    else:
        out.append({"role": "user", "content": text})


def _fold_system(messages: list[dict]) -> Optional[list[dict]]:
    """The system message's text at the start of the first user message (None: there is none)."""
    if not messages or messages[0]["role"] != "system":
        return None
    system, rest = messages[0].get("content") or "", list(messages[1:])
    for i, m in enumerate(rest):
        if m["role"] == "user":
            rest[i] = {**m, "content": f"{system}\n\n{m.get('content') or ''}"}
            return rest
    return [{"role": "user", "content": system}] + rest


class GenericReader:
    """The reply as one JSON object, read as it arrives: {"response": "..."} is content, {"tool_calls":
    [...]} calls; anything else is content as written. Whole and streamed alike (reader.py)."""

    def __init__(self, tools: Optional[list[dict]]):
        self.tools = tools
        self.buf, self.mode = "", "head"
        self.content = Segments()
        self.message = Message()
        self.n_calls = 0
        self.index, self.sent = -1, ""  # the call being read: its index (-1: name not sent yet), arguments sent
        self.raw = ""  # the head, until a call stands: content again if none does
        self.cut = False

    def feed(self, text: str) -> Delta:
        self.buf += text
        return self._run(False)

    def close(self, cut: bool = False) -> Delta:
        """`cut`: max_tokens ended the reply: a call still open is dropped (reader.py Reader.close)."""
        self.cut = cut
        return self._run(True)

    def _run(self, final: bool) -> Delta:
        out = Delta()
        while getattr(self, "_" + self.mode)(out, final):
            pass
        self.message.add(out)
        return out

    def _head(self, out: Delta, final: bool) -> bool:
        for regex, mode in ((CALLS_HEAD, "calls"), (RESPONSE_HEAD, "response")):
            m = regex.match(self.buf)
            if m:
                self.raw, self.buf, self.mode = self.buf[:m.end()], self.buf[m.end():], mode
                return True
        text = re.sub(r"\s+", "", self.buf)
        maybe = any(h.startswith(text) for h in HEADS)  # (whitespace aside: the heads have none that counts)
        if maybe and not final:
            return False
        if maybe and self.cut:
            self.buf = ""
            return False
        self.mode = "text"
        return True

    def _text(self, out: Delta, final: bool) -> bool:
        out.content += self.content.add(self.buf)
        self.buf = ""
        return False

    def _response(self, out: Delta, final: bool) -> bool:
        end, safe = _string_end(self.buf)
        if end is None:
            body = self.buf if final else self.buf[:safe]
            out.content += self.content.add(_decode(body))
            self.buf = self.buf[len(body):]
            return False
        out.content += self.content.add(_decode(self.buf[:end]))
        rest = self.buf[end + 1:]
        self.buf, self.mode = "", "after"
        tail = rest.strip()
        if tail not in ("", "}"):  # more than the object's end: kept as text
            self.content.end()
            out.content += self.content.add(rest.lstrip().removeprefix("}"))
        return False

    def _after(self, out: Delta, final: bool) -> bool:
        tail = self.buf.strip()
        if tail and tail != "}" and final:
            self.content.end()
            out.content += self.content.add(self.buf.lstrip().removeprefix("}").strip())
        if final:
            self.buf = ""
        return False

    def _calls(self, out: Delta, final: bool) -> bool:
        """Between the items of "tool_calls": the next call, the array's end, or something else."""
        text = self.buf.lstrip().lstrip(",").lstrip()
        if text.startswith("{"):
            self.buf, self.mode, self.index, self.sent = text, "call", -1, ""
            return True
        if text.startswith("]"):
            self.buf, self.mode, self.raw = text[1:], "after", ""
            return True
        if not text and not final:
            return False
        if final and self.cut:
            self.buf, self.raw = "", ""
            return False
        self._as_text(out, "")  # not a call after all: the rest is text as written
        self.mode = "text"
        return True

    def _call(self, out: Delta, final: bool) -> bool:
        scan = scan_value(self.buf)
        done = scan.end is not None or not scan.ok  # (not ok: never a JSON value, read as one now)
        text = self.buf[:scan.end] if done else self.buf
        parsed = read_json_call(text, done or final) if scan.ok else None
        if not done and not final:
            if parsed is not None:
                self._send(out, parsed)
            return False
        if not done and self.cut:  # max_tokens ended the reply inside this call: dropped
            if self.index >= 0:
                out.broken.append(self.index)
            self.buf, self.raw, self.mode = "", "", "after"
            return False
        if parsed is None or not parsed.name or not parsed.arguments.startswith(self.sent):
            if self.index >= 0:
                out.broken.append(self.index)
            self._as_text(out, text)  # malformed: its text and the rest are content as written
            self.buf, self.mode = self.buf[len(text):], "text"
            return True
        self._send(out, parsed)
        self.raw, self.buf, self.mode = "", self.buf[len(text):], "calls"
        return True

    def _send(self, out: Delta, parsed) -> None:
        if self.index < 0:
            self.index = self.n_calls
            self.n_calls += 1
            out.calls.append(CallDelta(self.index, new_call_id(), parsed.name, ""))
        if parsed.arguments.startswith(self.sent) and len(parsed.arguments) > len(self.sent):
            out.calls.append(CallDelta(self.index, arguments=parsed.arguments[len(self.sent):]))
            self.sent = parsed.arguments

    def _as_text(self, out: Delta, text: str) -> None:
        """What was taken for calls and is none: content, with the head if no call stood."""
        out.content += self.content.add(self.raw + text)
        self.raw = ""


def _string_end(text: str) -> tuple[Optional[int], int]:
    """In the body of a JSON string: where its closing quote is (None: not yet), and how much of it
    can be decoded now (not ending inside an escape, nor after half a surrogate pair)."""
    i, safe = 0, 0
    while i < len(text):
        c = text[i]
        if c == '"':
            return i, i
        if c != "\\":
            i += 1
            safe = i
            continue
        if i + 1 >= len(text):
            return None, safe
        if text[i + 1] != "u":
            i += 2
            safe = i
            continue
        if i + 6 > len(text):
            return None, safe
        code = int(text[i + 2:i + 6], 16) if re.fullmatch(r"[0-9a-fA-F]{4}", text[i + 2:i + 6]) else 0
        if 0xD800 <= code < 0xDC00 and i + 12 > len(text):
            return None, safe  # a high surrogate: wait for its pair
        i += 12 if 0xD800 <= code < 0xDC00 and text[i + 6:i + 8] == "\\u" else 6
        safe = i
    return None, safe


def _decode(body: str) -> str:
    """A JSON string's body as text (as written, where it is not valid JSON)."""
    try:
        return json.loads(f'"{body}"')
    except json.JSONDecodeError:
        return body
