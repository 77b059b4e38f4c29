"""DeepSeek-V3, V3.1, R1: calls between DeepSeek's own special tokens, reasoning in <think>.

    V3.1:  reasoning</think>content<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{json}<｜tool▁call▁end｜><｜tool▁calls▁end｜>
    V3/R1: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{json}\n```<｜tool▁call▁end｜>...

Both call spellings are read; a forced call is written in the one the template teaches ("```json"
in it: V3/R1). The markers are control tokens, rendered into the reply's text for reading. The
thinking templates end the prompt with an open <think> (R1 always, V3.1 with
chat_template_kwargs {"thinking": true}). V3.1's published template does not print `tools`:
DeepSeek's model card has the tool descriptions appended to the system prompt, in the form below,
which this format does. References: vLLM's deepseekv3/deepseekv31 tool parsers and
deepseek_r1_reasoning_parser.py; llama.cpp's DeepSeek R1 and V3.1 formats; the V3.1 model card.
"""
from __future__ import annotations

import json
import re
from typing import Optional

from moeray.stages.text.chat.base import ChatFormat
from moeray.stages.text.chat.jsonscan import scan_value
from moeray.stages.text.chat.lark import Lark
from moeray.stages.text.chat.reader import CallParse

SEP = "<｜tool▁sep｜>"
FENCE = "\n```json\n"

# DeepSeek-V3.1's model card, "ToolCall": appended to the system prompt.
TOOLS_HEADER = "## Tools\nYou have access to the following tools:\n"
TOOLS_FOOTER = (
    "\nIMPORTANT: ALWAYS adhere to this exact format for tool use:\n"
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>tool_call_name<｜tool▁sep｜>tool_call_arguments<｜tool▁call▁end｜>"
    "{{additional_tool_calls}}<｜tool▁calls▁end｜>\n\n"
    "Where:\n\n"
    "- `tool_call_name` must be an exact match to one of the available tools\n"
    "- `tool_call_arguments` must be valid JSON that strictly follows the tool's Parameters Schema\n"
    "- For multiple tool calls, chain them directly without separators or spaces\n")


def tool_description(tools: list[dict]) -> str:
    lines = [TOOLS_HEADER]
    for t in tools:
        f = t["function"]
        lines.append(f"\n### {f['name']}\nDescription: {f.get('description') or ''}\n\n"
                     f"Parameters: {json.dumps(f.get('parameters') or {}, ensure_ascii=False)}\n")
    return "".join(lines) + TOOLS_FOOTER


class DeepSeek(ChatFormat):
    name = "deepseek"
    summary = "DeepSeek-V3/V3.1/R1: <｜tool▁call▁begin｜>f<｜tool▁sep｜>{json} (V3/R1: ```json fenced), reasoning in <think>"
    section = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
    call = ("<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>")
    extra_markers = (SEP,)
    opens_think = False  # the template opens <think> (or closes it); the model does not
    thinking_off = {"thinking": False}  # V3.1's switch (R1's template always opens <think>)

    @property
    def fenced(self) -> bool:
        """V3/R1 templates teach the fenced spelling; V3.1's the bare one."""
        return "```json" in self.template

    @property
    def call_separator(self) -> str:  # type: ignore[override]
        return "\n" if self.fenced else ""

    def template_prints_tools(self) -> bool:
        return re.search(r"\btools\b", self.template) is not None

    def tools_problem(self, tokenizer) -> Optional[str]:
        return None  # a template that does not print them gets them in the system prompt

    def template_messages(self, messages, tools):
        messages, tools = super().template_messages(messages, tools)
        if not tools or self.template_prints_tools():
            return messages, tools
        text = tool_description(tools)
        if messages and messages[0]["role"] == "system":
            system = messages[0].get("content") or ""
            messages[0] = {**messages[0], "content": f"{system}\n\n{text}" if system else text}
        else:
            messages.insert(0, {"role": "system", "content": text})
        return messages, None

    def parse_call(self, text: str, done: bool, tools) -> Optional[CallParse]:
        at = text.find(SEP)
        if at < 0:
            return None
        head, body = text[:at].strip(), text[at + len(SEP):]
        if body.lstrip().startswith("{") or (not body.strip() and head != "function"):
            name, pos = head, 0  # V3.1: NAME<sep>{json}
        else:  # V3/R1: function<sep>NAME\n```json\n{json}\n```
            line = body.find("\n")
            if line < 0:
                return None
            name = body[:line].strip()
            fence = body.find("```json", line)
            if fence < 0 or body[line:fence].strip():
                return None if done else CallParse(name)
            pos = fence + len("```json")
        if not name:
            return None
        scan = scan_value(body, pos)
        if not scan.ok or body[scan.start:scan.start + 1] not in ("{", ""):
            return None
        args = body[scan.start:scan.end or len(body)]
        if not done:
            return CallParse(name, args)
        if scan.end is None or body[scan.end:].strip() not in ("", "```"):
            return None
        try:
            if not isinstance(json.loads(args), dict):
                return None
        except json.JSONDecodeError:
            return None
        return CallParse(name, args)

    def call_rule(self, g: Lark, function: dict) -> str:
        args = g.json(function.get("parameters"))
        if self.fenced:
            return (f"{g.lit(self.call[0], 'function', SEP, function['name'] + FENCE)} {args} "
                    f"{g.lit(chr(10) + '```', self.call[1])}")
        return f"{g.lit(self.call[0], function['name'], SEP)} {args} {g.lit(self.call[1])}"
