"""What a chat reply is made of, whole and in pieces: OpenAI's assistant message (`content`,
`reasoning_content`, `tool_calls`) and the deltas a stream sends of it."""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Optional


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=new_call_id)

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class CallDelta:
    """A piece of tool call `index`: its id and name come first (once), then argument fragments."""
    index: int
    id: Optional[str] = None
    name: Optional[str] = None
    arguments: str = ""


@dataclass
class Delta:
    reasoning: str = ""
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)
    broken: list[int] = field(default_factory=list)  # calls (by index) that turned out malformed: their text is content

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)


@dataclass
class Message:
    """The whole reply: what a stream's deltas add up to, less the calls that broke."""
    content: str = ""
    reasoning: str = ""
    calls: dict[int, ToolCall] = field(default_factory=dict)

    def add(self, d: Delta) -> None:
        self.reasoning += d.reasoning
        self.content += d.content
        for c in d.calls:
            if c.index not in self.calls:
                self.calls[c.index] = ToolCall(c.name or "", "", c.id or new_call_id())
            self.calls[c.index].arguments += c.arguments
        for i in d.broken:
            self.calls.pop(i, None)

    @property
    def tool_calls(self) -> list[ToolCall]:
        return [self.calls[i] for i in sorted(self.calls)]

    def as_openai(self) -> dict[str, Any]:
        """The message as OpenAI writes it: content null when there are calls and no text."""
        calls = self.tool_calls
        return {"role": "assistant", "content": (self.content or None) if calls else self.content,
                "reasoning_content": self.reasoning or None,
                "tool_calls": [c.as_openai() for c in calls] or None}
