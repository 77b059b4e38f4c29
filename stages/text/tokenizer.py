"""The tokeniser and chat template a GGUF carries in its own metadata.

A GGUF has no tokenizer.json: it stores llama.cpp's `tokenizer.ggml.*` keys (model type, tokens,
merges or scores, token types, special ids) and `tokenizer.chat_template`. transformers already
knows how to turn those into a `tokenizers` fast tokenizer (its GGUF converter), so we hand it
the metadata and keep only the backend `tokenizers.Tokenizer`. The chat template is rendered with
transformers' own jinja2 renderer, so the prompt text is what `apply_chat_template` would give.
"""
from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from moeray.errors import GGUFError, MoerayError

# Tokens llama.cpp treats as end-of-generation when a vocabulary has them (its EOG set), besides
# the file's eos id: an instruct model ends its turn with <|im_end|> but a base-style continuation
# may end with <|endoftext|>.
_END_OF_GENERATION_TEXTS = (
    "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|end_of_text|>",
    "</s>", "<|return|>", "<|call|>", "<EOT>",
)


def read_tokenizer_metadata(path: str | Path) -> dict[str, Any]:
    """The `tokenizer.*` keys and `general.architecture` of a GGUF, as Python values."""
    from moeray.stages.gguf.reader import read_gguf_header

    metadata = read_gguf_header(path).metadata
    return {k: v for k, v in metadata.items() if k.startswith("tokenizer.") or k == "general.architecture"}


