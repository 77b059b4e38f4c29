"""XML calls: Qwen3-Coder, Qwen3.5 and Qwen3.6 write each argument as its own element.

    <think>\nreasoning\n</think>\n\ncontent\n\n<tool_call>\n<function=NAME>\n<parameter=P>\nvalue\n</parameter>\n</function>\n</tool_call>

A value is raw text: a string argument (by the function's schema) stays text, any other is read
as JSON (a number, an object), falling back to text. Arguments stream one parameter at a time,
as the JSON object they make (`{"P": v`, then `, "Q": w`, then `}`). Qwen3.5's template opens the
reply inside <think>. References: vLLM's qwen3coder_tool_parser.py; llama.cpp's Qwen3-Coder format.
"""
from __future__ import annotations

import json
import re
from typing import Optional

from moeray.stages.text.chat.base import ChatFormat
from moeray.stages.text.chat.lark import Lark, argument_value, find_function, value_rule
from moeray.stages.text.chat.reader import CallParse

_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)
_FUNCTION_END = "</function>"
_PARAMETER_END = "</parameter>"
# What a raw string argument may not hold: the markup around it (the reader would end it there).
MARKUP = ("<parameter=", "<function=", _FUNCTION_END, "<tool_call>", "</tool_call>")


def object_text(items: list[tuple[str, object]], closed: bool) -> str:
    """The arguments object as json.dumps writes it, open (for a stream) or closed."""
    body = ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {json.dumps(v, ensure_ascii=False)}" for k, v in items)
    if closed:
        return "{" + body + "}"
    return "{" + body if items else ""


class Qwen3Xml(ChatFormat):
    name = "qwen3_xml"
    summary = "Qwen3-Coder, Qwen3.5/3.6: <tool_call><function=f><parameter=p>…, reasoning in <think>"
    call = ("<tool_call>", "</tool_call>")
    call_separator = "\n"
    opens_think = False  # the template opens <think> (or closes it); the model does not
    think_close = "\n</think>\n\n"
    thinking_off = {"enable_thinking": False}

    def parse_call(self, text: str, done: bool, tools) -> Optional[CallParse]:
        head = _FUNCTION.match(text)
        if not head:
            return None
        name = head.group(1).strip()
        function = find_function(tools, name)
        items, pos = [], head.end()
        while (m := _PARAMETER.match(text, pos)) is not None:
            value = m.group(2)
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            items.append((m.group(1).strip(), argument_value(function, m.group(1).strip(), value)))
            pos = m.end()
        if not done:
            return CallParse(name, object_text(items, closed=False))
        rest = text[pos:].strip()
        if rest not in ("", _FUNCTION_END):  # an unclosed parameter, or text that is not one
            return None
        return CallParse(name, object_text(items, closed=True))

    def call_rule(self, g: Lark, function: dict) -> str:
        params = function.get("parameters") or {}
        props = params.get("properties") or {}
        required = set(params.get("required") or ())
        parts = []
        for key, spec in props.items():
            one = f"{g.lit(f'<parameter={key}>' + chr(10))} {value_rule(g, spec, _PARAMETER_END, chr(10), chr(10), MARKUP)}"
            parts.append(one if key in required else f"({one})?")
        if not props:  # any arguments
            any_name = g.rule(r"/[A-Za-z0-9_.-]+/")
            parts.append(f'({g.lit("<parameter=")} {any_name} {g.lit(">" + chr(10))} '
                         f'{g.text_until(chr(10) + _PARAMETER_END, MARKUP)} {g.lit(chr(10))})*')
        head = g.lit(f"{self.call[0]}\n<function={function['name']}>\n")
        return f"{head} {' '.join(parts)} {g.lit(_FUNCTION_END + chr(10) + self.call[1])}"
