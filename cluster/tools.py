"""OpenAI tools on a model whose chat template renders them.

Whether a template supports tools is found by rendering, not by reading it: the same conversation
is rendered with and without a probe tool, and a template that prints nothing different ignores
`tools` (SmolLM2's does). Such a model gets a 400 rather than a request whose tools are silently
dropped.

Tool calls are written in the Hermes format that Qwen2/2.5/3, Hermes and many other templates
teach their models: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one block per
call. `parse_tool_calls` takes them out of the generated text; `tool_choice: "required"` or a named
function constrains generation with a grammar (stages/text/grammar.py) so that the output is such a
block whose arguments match the function's JSON schema, and the parse cannot fail.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Optional

from moeray.stages.text.grammar import JSON_STYLE, lark_grammar

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL_RE = re.compile(re.escape(CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(CALL_CLOSE), re.DOTALL)

_PROBE_TOOL = {"type": "function", "function": {
    "name": "moeray_probe_tool_7f3a", "description": "probe",
    "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}


class ToolsUnsupported(Exception):
    """The model's chat template cannot take these tools (HTTP 400 at the server)."""


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            self.id = f"call_{uuid.uuid4().hex[:24]}"

    def as_openai(self, index: Optional[int] = None) -> dict[str, Any]:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def template_renders_tools(tokenizer) -> bool:
    """True when the chat template prints a tool it is given (its text changes with `tools`)."""
    if not tokenizer.chat_template:
        return False
    messages = [{"role": "user", "content": "hi"}]
    try:
        with_tool = tokenizer.apply_chat_template(messages, tools=[_PROBE_TOOL])
        without = tokenizer.apply_chat_template(messages)
    except Exception:  # noqa: BLE001 - a template that fails on tools does not support them
        return False
    return with_tool != without and _PROBE_TOOL["function"]["name"] in with_tool


def check_tools_supported(tokenizer) -> None:
    if not template_renders_tools(tokenizer):
        raise ToolsUnsupported("this model's chat template has no tool support (it does not render `tools`); "
                               "send the request without `tools`, or serve a model whose template renders them")
    if CALL_OPEN not in (tokenizer.chat_template or ""):
        raise ToolsUnsupported("this model's chat template renders `tools` but not in the <tool_call> (Hermes) "
                               "format moeray parses; send the request without `tools`")


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """(content, calls) from generated text: every well-formed <tool_call>{json}</tool_call> block
    becomes a call; the text outside the blocks stays content. A block whose JSON does not parse,
    or has no "name", stays in the content as text: nothing the model wrote is dropped."""
    calls: list[ToolCall] = []
    kept: list[str] = []
    pos = 0
    for m in _CALL_RE.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        calls.append(ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)))
        kept.append(text[pos:m.start()])
        pos = m.end()
    kept.append(text[pos:])
    content = "".join(kept) if calls else text
    return (content.strip() if calls else content), calls


class ToolCallStream:
    """Streamed content of a request with tools: text is released until a <tool_call> block may
    be starting; from there on it is held, and the end of the generation decides (finish()) whether
    it was a tool call or plain text."""

    def __init__(self):
        self.text = ""
        self.released = 0
        self.holding = False

    def push(self, delta: str) -> str:
        self.text += delta
        if self.holding:
            return ""
        at = self.text.find(CALL_OPEN, self.released)
        if at >= 0:
            self.holding = True
            return self._release(at)
        # Hold a tail that could be the start of "<tool_call>".
        end = len(self.text)
        for n in range(min(len(CALL_OPEN) - 1, end - self.released), 0, -1):
            if self.text.endswith(CALL_OPEN[:n]):
                end -= n
                break
        return self._release(end)

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content not yet released, the calls) once the generation ended."""
        return parse_tool_calls(self.text[self.released:])

    def _release(self, end: int) -> str:
        out = self.text[self.released:end]
        self.released = max(self.released, end)
        return out


def _call_schema(function: dict) -> dict:
    return {"type": "object", "properties": {
        "name": {"const": function["name"]},
        "arguments": function.get("parameters") or {"type": "object"}},
        "required": ["name", "arguments"], "additionalProperties": False}


def forced_call_grammar(tools: list[dict], name: Optional[str] = None, parallel: bool = True) -> str:
    """A grammar whose every string is one (or, with `parallel`, one or more) Hermes tool-call
    block(s) calling `name` (None: any of `tools`) with arguments that match its JSON schema."""
    functions = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    schemas = [_call_schema(f) for f in functions]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    schema = {**schema, "x-guidance": JSON_STYLE}
    call = f'"{CALL_OPEN}\\n" %json {json.dumps(schema)} "\\n{CALL_CLOSE}"'
    rules = f"start: call (\"\\n\" call)*\ncall: {call}\n" if parallel else f"start: {call}\n"
    return lark_grammar(rules)


def template_messages(messages: list[dict]) -> list[dict]:
    """OpenAI messages as chat templates expect them: an assistant's tool_calls with `arguments`
    as an object (templates print it with tojson), a tool result with its id and name."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                fn = dict(c.get("function") or {})
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except json.JSONDecodeError:
                        pass
                calls.append({**c, "function": fn, **fn})  # both shapes: c.function.name and c.name
            m["tool_calls"] = calls
        out.append(m)
    return out