@dataclass
class Tokenizer:
    backend: Any  # tokenizers.Tokenizer
    bos_id: int | None
    eos_id: int | None
    add_bos: bool
    chat_template: str | None
    end_ids: frozenset[int] = field(default_factory=frozenset)  # any of these ends a generation
    special_ids: frozenset[int] = field(default_factory=frozenset)
    rendered_ids: frozenset[int] = field(default_factory=frozenset)  # control tokens decoded as text (harmony)

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, path: str | Path) -> "Tokenizer":
        return cls.from_metadata(read_tokenizer_metadata(path), source=str(path))

    @classmethod
    def from_metadata(cls, metadata: dict[str, Any], source: str = "GGUF") -> "Tokenizer":
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            GGUF_TOKENIZER_MAPPING,
            convert_gguf_tokenizer,
        )

        if "tokenizer.ggml.tokens" not in metadata or "tokenizer.ggml.model" not in metadata:
            raise GGUFError(f"{source}: no tokenizer in the GGUF metadata (tokenizer.ggml.model / tokens missing)")
        tok_dict = {
            name: metadata[f"tokenizer.{key}"]
            for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
            if f"tokenizer.{key}" in metadata
        }
        model_type = tok_dict["tokenizer_type"]
        try:
            backend, _ = convert_gguf_tokenizer(metadata.get("general.architecture", "llama"), tok_dict)
        except ValueError as exc:
            raise GGUFError(f"{source}: {exc}") from exc
        if model_type == "llama" and metadata.get("tokenizer.ggml.add_space_prefix", True):
            _always_prefix_space(backend)

        tokens: list[str] = list(tok_dict["tokens"])
        token_types = list(metadata.get("tokenizer.ggml.token_type") or [])
        bos_id = metadata.get("tokenizer.ggml.bos_token_id")
        eos_id = metadata.get("tokenizer.ggml.eos_token_id")
        # llama.cpp adds BOS to a sentencepiece vocabulary unless the file says otherwise.
        add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", model_type == "llama"))
        # CONTROL (3) tokens are special: they never appear in decoded text.
        special = frozenset(i for i, t in enumerate(token_types) if t == 3)
        end_ids = {i for i, tok in enumerate(tokens) if tok in _END_OF_GENERATION_TEXTS and i in special}
        for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
            if metadata.get(key) is not None:
                end_ids.add(int(metadata[key]))
        rendered = _harmony_rules(tokens, end_ids)
        return cls(
            backend=backend,
            bos_id=None if bos_id is None else int(bos_id),
            eos_id=None if eos_id is None else int(eos_id),
            add_bos=add_bos,
            chat_template=metadata.get("tokenizer.chat_template"),
            end_ids=frozenset(end_ids),
            special_ids=special - rendered,
            rendered_ids=rendered,
        )

    # -- use ------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; special tokens written in the text (e.g. <|im_start|>) stay whole.
        A lone UTF-16 surrogate (valid in JSON as "\\ud800", or from an undecodable byte in argv)
        is not a character and `tokenizers` refuses the whole string: it becomes U+FFFD, as any
        UTF-8 encoder that replaces errors would write it.

        Through `encode_batch`, which lets go of Python's GIL while it works (`encode` holds it):
        a server tokenizing a long prompt on one thread keeps stepping and answering on the others
        (a 900 KB text: ~1 s either way; another thread ran 3 times during `encode`, 829 during
        `encode_batch`)."""
        ids = self.backend.encode_batch([without_lone_surrogates(text)], add_special_tokens=False)[0].ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            if not ids or ids[0] != self.bos_id:  # a chat template may already start with BOS
                ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        if skip_special and self.rendered_ids:  # drop the other control tokens, keep these as text
            return self.backend.decode([i for i in ids if i not in self.special_ids], skip_special_tokens=False)
        return self.backend.decode(list(ids), skip_special_tokens=skip_special)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, template: str | None = None, **variables: Any) -> str:
        """The prompt text for a conversation, rendered as transformers' apply_chat_template does;
        `tools` (OpenAI's function specs) reach the template as its `tools` variable, `variables`
        (chat_template_kwargs such as enable_thinking, reasoning_effort) as theirs. `template`: the
        file's template as a chat format adapted it (stages/text/chat/kimi_k2.py)."""
        from transformers.utils.chat_template_utils import render_jinja_template

        if not self.chat_template:
            raise GGUFError("this GGUF has no tokenizer.chat_template; run without --chat")
        bos = self.backend.id_to_token(self.bos_id) if self.bos_id is not None else ""
        eos = self.backend.id_to_token(self.eos_id) if self.eos_id is not None else ""
        try:
            rendered, _ = render_jinja_template(
                conversations=[messages],
                tools=tools,
                chat_template=template or self.chat_template,
                add_generation_prompt=add_generation_prompt,
                bos_token=bos,
                eos_token=eos,
                **variables,
            )
        except Exception as exc:  # noqa: BLE001 - a template's raise_exception(), or data it cannot print
            raise MoerayError(f"the model's chat template refused this conversation: {exc}") from None
        return rendered[0]

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict] | None = None) -> list[int]:
        return self.encode(self.apply_chat_template(messages, tools=tools))

    @functools.cached_property
    def max_token_bytes(self) -> int | None:
        """The most bytes of a text one token can stand for, when the tokenizer keeps every byte of
        the text (None when it may drop or shrink some: then no byte count bounds the tokens).

        Why it bounds: the text is split at the special tokens written in it, each one token for
        its own bytes; every other piece goes through the normalizer and the pre-tokenizer, which
        here only keep or grow it (none; SentencePiece's "▁" prefix and " " -> "▁", 1 byte to 3;
        byte-level mapping, one character per byte; splits that keep what they split), and the
        model covers what they give exactly, each token its own string (a byte-fallback token
        <0xNN> one byte, an unknown character at most 4). So tokens x max_token_bytes >= the
        text's UTF-8 bytes: `min_tokens`."""
        def config(step) -> dict | None:
            return None if step is None else json.loads(step.__getstate__())

        if not (_keeps_bytes(config(self.backend.normalizer)) and _keeps_bytes(config(self.backend.pre_tokenizer))):
            return None
        added = {t.content for t in self.backend.get_added_tokens_decoder().values()}
        vocab = set(self.backend.get_vocab(with_added_tokens=False)) - added
        if "ByteLevel" in json.dumps(config(self.backend.pre_tokenizer)):
            # a character of GPT-2's byte alphabet is one byte; another (none should be) counts its UTF-8
            alphabet = _byte_level_alphabet()
            sizes = [len(t) if alphabet.issuperset(t) else _utf8_len(t) for t in vocab]
        else:
            sizes = [_utf8_len(t) for t in vocab]
        return max(4, max(sizes, default=0), max(map(_utf8_len, added), default=0))

    def min_tokens(self, text: str) -> int:
        """At least this many tokens does `encode(text)` give (0 when max_token_bytes is unknown):
        its UTF-8 bytes over max_token_bytes, counted without tokenizing (a 20 MB text: ~20 ms)."""
        most = self.max_token_bytes
        return 0 if most is None else math.ceil(_utf8_len(text) / most)

    def with_rendered(self, texts: Sequence[str]) -> "Tokenizer":
        """This tokenizer with the control tokens spelled `texts` decoded as text: a chat format's
        markers (DeepSeek's and Kimi's call markers are control tokens) must reach its reader, as
        llama-server's parsers get the markers they preserve. End tokens stay ends, not text."""
        import dataclasses

        ids = {i for t in texts if (i := self.backend.token_to_id(t)) is not None and i in self.special_ids - self.end_ids}
        if not ids:
            return self
        return dataclasses.replace(self, special_ids=self.special_ids - ids, rendered_ids=self.rendered_ids | ids)

    def token_text(self, token_id: int) -> str:
        """One token's own text, special tokens included (log-probabilities name tokens by it)."""
        return self.backend.decode([token_id], skip_special_tokens=False)



