"""The tokeniser and chat template a GGUF carries in its own metadata, as llama.cpp reads them.

A GGUF has no tokenizer.json: it stores llama.cpp's `tokenizer.ggml.*` keys (model type, the
pre-tokenizer's name, tokens, merges or scores, token types, special ids) and
`tokenizer.chat_template`. Only those keys are read (a vocab-only GGUF, or a file whose
architecture moeray does not run, tokenizes), and they are read as llama.cpp's
src/llama-vocab.cpp reads them:
- a byte-level BPE vocabulary ("gpt2") is split by the pre-tokenizer its `tokenizer.ggml.pre`
  names (stages/text/pretokenize.py; an unknown name stops), then merged by rank, built here as a
  `tokenizers` BPE;
- a sentencepiece vocabulary ("llama") goes through transformers' GGUF converter, with
  sentencepiece's space prefix put back (`_always_prefix_space`);
- special tokens, BOS/EOS defaults, `add_bos` and the end-of-generation set follow llama.cpp's
  rules (`_Specials`): control tokens are matched whole in a prompt and dropped from decoded text,
  user-defined ones matched whole and kept, and a token whose text llama.cpp treats as an end of
  generation is one whatever its type.
The chat template is rendered with transformers' own jinja2 renderer, so the prompt text is what
`apply_chat_template` would give.
"""
from __future__ import annotations

import functools
import json
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from moeray.errors import GGUFError, MoerayError

log = logging.getLogger("moeray")

