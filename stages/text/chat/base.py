"""A chat format: how one family's template is called and how its replies are read.

Each family writes reasoning and tool calls its own way; one module per family (hermes.py,
qwen3_xml.py, deepseek.py, glm.py, kimi_k2.py, harmony.py, generic.py, plain.py) subclasses ChatFormat with
    - the template call: OpenAI messages turned into what the family's template reads
      (`template_messages`: arguments as objects, earlier reasoning, tool results),
    - the reply's markers (`think`, `section`, `call`) and one call's reading (`parse_call`),
    - the grammar that forces a call (`call_rule`), written in the family's own format.
The rest asks it. `Turn` is one request: the prompt rendered, and whether the reply starts inside
the reasoning (the prompt ended with an open `<think>`), which the reader and the grammar need.
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

from moeray.stages.text.chat.lark import Lark
from moeray.stages.text.chat.message import Message
from moeray.stages.text.chat.reader import CallParse, PlainReader, Reader
from moeray.stages.text.reasoning_budget import ReasoningBudget

# Template variables a request may not set through chat_template_kwargs: they are the request itself.
RESERVED_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "documents", "bos_token",
                                "eos_token", "continue_final_message"})


class ChatFormatError(ValueError):
    """A conversation or an option this format cannot take (HTTP 400 at the server, naming `param`)."""

    def __init__(self, message: str, param: str = "chat_template_kwargs"):
        super().__init__(message)
        self.param = param


class ChatFormat:
    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""  # what the family writes, one line (docs, `--chat-format` help)
    think: ClassVar[Optional[tuple[str, str]]] = ("<think>", "</think>")
    section: ClassVar[Optional[tuple[str, str]]] = None  # around all the calls of a reply
    call: ClassVar[Optional[tuple[str, str]]] = None  # around one call
    call_separator: ClassVar[str] = ""  # between two forced calls
    opens_think: ClassVar[bool] = True  # the model may open its reasoning itself (else only the prompt does)
    think_close: ClassVar[Optional[str]] = None  # what a spent reasoning budget writes (None: think[1])
    # Template variables that turn the family's thinking off (a reasoning budget of 0 sets them,
    # where the request leaves them unset).
    thinking_off: ClassVar[dict] = {}
    reads_effort: ClassVar[bool] = False  # the template reads reasoning_effort itself (else it sets a budget)
    extra_markers: ClassVar[tuple[str, ...]] = ()

    def __init__(self, template: Optional[str] = None):
        self.template = template or ""

    # ------------------------------------------------------------------ detokenising
    def markers(self) -> tuple[str, ...]:
        """Texts the reply must show even when they are control tokens (DeepSeek's and Kimi's call
        markers are): the detokenizer renders them (Tokenizer.with_rendered)."""
        out = list(self.extra_markers)
        for pair in (self.think, self.section, self.call):
            out.extend(pair or ())
        return tuple(out)

    # ------------------------------------------------------------------ the template call
    @property
    def calls_tools(self) -> bool:
        return self.call is not None

    def tools_problem(self, tokenizer) -> Optional[str]:
        """Why this model cannot take `tools` (None: it can)."""
        if not self.calls_tools:
            return (f"this model is served with the `{self.name}` chat format, which reads no tool calls (chosen by "
                    "--chat-format, or the GGUF has no chat template); send the request without `tools`, or serve "
                    "the model with --chat-format generic (tools as JSON, any template) or the format its family "
                    "writes (docs/chat-formats.md)")
        if not template_renders_tools(tokenizer):
            return (f"this model's chat template does not render `tools`, which the `{self.name}` chat format "
                    "needs; send the request without `tools`, or serve the model with --chat-format generic "
                    "(tools described in the system message, docs/chat-formats.md)")
        return None

    def template_messages(self, messages: list[dict], tools: Optional[list[dict]]) -> tuple[list[dict], Optional[list[dict]]]:
        """OpenAI messages and tools as this family's template reads them."""
        return [_template_message(m) for m in messages], tools

    def template_source(self) -> Optional[str]:
        """The template as rendered (None: the file's own)."""
        return None

    def template_variables(self, variables: dict[str, Any]) -> dict[str, Any]:
        """Check and complete the template variables (chat_template_kwargs, reasoning_effort)."""
        return variables

    def render(self, tokenizer, messages: list[dict], tools: Optional[list[dict]] = None,
               variables: Optional[dict[str, Any]] = None, read_calls: Optional[bool] = None,
               budget: Optional[int] = None) -> "Turn":
        """The prompt of one request. `tools` go to the template; the reply is read for calls when
        `read_calls` (default: when there are tools). `budget` 0 (no thinking): the family's
        thinking switch is turned off (`thinking_off`) unless the variables set it."""
        variables = dict(variables or {})
        bad = sorted(RESERVED_VARIABLES & set(variables))
        if bad:
            raise ChatFormatError(f"chat_template_kwargs may not set {', '.join(bad)}: they come from the request itself")
        if budget == 0:
            variables = {**self.thinking_off, **variables}
        msgs, tools_for_template = self.template_messages(copy.deepcopy(messages), copy.deepcopy(tools))
        prompt = self.apply_template(tokenizer, msgs, tools_for_template, self.template_variables(variables))
        read_calls = bool(tools) if read_calls is None else read_calls
        return Turn(self, prompt, tools if read_calls else None, self.thinking(prompt))

    def apply_template(self, tokenizer, messages: list[dict], tools: Optional[list[dict]], variables: dict) -> str:
        """The template called on the messages and tools as this family's template reads them."""
        return tokenizer.apply_chat_template(messages, tools=tools, template=self.template_source(), **variables)

    def thinking(self, prompt: str) -> str:
        """"open": the prompt ends inside the reasoning (the reply starts there); "optional": the
        model may open reasoning itself; "off": it will not (a closed <think></think>, or no think)."""
        if not self.think:
            return "off"
        tail = prompt.rstrip()
        if tail.endswith(self.think[0]):
            return "open"
        if tail.endswith(self.think[1]) or self.think[0] not in self.template or not self.opens_think:
            return "off"
        return "optional"

    def reasoning_markers(self) -> Optional[tuple[str, str]]:
        """What opens and closes the reply's reasoning (None: it has none)."""
        return self.think

    def reasoning_budget(self, turn: "Turn", tokenizer, tokens: int) -> Optional[ReasoningBudget]:
        """At most `tokens` of reasoning in this turn's reply, then its closing marker (None where the
        reply does not reason: the family has no reasoning, or the prompt turned it off)."""
        markers = self.reasoning_markers()
        if markers is None or turn.thinking == "off":
            return None
        forced = tuple(tokenizer.encode(self.think_close or markers[1], add_bos=False))
        return ReasoningBudget(tokens, markers[0], markers[1], forced, inside=turn.thinking == "open")

    # ------------------------------------------------------------------ reading the reply
    def reader(self, turn: "Turn"):
        return Reader(self, turn.tools, turn.thinking == "open")

    def parse_call(self, text: str, done: bool, tools: Optional[list[dict]]) -> Optional[CallParse]:
        """One call's text between the call markers (all of it when `done`, else what arrived)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ forcing a call
    def call_rule(self, g: Lark, function: dict) -> str:
        """The grammar of one call of `function` (a rule body)."""
        raise NotImplementedError

    def forced_grammar(self, turn: "Turn", tokenizer, name: Optional[str] = None, parallel: bool = True) -> str:
        """A grammar whose every string is a reply of one call (several with `parallel`) of `name` (None:
        any of the tools), in this family's own format, after the reasoning where the model reasons."""
        g = Lark(tokenizer)
        functions = [t["function"] for t in turn.tools or () if name is None or t["function"]["name"] == name]
        call = g.rule(" | ".join(self.call_rule(g, f) for f in functions))
        calls = f"{call} ({g.lit(self.call_separator)} {call})*" if parallel else call
        if self.section:
            calls = f"{g.lit(self.section[0])} {calls} {g.lit(self.section[1])}"
        lead = g.rule(r"/[ \n]{0,2}/")  # GLM opens its reply with a newline
        return g.grammar(f"{lead} {self.reasoning_rule(g, turn)} {calls}")

    def auto_grammar(self, turn: "Turn", tokenizer, parallel: bool = True) -> Optional[str]:
        """The grammar of every reply with tools under tool_choice auto (None: the reply is free; the
        generic format's is a JSON object, generic.py)."""
        return None

    def reasoning_rule(self, g: Lark, turn: "Turn") -> str:
        """What may come before a forced call: the rest of an open reasoning, an optional one, or nothing."""
        if turn.thinking == "off":
            return ""
        opener, closer = self.think
        rest = g.text_until(closer)
        spaces = g.rule(r"/[ \n]{0,2}/")
        rest = f"{rest} {spaces}"
        if turn.thinking == "open":
            return rest
        return f"({g.rule(f'{g.lit(opener)} {rest}')})?"


