"""Hermes: Qwen2.5, Qwen3 (and QwQ, Hermes 2/3): JSON calls in <tool_call> blocks, reasoning in <think>.

    <think>\nreasoning\n</think>\n\ncontent\n<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>

Arguments stream as the model writes them: the raw text of the "arguments" value (a JSON object),
sent while it is open (jsonscan finds where it closes). A block whose keys come in another order,
or whose arguments are a JSON string, is read whole when it closes. References: vLLM's
hermes_tool_parser.py and qwen3_reasoning_parser.py; llama.cpp's Hermes 2 Pro format.
"""
from __future__ import annotations

import json
import re
from typing import Optional

from moeray.stages.text.chat.base import ChatFormat
from moeray.stages.text.chat.jsonscan import scan_value
from moeray.stages.text.chat.lark import Lark
from moeray.stages.text.chat.reader import CallParse

_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*')


class Hermes(ChatFormat):
    name = "hermes"
    summary = "Qwen2.5, Qwen3, QwQ: <tool_call>{json}</tool_call>, reasoning in <think>"
    call = ("<tool_call>", "</tool_call>")
    call_separator = "\n"
    think_close = "\n</think>\n\n"
    thinking_off = {"enable_thinking": False}

    def parse_call(self, text: str, done: bool, tools) -> Optional[CallParse]:
        return read_json_call(text, done)

    def call_rule(self, g: Lark, function: dict) -> str:
        schema = {"type": "object", "properties": {
            "name": {"const": function["name"]},
            "arguments": function.get("parameters") or {"type": "object"}},
            "required": ["name", "arguments"], "additionalProperties": False}
        return f"{g.lit(self.call[0] + chr(10))} {g.json(schema)} {g.lit(chr(10) + self.call[1])}"


def read_json_call(text: str, done: bool) -> Optional[CallParse]:
    """A call written as one JSON object {"name": ..., "arguments": {...}} (Hermes' block, an item of
    the generic format's "tool_calls"): while it arrives, the raw text of its arguments so far;
    whole, its arguments as written (or re-serialised when they came first, or as a JSON string)."""
    head = _HEAD.match(text)
    streamed = None
    if head:
        scan = scan_value(text, head.end())
        if scan.ok and text[scan.start:scan.start + 1] == "{":
            streamed = CallParse(json.loads(head.group(1)), text[scan.start:scan.end or len(text)])
    if not done:
        return streamed
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if streamed is not None and streamed.name == obj["name"]:
        return streamed  # the arguments as written (what was streamed of them)
    if isinstance(args, str):
        return CallParse(obj["name"], args)
    if not isinstance(args, dict):
        return None
    return CallParse(obj["name"], json.dumps(args, ensure_ascii=False))
