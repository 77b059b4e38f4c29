"""Chat formats, one module per family: how its template is called, how its replies are read
(content, reasoning, tool calls; whole or streamed) and how a call is forced. See base.py.

The format is chosen from the GGUF: the markers its chat template writes, else its architecture,
else `generic` (tools as llama-server's generic JSON); `--chat-format NAME` overrides the choice.
"""
from __future__ import annotations

from typing import Optional

from moeray.stages.text.chat.base import ChatFormat, ChatFormatError, Turn, template_renders_tools
from moeray.stages.text.chat.deepseek import DeepSeek
from moeray.stages.text.chat.generic import Generic
from moeray.stages.text.chat.glm import Glm
from moeray.stages.text.chat.harmony import Harmony
from moeray.stages.text.chat.hermes import Hermes
from moeray.stages.text.chat.kimi_k2 import KimiK2
from moeray.stages.text.chat.message import CallDelta, Delta, Message, ToolCall
from moeray.stages.text.chat.plain import Plain
from moeray.stages.text.chat.qwen3_xml import Qwen3Xml

FORMATS: dict[str, type[ChatFormat]] = {f.name: f for f in (Hermes, Qwen3Xml, DeepSeek, Glm, KimiK2, Harmony, Generic,
                                                             Plain)}

# What a template writes that only one family writes, checked in this order (a Qwen3.5 template
# also has <tool_call>: its <function= decides).
_TEMPLATE_MARKERS = (
    ("harmony", ("<|channel|>",)),
    ("kimi_k2", ("<|tool_calls_section_begin|>",)),
    ("deepseek", ("<｜tool▁calls▁begin｜>",)),
    ("deepseek", ("<｜Assistant｜>",)),
    ("glm", ("<arg_key>",)),
    ("qwen3_xml", ("<function=", "<parameter=")),
    ("hermes", ("<tool_call>",)),
)
# A GGUF whose template writes no family's markers: its architecture's family, else generic.
_ARCHITECTURES = {"gpt-oss": "harmony", "glm4moe": "glm"}


def detect(template: Optional[str], architecture: Optional[str] = None) -> str:
    """The format's name for a chat template (and the file's architecture)."""
    text = template or ""
    for name, markers in _TEMPLATE_MARKERS:
        if all(m in text for m in markers):
            return name
    if not text:
        return "plain"  # no template: nothing to chat with
    return _ARCHITECTURES.get(architecture or "", "generic")


def chat_format(template: Optional[str], architecture: Optional[str] = None, name: Optional[str] = None) -> ChatFormat:
    """The chat format of a model: `name` ("auto" or None: detected)."""
    if name in (None, "auto"):
        name = detect(template, architecture)
    if name not in FORMATS:
        raise ChatFormatError(f"unknown chat format {name!r}; choose one of auto, {', '.join(FORMATS)}")
    return FORMATS[name](template)


__all__ = ["FORMATS", "ChatFormat", "ChatFormatError", "Turn", "Message", "Delta", "CallDelta", "ToolCall",
           "chat_format", "detect", "template_renders_tools"]
