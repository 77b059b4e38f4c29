"""No format: the reply is content as written (a GGUF without a template, or `--chat-format plain`);
a request with `tools` is refused (nothing reads calls). A template moeray does not recognise gets
the generic format (generic.py), which reads text the same way and takes tools too."""
from __future__ import annotations

from moeray.stages.text.chat.base import ChatFormat
from moeray.stages.text.chat.reader import PlainReader


class Plain(ChatFormat):
    name = "plain"
    summary = "content as written; no reasoning or tool calls read"
    think = None

    def reader(self, turn):
        return PlainReader()
