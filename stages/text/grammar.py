"""Structured output: a grammar per sequence, applied as a token mask before sampling.

The grammar engine is llguidance (PyPI, maintained by Microsoft's guidance team; what vLLM and
llama.cpp use too): it compiles a JSON schema or a Lark grammar once, and for every step of a
sequence gives the set of tokens that keep the text inside the grammar. Every other token's logit
becomes -inf before sampling, so greedy and sampled decoding both stay inside it. When the grammar
is complete the only tokens left are the end tokens: the sequence ends by itself ("stop"), unless
max_tokens comes first ("length").

A grammar travels to the last stage as text (the llguidance grammar string in
SamplingParams.grammar); the stage keeps one matcher per KV slot, advanced by the token sampled
there. The server compiles and checks a request's grammar before it is submitted, so a bad schema
is a 400, not a failed step.
"""
from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from typing import Any, Optional

from moeray.errors import MoerayError

# JSON as people write it and as models saw it in training: ", " and ": ", no free whitespace.
# Free whitespace would let a small model loop on newlines inside an object until max_tokens.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

_lock = threading.Lock()
_ll_tokenizers: dict[tuple, Any] = {}
_vocab_ids: dict[int, tuple[Any, str]] = {}  # id(backend) -> (backend, a digest of its vocabulary)
# Compiled grammars by (their llguidance tokenizer, text): a large schema takes a second to compile,
# a copy of the compiled matcher microseconds. The server compiles a request's grammar on a worker
# thread before it is submitted (cluster/service.py prepare_grammar), so the stage that applies it
# finds it here and its step never waits on a compile.
_compiled: "OrderedDict[tuple, Any]" = OrderedDict()
_compiling: dict[tuple, threading.Event] = {}  # compiles under way: another asker waits for them
COMPILED_KEPT = 32
_worker = None  # the one thread `in_background` compiles on


class GrammarError(MoerayError):
    """A response_format / tool schema the grammar engine cannot compile."""


# Keywords whose value is one subschema, a list of them, or a name -> subschema map.
_ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames",
        "additionalProperties", "unevaluatedProperties", "unevaluatedItems")
