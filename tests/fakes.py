"""Stand-ins the engine and sampling tests share."""
from __future__ import annotations


class CharTokenizer:
    """One token per character (id = code point), decode = join; 0 is the end token."""

    end_ids = frozenset({0})

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids if i)
