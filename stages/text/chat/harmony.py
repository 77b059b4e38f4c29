"""gpt-oss: OpenAI's harmony format, a reply of messages on channels.

    <|channel|>analysis<|message|>reasoning<|end|><|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{json}<|call|>
    <|channel|>analysis<|message|>reasoning<|end|><|start|>assistant<|channel|>final<|message|>answer<|return|>

The analysis channel is the reasoning; the final channel, and commentary addressed to nobody (a
preamble), is content; a message addressed `to=functions.NAME` is a call, whatever the header's
order (the template writes `to=` before the channel, the model often after it). <|return|> and
<|call|> end the reply; the channel markers and <|end|> are rendered into its text (llama.cpp's
rule for this vocabulary, stages/text/tokenizer.py). One call per reply: <|call|> ends it.

The template (gpt-oss's own) takes one call per assistant message and answers it with the next
tool message; parallel calls and their results are laid out that way. `reasoning_effort` (low,
medium, high) reaches the template's system message. References: vLLM's openai_tool_parser.py and
gptoss_reasoning_parser.py; llama.cpp's GPT-OSS format; OpenAI's harmony documentation.
"""
from __future__ import annotations

import json
import re
from typing import Optional

from moeray.stages.text.chat.base import ChatFormat, ChatFormatError
from moeray.stages.text.chat.jsonscan import scan_value
from moeray.stages.text.chat.lark import Lark
from moeray.stages.text.chat.message import CallDelta, Delta, Message, new_call_id
from moeray.stages.text.chat.reader import Segments, held_back

START, CHANNEL, MESSAGE, END, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>"
ENDS = (END, "<|call|>", "<|return|>")  # the last two end the reply: they reach the text only if rendered
EFFORTS = ("low", "medium", "high")
_ROLE = re.compile(r"<\|start\|>[A-Za-z]*")
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z]+)")
_RECIPIENT = re.compile(r"to=([^\s<]+)")
MAX_HEADER = 512  # longer without <|message|>: not a header, the text is content


class Harmony(ChatFormat):
    name = "harmony"
    summary = "gpt-oss: analysis channel = reasoning, final = content, commentary to=functions.f = a call"
    think = None
    extra_markers = (START, CHANNEL, MESSAGE, END, CONSTRAIN)
    calls_tools = True  # messages to functions.NAME (its own reader, not the generic one's call markers)
    reads_effort = True  # the template's "Reasoning: low/medium/high"

    def reasoning_markers(self):
        """The analysis channel: a message opened on it, closed by <|end|>."""
        return CHANNEL + "analysis" + MESSAGE, END

    def template_variables(self, variables):
        effort = variables.get("reasoning_effort")
        if effort is not None and effort not in EFFORTS:
            raise ChatFormatError(f"reasoning_effort {effort!r}: gpt-oss is trained on {', '.join(EFFORTS)}",
                                  "reasoning_effort")
        return variables

    def template_messages(self, messages, tools):
        messages, tools = super().template_messages(messages, tools)
        out, i = [], 0
        while i < len(messages):
            m = messages[i]
            i += 1
            if m["role"] != "assistant" or not m.get("tool_calls"):
                out.append(m)
                continue
            if m.get("content") and m.get("reasoning_content"):  # the template takes one or the other
                m = {**m, "reasoning_content": f"{m['reasoning_content']}\n\n{m['content']}", "content": ""}
            results = []
            while i < len(messages) and messages[i]["role"] == "tool":
                results.append(messages[i])
                i += 1
            by_id = {r.get("tool_call_id"): r for r in results if r.get("tool_call_id")}
            left = [r for r in results if r.get("tool_call_id") not in {c.get("id") for c in m["tool_calls"]}]
            for n, call in enumerate(m["tool_calls"]):
                out.append({**m, "tool_calls": [call]} if n == 0 else
                           {"role": "assistant", "content": "", "tool_calls": [call]})
                answer = by_id.get(call.get("id")) or (left.pop(0) if left else None)
                if answer is not None:
                    out.append(answer)
            out.extend(left)
        return out, tools

    def thinking(self, prompt: str) -> str:
        return "optional"

    def reader(self, turn):
        return HarmonyReader(turn.tools)

    def forced_grammar(self, turn, tokenizer, name: Optional[str] = None, parallel: bool = True) -> str:
        g = Lark(tokenizer)
        analysis = g.rule(f"{g.lit(CHANNEL, 'analysis', MESSAGE)} {g.text_until(END)} {g.lit(START, 'assistant')}")
        functions = [t["function"] for t in turn.tools or () if name is None or t["function"]["name"] == name]
        calls = " | ".join(f"{g.lit(CHANNEL, 'commentary to=functions.' + f['name'] + ' ', CONSTRAIN, 'json', MESSAGE)} "
                           f"{g.json(f.get('parameters'))}" for f in functions)
        return g.grammar(f"{analysis}? ({calls})")