# OpenAI's harmony format (gpt-oss, o200k_harmony): a reply is several messages, each ending in
# <|end|>, the last in <|return|> (or <|call|> for a tool call); the channel and message markers
# are part of the reply's text. llama.cpp's rules for such a vocabulary (llama-vocab.cpp): <|end|>
# is not an end of generation when <|return|> and <|call|> are, and these markers are rendered.
_HARMONY_RENDERED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")


def _harmony_rules(tokens: list[str], end_ids: set[int]) -> frozenset[int]:
    """Apply llama.cpp's harmony rules to `end_ids` (in place); returns the ids rendered as text."""
    text = {i: tokens[i] for i in end_ids if 0 <= i < len(tokens)}
    rendered = {i for i, tok in enumerate(tokens) if tok in _HARMONY_RENDERED}
    if {"<|return|>", "<|call|>", "<|end|>"} <= set(text.values()):
        end = next(i for i, t in text.items() if t == "<|end|>")
        end_ids.discard(end)
        rendered.add(end)
    return frozenset(rendered)


# The normalizers and pre-tokenizers that keep every byte of a text (or grow it): `max_token_bytes`.
_KEEPING = {"Prepend", "ByteLevel", "Metaspace", "Split", "Digits", "Punctuation", "Sequence"}


def _keeps_bytes(step: dict | None) -> bool:
    if step is None:
        return True
    kind = step.get("type")
    if kind == "Sequence":
        return all(_keeps_bytes(s) for s in step.get("normalizers") or step.get("pretokenizers") or ())
    if kind == "Replace":  # keeps the length when it writes at least as many bytes as it replaces
        pattern = (step.get("pattern") or {}).get("String")
        return pattern is not None and len(step.get("content", "").encode()) >= len(pattern.encode())
    return kind in _KEEPING and step.get("behavior") != "Removed"


def _utf8_len(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


@functools.lru_cache(maxsize=1)
def _byte_level_alphabet() -> frozenset[str]:
    """The 256 characters GPT-2's byte-level BPE writes the bytes 0-255 as (one each)."""
    from tokenizers.pre_tokenizers import ByteLevel

    return frozenset(ByteLevel.alphabet())


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def without_lone_surrogates(text: str) -> str:
    """`text` with every lone surrogate code point replaced by U+FFFD (a str holds a surrogate only
    when it is unpaired: json.loads joins a valid pair into one code point)."""
    return _LONE_SURROGATE.sub("\ufffd", text)


def _always_prefix_space(backend: Any) -> None:
    """sentencepiece and llama.cpp put "▁" before the text even when it already starts with a space
    ("  hi" -> "▁▁▁hi"); the `Metaspace` pre-tokenizer transformers' converter uses skips it then
    ("▁▁hi"), which gives the model a token sequence it never saw. A normalizer does it the SPM way."""
    from tokenizers import normalizers

    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
    )
    backend.pre_tokenizer = None
