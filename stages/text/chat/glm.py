"""GLM-4.5, 4.6 (and 4.7): the function name, then key/value pairs, in a <tool_call> block.

    <think>reasoning</think>\ncontent\n<tool_call>NAME\n<arg_key>k</arg_key>\n<arg_value>v</arg_value>\n</tool_call>

A value is raw text for a string argument (by the function's schema), JSON otherwise (the
template writes non-strings with tojson), falling back to text. Arguments stream one pair at a
time. The reply ends with <|observation|> after calls, <|user|> after an answer (the file's eom
and eot tokens). References: vLLM's glm4_moe_tool_parser.py; llama.cpp's GLM 4.5 format.
"""
from __future__ import annotations

import re
from typing import Optional

from moeray.stages.text.chat.base import ChatFormat
from moeray.stages.text.chat.lark import Lark, argument_value, find_function, value_rule
from moeray.stages.text.chat.qwen3_xml import object_text
from moeray.stages.text.chat.reader import CallParse

# What a raw string argument may not hold: the markup around it (the reader would end it there).
MARKUP = ("<arg_key>", "</arg_key>", "<arg_value>", "<tool_call>", "</tool_call>")
_PAIR = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


class Glm(ChatFormat):
    name = "glm"
    summary = "GLM-4.5/4.6/4.7: <tool_call>f<arg_key>k</arg_key><arg_value>v</arg_value>, reasoning in <think>"
    call = ("<tool_call>", "</tool_call>")
    call_separator = "\n"
    think_close = "</think>\n"
    thinking_off = {"enable_thinking": False}

    def parse_call(self, text: str, done: bool, tools) -> Optional[CallParse]:
        cut = [i for i in (text.find("\n"), text.find("<arg_key>")) if i >= 0]
        if not cut and not done:
            return None
        end = min(cut) if cut else len(text)
        name = text[:end].strip()
        if not name or "<" in name:
            return None
        function = find_function(tools, name)
        items, pos = [], end
        while (m := _PAIR.match(text, pos)) is not None:
            key = m.group(1).strip()
            items.append((key, argument_value(function, key, m.group(2).strip())))
            pos = m.end()
        if not done:
            return CallParse(name, object_text(items, closed=False))
        if text[pos:].strip():
            return None
        return CallParse(name, object_text(items, closed=True))

    def call_rule(self, g: Lark, function: dict) -> str:
        params = function.get("parameters") or {}
        props = params.get("properties") or {}
        required = set(params.get("required") or ())
        parts = []
        for key, spec in props.items():
            one = f"{g.lit(f'<arg_key>{key}</arg_key>' + chr(10) + '<arg_value>')} {value_rule(g, spec, '</arg_value>', '', chr(10), MARKUP)}"
            parts.append(one if key in required else f"({one})?")
        if not props:
            any_key = g.rule(r"/[A-Za-z0-9_.-]+/")
            parts.append(f'({g.lit("<arg_key>")} {any_key} {g.lit("</arg_key>" + chr(10) + "<arg_value>")} '
                         f'{g.text_until("</arg_value>", MARKUP)} {g.lit(chr(10))})*')
        head = g.lit(f"{self.call[0]}{function['name']}\n")
        return f"{head} {' '.join(parts)} {g.lit(self.call[1])}"
