"""Kimi-K2 (Instruct and Thinking): calls in a tool-calls section, each with the model's own id.

    <think>reasoning</think>content<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{json}<|tool_call_end|><|tool_calls_section_end|>

The id (`functions.NAME:N`, N counting the conversation's calls) is the call's id, as vLLM gives it.
The published templates keep the ids of earlier calls in a list they change with .append() and
.pop(0), which transformers' sandbox refuses (templates may not change data); the same is written
here with new lists (`template_source`), and renders the same text.
The markers are control tokens, rendered into the reply's text for reading. References: vLLM's
kimi_k2_tool_parser.py; llama.cpp's Kimi K2 format.
"""
from __future__ import annotations

import json
import re
from typing import Optional

from moeray.stages.text.chat.base import ChatFormat
from moeray.stages.text.chat.jsonscan import scan_value
from moeray.stages.text.chat.lark import Lark
from moeray.stages.text.chat.reader import CallParse

ARGS = "<|tool_call_argument_begin|>"
_ID = re.compile(r"(?:functions\.)?([^:\s]+)(?::\d+)?")


# The published templates' changes to a list, written without changing it (a namespace attribute
# may be set; a list may not be changed in transformers' immutable sandbox).
_APPEND = re.compile(r"\{%(-?)\s*set\s+_\s*=\s*([\w.]+)\.append\(([^()]*)\)\s*(-?)%\}")
_POP = re.compile(r"\{%(-?)\s*set\s+(\w+)\s*=\s*([\w.]+)\.pop\(0\)\s*(-?)%\}")


def immutable_template(template: str) -> str:
    """`set _ = L.append(x)` as `set L = L + [x]`; `set v = L.pop(0)` as `set v = L[0]`, `set L = L[1:]`
    (the whitespace control of each tag kept)."""
    template = _APPEND.sub(lambda m: f"{{%{m[1]} set {m[2]} = {m[2]} + [{m[3]}] {m[4]}%}}", template)
    return _POP.sub(lambda m: f"{{%{m[1]} set {m[2]} = {m[3]}[0] -%}}{{%- set {m[3]} = {m[3]}[1:] {m[4]}%}}", template)


class KimiK2(ChatFormat):
    name = "kimi_k2"
    summary = "Kimi-K2: <|tool_call_begin|>functions.f:N<|tool_call_argument_begin|>{json}, reasoning in <think>"
    section = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")
    call = ("<|tool_call_begin|>", "<|tool_call_end|>")
    extra_markers = (ARGS,)

    def template_source(self):
        return immutable_template(self.template) if self.template else None

    def parse_call(self, text: str, done: bool, tools) -> Optional[CallParse]:
        at = text.find(ARGS)
        if at < 0:
            return None
        call_id = text[:at].strip()
        m = _ID.fullmatch(call_id)
        if not m:
            return None
        scan = scan_value(text, at + len(ARGS))
        if not scan.ok or text[scan.start:scan.start + 1] not in ("{", ""):
            return None
        args = text[scan.start:scan.end or len(text)]
        if not done:
            return CallParse(m.group(1), args, call_id)
        if scan.end is None or text[scan.end:].strip():
            return None
        try:
            if not isinstance(json.loads(args), dict):
                return None
        except json.JSONDecodeError:
            return None
        return CallParse(m.group(1), args, call_id)

    def call_rule(self, g: Lark, function: dict) -> str:
        index = g.rule(r"/[0-9]{1,3}/")
        return (f"{g.lit(self.call[0], 'functions.' + function['name'] + ':')} {index} {g.lit(ARGS)} "
                f"{g.json(function.get('parameters'))} {g.lit(self.call[1])}")