# llama.cpp's token types (gguf.TokenType) and what each makes a token.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Texts llama.cpp takes for an end of generation, whatever the token's type (llama-vocab.cpp,
# "maintain a list of tokens that cause end-of-generation").
_EOG_TEXTS = frozenset((
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[",
))
# Texts llama.cpp recognises as fill-in-the-middle tokens when the file names none: it makes them
# control tokens, and the pad / repo / file-separator ones end a generation.
_FIM_TEXTS = {
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>",
              "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>")
# OpenAI's harmony format (gpt-oss): these markers are part of a reply's text (llama.cpp renders them).
_HARMONY_RENDERED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")


def read_tokenizer_metadata(path: str | Path) -> dict[str, Any]:
    """The `tokenizer.*` keys (and general.architecture / general.name) of a GGUF, as Python values:
    only the header of the file (the first part of a model in parts) is read, and nothing about
    the model is checked, so a vocab-only GGUF or a model moeray does not run tokenizes too."""
    from moeray.stages.gguf.parts import first_part_path
    from moeray.stages.gguf.reader import _read_directory

    first = first_part_path(str(path))
    metadata = _read_directory(first if Path(first).is_file() else str(path)).metadata
    return {k: v for k, v in metadata.items()
            if k.startswith("tokenizer.") or k in ("general.architecture", "general.name")}


@dataclass
class _Specials:
    """llama.cpp's reading of a vocabulary's special tokens (llama_vocab::impl::load)."""
    bos_id: int | None
    eos_id: int | None
    add_bos: bool
    control: set[int]  # matched whole in a prompt (parse_special) and dropped from decoded text
    user_defined: set[int]  # matched whole in any text, kept in decoded text
    end_ids: set[int]  # the end-of-generation set

    @classmethod
    def read(cls, meta: dict[str, Any], tokens: list[str], model: str, pre) -> "_Specials":
        n = len(tokens)
        types = list(meta.get("tokenizer.ggml.token_type") or [NORMAL] * n)
        ids = {t: i for i, t in enumerate(tokens)}  # a repeated text: the last id, as llama.cpp's map keeps
        bos, eos = (1, 2) if model == "llama" else (11, 11)  # llama.cpp's defaults, unless the file says
        if pre is not None and pre.no_bos:
            bos = None
        bos, eos = (None if x is not None and x >= n else x for x in (bos, eos))

        def key(name: str, default):
            v = meta.get(f"tokenizer.ggml.{name}_token_id")
            return int(v) if v is not None and 0 <= int(v) < n else default

        bos, eos = key("bos", bos), key("eos", eos)
        eot, eom = key("eot", None), key("eom", None)
        fim = {k: key(k, None) for k in _FIM_TEXTS}
        add_bos = model == "llama" or (pre is not None and pre.add_bos)
        if meta.get("tokenizer.ggml.add_bos_token") is not None:
            add_bos = bool(meta["tokenizer.ggml.add_bos_token"])
        control = {i for i, t in enumerate(types) if t in (CONTROL, UNKNOWN)}
        user = {i for i, t in enumerate(types) if t == USER_DEFINED}
        # Auto-detected by text where the file names none, as llama.cpp does (it takes the first
        # it meets in a hash map; a vocabulary with two candidates is not one it orders either).
        found = {}
        if eot is None:
            eot = found["eot"] = next((ids[t] for t in _EOT_TEXTS if t in ids), None)
        if eom is None:
            eom = found["eom"] = ids.get("<|eom_id|>")
        for k, texts in _FIM_TEXTS.items():
            if fim[k] is None:
                fim[k] = found[k] = next((ids[t] for t in texts if t in ids), None)
        control |= {i for i in found.values() if i is not None}
        end = {fim[k] for k in ("fim_pad", "fim_rep", "fim_sep") if fim[k] is not None}
        eog = {ids[t] for t in _EOG_TEXTS if t in ids}
        end |= eog
        control |= eog
        for text in _HARMONY_RENDERED:  # llama.cpp renders gpt-oss's channel markers
            if text in ids:
                control.discard(ids[text])
                user.add(ids[text])
        end |= {i for i in (eos, eot, eom) if i is not None}
        texts = {tokens[i]: i for i in end}
        if "<|end|>" in texts and (("<|return|>" in texts and "<|call|>" in texts)
                                   or ("<|calls|>" in texts and "<|flush|>" in texts)):
            end.discard(texts["<|end|>"])  # harmony's <|end|> closes a message, not the reply
            control.discard(texts["<|end|>"])
            user.add(texts["<|end|>"])
        if "</s>" in texts and ("<|tool_response>" in texts or "<|plamo:eos|>" in texts):
            end.discard(texts["</s>"])
            control.discard(texts["</s>"])
        user -= control
        return cls(bos, eos, add_bos, control, user, end)


@dataclass
class Tokenizer:
    backend: Any  # tokenizers.Tokenizer
    bos_id: int | None
    eos_id: int | None
    add_bos: bool
    chat_template: str | None
    end_ids: frozenset[int] = field(default_factory=frozenset)  # any of these ends a generation
    special_ids: frozenset[int] = field(default_factory=frozenset)  # control tokens: not in decoded text
    rendered_ids: frozenset[int] = field(default_factory=frozenset)  # user-defined tokens: decoded as text
    pre: str = ""  # the pre-tokenizer (tokenizer.ggml.pre) a BPE vocabulary is split with
    _plain: Any = None  # the backend that reads control tokens' text as text (parse_special=False)
    _vocab_size: int | None = None  # counted once: the backend counts a 152k vocabulary in ~35 ms a call

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, path: str | Path) -> "Tokenizer":
        return cls.from_metadata(read_tokenizer_metadata(path), source=str(path))

    @classmethod
    def from_metadata(cls, metadata: dict[str, Any], source: str = "GGUF") -> "Tokenizer":
        if "tokenizer.ggml.tokens" not in metadata or "tokenizer.ggml.model" not in metadata:
            raise GGUFError(f"{source}: no tokenizer in the GGUF metadata (tokenizer.ggml.model / tokens missing)")
        model = metadata["tokenizer.ggml.model"]
        tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
        if model == "gpt2":
            from moeray.stages.text.pretokenize import pre_of

            pre_name, pre = pre_of(metadata.get("tokenizer.ggml.pre"), source)
        elif model == "llama":
            pre_name, pre = "", None
        else:
            raise GGUFError(f"{source}: tokenizer.ggml.model '{model}' is not supported; moeray reads byte-level BPE "
                            "('gpt2') and sentencepiece ('llama') vocabularies")
        sp = _Specials.read(metadata, tokens, model, pre)
        if model == "gpt2":
            backend = _bpe_backend(metadata, tokens, pre, sp, source)
        else:
            backend = _spm_backend(metadata, source)
        return cls(
            backend=backend,
            bos_id=sp.bos_id,
            eos_id=sp.eos_id,
            add_bos=sp.add_bos,
            chat_template=metadata.get("tokenizer.chat_template"),
            end_ids=frozenset(sp.end_ids),
            special_ids=frozenset(sp.control),
            rendered_ids=frozenset(sp.user_defined),
            pre=pre_name,
        )

    # -- use ------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        # tokenizers builds the whole vocabulary map to count it with the added tokens; the server asks
        # on every request (token ids and logit_bias checked against it), so it is counted once.
        if self._vocab_size is None:
            self._vocab_size = self.backend.get_vocab_size(with_added_tokens=True)
        return self._vocab_size

    def encode(self, text: str, add_bos: bool | None = None, parse_special: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in the text (e.g. <|im_start|>) stay whole
        (`parse_special=False`: control tokens' text is read as text, as llama.cpp's
        parse_special=false does; user-defined tokens stay whole either way).
        A lone UTF-16 surrogate (valid in JSON as "\\ud800", or from an undecodable byte in argv)
        is not a character and `tokenizers` refuses the whole string: it becomes U+FFFD, as any
        UTF-8 encoder that replaces errors would write it.

        Through `encode_batch`, which lets go of Python's GIL while it works (`encode` holds it):
        a server tokenizing a long prompt on one thread keeps stepping and answering on the others
        (a 900 KB text: ~1 s either way; another thread ran 3 times during `encode`, 829 during
        `encode_batch`)."""
        backend = self.backend if parse_special else self._plain_backend()
        ids = backend.encode_batch([without_lone_surrogates(text)], add_special_tokens=False)[0].ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            if not ids or ids[0] != self.bos_id:  # a chat template may already start with BOS
                ids = [self.bos_id] + ids
        return ids

    def _plain_backend(self):
        if self._plain is None:
            from tokenizers import Tokenizer as Backend

            self._plain = Backend.from_str(self.backend.to_str())
            self._plain.encode_special_tokens = True
        return self._plain

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        """The text of `ids`; `skip_special`: without control tokens (user-defined ones, such as
        harmony's channel markers, are text), as llama.cpp renders a reply."""
        keep = [i for i in ids if i not in self.special_ids] if skip_special else list(ids)
        return self.backend.decode(keep, skip_special_tokens=False)

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



def _bpe_backend(meta: dict[str, Any], tokens: list[str], pre, sp: _Specials, source: str):
    """A byte-level BPE as llama.cpp runs it: the pre-tokenizer's splits, GPT-2's byte map, merges
    by rank (a piece that is itself a token taken whole where the pre says so), special tokens
    matched whole before any of it."""
    from tokenizers import AddedToken, Tokenizer as Backend, decoders, models

    from moeray.stages.text.pretokenize import pre_tokenizer

    vocab = {t: i for i, t in enumerate(tokens)}
    merges, dropped = [], 0
    for m in meta.get("tokenizer.ggml.merges") or []:
        cut = m.find(" ", 1)  # llama.cpp splits a merge at its first space after the first character
        a, b = (m[:cut], m[cut + 1:]) if cut > 0 else (m, "")
        if a in vocab and b in vocab and a + b in vocab:
            merges.append((a, b))
        else:
            dropped += 1
    if dropped:  # llama.cpp keeps them, then falls back to bytes for a merged piece that is no token
        log.warning("%s: %d BPE merges name pieces that are not tokens; they are left out", source, dropped)
    try:
        backend = Backend(models.BPE(vocab, merges, ignore_merges=pre.ignore_merges))
    except Exception as exc:  # noqa: BLE001 - the library's words for a vocabulary it cannot build
        raise GGUFError(f"{source}: the BPE vocabulary cannot be built ({exc}); the file's tokenizer is damaged") from None
    backend.pre_tokenizer = pre_tokenizer(pre.rule)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in sorted(sp.control)])
    backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in sorted(sp.user_defined)])
    return backend


def _spm_backend(meta: dict[str, Any], source: str):
    """A sentencepiece vocabulary through transformers' GGUF converter (scores to merges, byte
    fallback), with the space prefix sentencepiece puts even before a leading space."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    tok_dict = {name: meta[f"tokenizer.{key}"] for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
                if f"tokenizer.{key}" in meta}
    try:
        backend, _ = convert_gguf_tokenizer(meta.get("general.architecture", "llama"), tok_dict)
    except ValueError as exc:
        raise GGUFError(f"{source}: {exc}") from exc
    if meta.get("tokenizer.ggml.add_space_prefix", True):
        _always_prefix_space(backend)
    return backend


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
