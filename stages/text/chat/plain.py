"""No format: the reply is content as written (SmolLM2, Mixtral and any template moeray does not
recognise); a request with `tools` is refused (the template cannot show them, nothing reads calls)."""
from __future__ import annotations

from moeray.stages.text.chat.base import ChatFormat
from moeray.stages.text.chat.reader import PlainReader


class Plain(ChatFormat):
    name = "plain"
    summary = "content as written; no reasoning or tool calls read"
    think = None

    def reader(self, turn):
        return PlainReader()