_LIST = ("prefixItems", "anyOf", "oneOf")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def confined(schema: Any, _in_all_of: bool = False) -> Any:
    """`schema` with every object schema that lists its `properties` closed to them
    (`additionalProperties: false`) where it says nothing of other properties: the arguments of a
    forced call hold the keys the function declares and no others, as xgrammar's strict mode (vLLM's
    default) has it. A schema that allows more says so (`additionalProperties: true` or a schema,
    `patternProperties`, `unevaluatedProperties`) and keeps it; a bare {"type": "object"} (any object)
    stays open. The branches of an `allOf` are left open (each names only part of the properties the
    whole allows). A copy; the schema given is not changed."""
    if isinstance(schema, list):
        return [confined(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ONE:
        if isinstance(out.get(key), (dict, list)):
            out[key] = confined(out[key])
    for key in _LIST:
        if isinstance(out.get(key), list):
            out[key] = [confined(s) for s in out[key]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [confined(s, _in_all_of=True) for s in out["allOf"]]
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {name: confined(s) for name, s in out[key].items()}
    says_more = any(k in out for k in ("additionalProperties", "patternProperties", "unevaluatedProperties"))
    if isinstance(out.get("properties"), dict) and not says_more and not _in_all_of:
        out["additionalProperties"] = False
    return out


def json_grammar(schema: Optional[dict] = None) -> str:
    """The grammar of a JSON value matching `schema` (None: any JSON object)."""
    import llguidance

    try:
        return llguidance.LLMatcher.grammar_from_json_schema(
            {"type": "object"} if schema is None else schema, overrides=JSON_STYLE)
    except Exception as exc:  # noqa: BLE001 - ValueError/TypeError documented; any refusal is a 400
        raise GrammarError(f"not a usable JSON schema: {exc}") from None


def lark_grammar(lark: str) -> str:
    import llguidance

    return llguidance.LLMatcher.grammar_from_lark(lark)


def ll_tokenizer(tokenizer, n_vocab: Optional[int] = None):
    """llguidance's view of a moeray Tokenizer (stages/text/tokenizer.py): the same `tokenizers` backend,
    and the tokenizer's end tokens as the grammar's EOS set. Building one takes ~1 s for a 49k
    vocabulary, so it is made once per tokenizer and process."""
    import llguidance

    n_vocab = n_vocab or tokenizer.vocab_size
    backend = tokenizer.backend
    with _lock:  # by the vocabulary's content: the server's tokenizer and a stage's share one
        if id(backend) not in _vocab_ids or _vocab_ids[id(backend)][0] is not backend:
            _vocab_ids[id(backend)] = (backend, hashlib.sha256(backend.to_str().encode()).hexdigest())
        key = (_vocab_ids[id(backend)][1], n_vocab, tuple(sorted(tokenizer.end_ids)))
        if key not in _ll_tokenizers:
            eos = sorted(tokenizer.end_ids) or ([tokenizer.eos_id] if tokenizer.eos_id is not None else None)
            _ll_tokenizers[key] = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=n_vocab, eos_token=eos)
        return _ll_tokenizers[key]


def token_bytes(tokenizer, n_vocab: Optional[int] = None):
    """A function giving a token's text as bytes (special tokens as their text), from the grammar
    engine's view of the vocabulary; b"" for an id beyond it."""
    ll = ll_tokenizer(tokenizer, n_vocab)

    def text(token: int) -> bytes:
        try:
            return ll.decode_bytes([token])
        except Exception:  # noqa: BLE001 - a padding row of the output layer has no text
            return b""
    return text


def matcher(tokenizer, grammar: str, n_vocab: Optional[int] = None):
    """A fresh matcher of `grammar`: a copy of the one compiled before in this process, compiled
    now (and kept) when there is none."""
    import llguidance

    ll = ll_tokenizer(tokenizer, n_vocab)
    key = (id(ll), grammar)
    while True:
        with _lock:
            m = _compiled.get(key)
            if m is not None:
                _compiled.move_to_end(key)
                return m.deep_copy()
            under_way = _compiling.get(key)
            if under_way is None:
                _compiling[key] = threading.Event()
                break
        under_way.wait()  # compiled by another thread now: take its result (or compile, if it failed)
    try:
        m = llguidance.LLMatcher(ll, grammar, log_level=0)
        with _lock:
            _compiled[key] = m
            while len(_compiled) > COMPILED_KEPT:
                _compiled.popitem(last=False)
    finally:
        with _lock:
            _compiling.pop(key).set()
    return m.deep_copy()


def in_background(fn) -> None:
    """Run `fn` (a compile) on this process's grammar thread; what it raises is dropped (the step
    that needs the grammar compiles it then, and names the error)."""
    global _worker
    from concurrent.futures import ThreadPoolExecutor

    with _lock:
        if _worker is None:
            _worker = ThreadPoolExecutor(1, thread_name_prefix="moeray-grammar")
    _worker.submit(fn)


def check_grammar(grammar: str, tokenizer, n_vocab: Optional[int] = None) -> None:
    """Raise GrammarError naming the problem if `grammar` does not compile for this tokenizer; the
    compiled grammar is kept for the sequences that will use it (`matcher`)."""
    try:
        m = matcher(tokenizer, grammar, n_vocab)
    except Exception as exc:  # noqa: BLE001 - whatever the engine refuses is the request's problem, not a 500
        raise GrammarError(f"the grammar engine refused it: {exc}") from None
    if m.is_error():
        raise GrammarError(m.get_error() or "the grammar does not compile")


class GrammarMasks:
    """The matchers of one stage's sequences, by KV slot."""

    def __init__(self, tokenizer, n_vocab: int):
        self.tokenizer, self.n_vocab = tokenizer, n_vocab
        self.matchers: dict[int, Any] = {}

    def reset(self, slot: int) -> None:
        self.matchers.pop(slot, None)

    def allowed(self, slot: int, grammar: str):
        """Bool [n_vocab]: the tokens this slot's sequence may take next."""
        import numpy as np
        import torch

        m = self.matchers.get(slot)
        if m is None:
            m = self.matchers[slot] = matcher(self.tokenizer, grammar, self.n_vocab)
        if m.is_error():
            # The server checked the grammar, so this is an engine fault: end the sequence (an end token
            # is the one thing allowed) rather than let it run unconstrained or fail the whole step.
            out = torch.zeros(self.n_vocab, dtype=torch.bool)
            out[sorted(self.tokenizer.end_ids)] = True
            return out
        bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")
        return torch.from_numpy(bits[:self.n_vocab].astype(bool))

    def allowed_along(self, slot: int, grammar: str, draft) -> list:
        """The masks of a verify row's k+1 positions (stages/text/verify.py): the mask now, then after
        each drafted token in turn, consumed tentatively and rolled back before returning. A draft
        token the grammar forbids is refused at its position (its probability there is 0), so the
        positions after it are never reached: their masks are None."""
        masks = [self.allowed(slot, grammar)]
        m = self.matchers[slot]
        taken = 0
        for d in draft:
            if m.is_error() or not bool(masks[-1][d]) or not m.consume_token(d):
                break
            taken += 1
            masks.append(self.allowed(slot, grammar))
        if taken:
            m.rollback(taken)
        return masks + [None] * (len(draft) + 1 - len(masks))

    def advance(self, slot: int, token: int) -> None:
        m = self.matchers.get(slot)
        if m is not None and not m.is_error():
            m.consume_token(token)


def schema_from_response_format(response_format: dict) -> Optional[str]:
    """The grammar an OpenAI `response_format` asks for; None for {"type": "text"}.

    {"type": "json_object"}: any JSON object. {"type": "json_schema", "json_schema": {"name": ...,
    "schema": {...}, "strict": ...}}: a JSON value matching the schema.
    """
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_grammar(None)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema") or {}, (dict, bool)):
            raise GrammarError('json_schema must be an object {"name": ..., "schema": {...}}')
        schema = spec.get("schema")
        if schema is None or schema is True or schema == {}:
            schema = {"type": "object"}
        if schema is False:
            raise GrammarError("a schema of `false` matches nothing")
        return json_grammar(json.loads(json.dumps(schema)))
    raise GrammarError(f"response_format type {kind!r} is not one of 'text', 'json_object', 'json_schema'")