@dataclass
class Turn:
    """One request's prompt and how its reply is read."""
    format: ChatFormat
    prompt: str
    tools: Optional[list[dict]]  # the functions the reply may call (None: calls are not read)
    thinking: str  # ChatFormat.thinking

    def reader(self):
        return self.format.reader(self)

    def parse(self, text: str, cut: bool = False) -> Message:
        """The whole reply read at once (what a stream of it adds up to). `cut`: max_tokens ended
        it (a call left open is dropped, Reader.close)."""
        r = self.reader()
        r.feed(text)
        r.close(cut)
        return r.message

    def forced_grammar(self, tokenizer, name: Optional[str] = None, parallel: bool = True) -> str:
        return self.format.forced_grammar(self, tokenizer, name, parallel)

    def auto_grammar(self, tokenizer, parallel: bool = True) -> Optional[str]:
        return self.format.auto_grammar(self, tokenizer, parallel)

    def reasoning_budget(self, tokenizer, tokens: int) -> Optional[ReasoningBudget]:
        return self.format.reasoning_budget(self, tokenizer, tokens)

    @property
    def text_only(self) -> bool:
        """The reply is read as text as written (no reasoning, no calls)."""
        return isinstance(self.reader(), PlainReader)


def _template_message(m: dict) -> dict:
    """An OpenAI message as templates read it: a call's `arguments` as an object (templates print
    it with tojson or iterate it), earlier reasoning as `reasoning_content`, no content as "" (templates
    concatenate it)."""
    m = dict(m)
    if m.get("reasoning") is not None and m.get("reasoning_content") is None:
        m["reasoning_content"] = m.pop("reasoning")
    if m.get("tool_calls"):
        calls = []
        for c in m["tool_calls"]:
            fn = dict(c.get("function") or {})
            if isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except json.JSONDecodeError:
                    pass
            calls.append({**c, "function": fn})
        m["tool_calls"] = calls
    if m.get("content") is None:
        m["content"] = ""
    return m


_PROBE_TOOL = {"type": "function", "function": {
    "name": "moeray_probe_tool_7f3a", "description": "probe",
    "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}


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