class HarmonyReader:
    def __init__(self, tools: Optional[list[dict]]):
        self.tools = tools
        self.buf, self.mode = "", "header"
        self.kind = ""  # of the message being read: reasoning, content, call, raw
        self.header = ""
        self.content, self.reasoning = Segments(), Segments()
        self.message = Message()
        self.n_calls, self.index, self.sent = 0, -1, ""
        self.cut = False

    def feed(self, text: str) -> Delta:
        self.buf += text
        return self._run(False)

    def close(self, cut: bool = False) -> Delta:
        """`cut`: max_tokens ended the reply (reader.py Reader.close): a call whose arguments are not
        whole is dropped, and a header or an end marker cut in the middle is no text."""
        self.cut = cut
        return self._run(True)

    def _run(self, final: bool) -> Delta:
        out = Delta()
        while getattr(self, "_" + self.mode)(out, final):
            pass
        self.message.add(out)
        return out

    def _header(self, out: Delta, final: bool) -> bool:
        at = self.buf.find(MESSAGE)
        if at < 0:
            if len(self.buf) <= MAX_HEADER and _could_be_header(self.buf):
                if final and self.cut:
                    self.buf = ""  # a header max_tokens cut: no text
                if not final or not self.buf:
                    return False
            self.mode = "text"  # not harmony: the rest is content as written
            return True
        self.header, self.buf, self.mode = self.buf[:at], self.buf[at + len(MESSAGE):], "body"
        channel = _CHANNEL.search(self.header)
        to = _RECIPIENT.search(self.header)
        if to is None:
            self.kind = "reasoning" if channel and channel.group(1) == "analysis" else "content"
        elif to.group(1).startswith("functions.") and self.tools is not None:
            self.kind = "call"
            self.index, self.sent = self.n_calls, ""
            self.n_calls += 1
            out.calls.append(CallDelta(self.index, new_call_id(), to.group(1)[len("functions."):], ""))
        else:  # a built-in tool, or calls not read: the message as written
            self.kind = "raw"
            self.buf = self.header + MESSAGE + self.buf
        return True

    def _text(self, out: Delta, final: bool) -> bool:
        out.content += self.content.add(self.buf)
        self.buf = ""
        return False

    def _body(self, out: Delta, final: bool) -> bool:
        hits = [(at, m) for m in ENDS if (at := self.buf.find(m)) >= 0]
        at, marker = min(hits) if hits else (-1, "")
        done = at >= 0 or final
        body = self.buf[:at] if at >= 0 else self.buf
        cut = final and self.cut and at < 0
        if not done or cut:
            body = body[:len(body) - held_back(body, ENDS)]
        if self.kind == "call":
            scan = scan_value(body)
            if scan.ok and body[scan.start:scan.start + 1] == "{":
                args = body[scan.start:scan.end or len(body)]
                if args.startswith(self.sent) and len(args) > len(self.sent):
                    out.calls.append(CallDelta(self.index, arguments=args[len(self.sent):]))
                    self.sent = args
            if not done:
                return False
            if not self._valid(body):
                out.broken.append(self.index)
                if not cut:  # malformed: its text is content; cut by max_tokens: dropped
                    out.content += self.content.add(self.header + MESSAGE + body)
                    self.content.end()
        else:
            segments = self.reasoning if self.kind == "reasoning" else self.content
            text = segments.add(body)
            if self.kind == "reasoning":
                out.reasoning += text
            else:
                out.content += text
            if not done:
                self.buf = self.buf[len(body):]
                return False
            segments.end()
        self.buf = self.buf[at + len(marker):] if at >= 0 else ""
        self.mode, self.kind = "header", ""
        return True

    def _valid(self, body: str) -> bool:
        """A call's body is one JSON object, all of it sent as its arguments."""
        try:
            return isinstance(json.loads(body), dict) and body.strip() == self.sent
        except json.JSONDecodeError:
            return False


def _could_be_header(text: str) -> bool:
    """Whether `text` may still grow into a message header (<|start|>role, to=..., <|channel|>...)."""
    rest = _ROLE.sub("", text, count=1).lstrip()
    if not rest:
        return True
    if START.startswith(text.lstrip()):
        return True
    return any(rest.startswith(p) or p.startswith(rest) for p in (CHANNEL, "to=", CONSTRAIN))
