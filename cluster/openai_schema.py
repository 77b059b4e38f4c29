"""The OpenAI HTTP API's request and response bodies, as pydantic models.

Every request parameter either does what it asks or is a 400 naming it, never silently ignored:
what moeray implements is declared as a field; OpenAI's parameters that it does not implement are
listed in UNSUPPORTED with the values that ask for nothing (a client library may send one at
its default); the fields clients written for llama-server or vLLM send that moeray does not do are
listed in FOREIGN (accepted, with a warning in the log the first time one asks for something);
any other name is unknown (OpenAI's own server rejects those too). Strict types where OpenAI is
strict: `max_tokens: "10"` or `temperature: "hot"` are rejected, not coerced.
"""
from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Annotated, Any, ClassVar, Literal, Optional, Union

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, field_validator,
                      model_validator)
from pydantic_core import PydanticCustomError

log = logging.getLogger("moeray")

Number = Union[StrictInt, StrictFloat]
INT64 = dict(ge=-(1 << 63), le=(1 << 63) - 1)

# ---------------------------------------------------------------- which parameters moeray does

# OpenAI's parameters that moeray does not implement, with the values that ask for nothing
# (null always does). Anything else is a 400 naming the parameter.
UNSUPPORTED_CHAT: dict[str, tuple] = {
    "store": (False,), "modalities": (["text"],), "audio": (), "prediction": (),
    "verbosity": (), "web_search_options": (), "service_tier": ("auto", "default"),
    "functions": (), "function_call": (),
}
UNSUPPORTED_COMPLETIONS: dict[str, tuple] = {"best_of": (1,), "echo": (False,), "suffix": ()}


# Fields of llama-server's and vLLM's requests that moeray does not do, with the values that ask
# for nothing there (null always does) and why moeray goes on without them. Accepted so their
# clients keep working; one asking for something is logged once per field (docs/api.md).
FOREIGN: dict[str, tuple[tuple, str]] = {
    # llama-server
    "cache_prompt": ((True,), "moeray always reuses a cached prompt prefix (--no-prefix-reuse is the server's switch)"),
    "id_slot": ((-1,), "moeray assigns sequence slots itself"),
    "n_probs": ((0,), "ask for logprobs / top_logprobs instead"),
    "samplers": ((), "moeray's sampler order is fixed (vLLM's: docs/sampling.md)"),
    "return_tokens": ((False,), "moeray returns text only"),
    "top_a": ((0, 0.0), "moeray has no top-a sampler"),
    "typical_p": ((1, 1.0), "moeray has no typical sampler"),
    "tfs_z": ((1, 1.0), "moeray has no tail-free sampler"),
    "mirostat": ((0,), "moeray has no mirostat sampler"),
    "mirostat_tau": ((), "moeray has no mirostat sampler"),
    "mirostat_eta": ((), "moeray has no mirostat sampler"),
    "dynatemp_range": ((0, 0.0), "moeray has no dynamic temperature"),
    "dynatemp_exponent": ((1, 1.0), "moeray has no dynamic temperature"),
    "xtc_probability": ((0, 0.0), "moeray has no XTC sampler"),
    "xtc_threshold": ((), "moeray has no XTC sampler"),
    "dry_multiplier": ((0, 0.0), "moeray has no DRY sampler"),
    "dry_base": ((), "moeray has no DRY sampler"),
    "dry_allowed_length": ((), "moeray has no DRY sampler"),
    "dry_penalty_last_n": ((), "moeray has no DRY sampler"),
    "dry_sequence_breakers": ((), "moeray has no DRY sampler"),
    "repeat_last_n": ((-1,), "moeray's repetition_penalty reads the whole sequence"),
    "penalty_last_n": ((-1,), "moeray's repetition_penalty reads the whole sequence"),
    "penalize_nl": ((), "moeray's repetition_penalty counts every token"),
    "min_keep": ((0,), "moeray's samplers keep at least the likeliest token"),
    "n_keep": ((), "moeray refuses a prompt over the context instead of shifting it"),
    "n_indent": ((0,), "moeray has no indentation stop"),
    "t_max_predict_ms": ((0,), "moeray has no time limit per request (max_tokens is the limit)"),
    "timings_per_token": ((False,), "moeray reports no per-token timings"),
    "return_progress": ((False,), "moeray reports no prompt progress"),
    "post_sampling_probs": ((False,), "moeray's log-probabilities are the model's, before the samplers"),
    "reasoning_format": (("auto", "deepseek"), "moeray always returns the reasoning apart (reasoning_content)"),
    "parse_tool_calls": ((True,), "moeray always reads tool calls when tools are given"),
    # vLLM
    "min_tokens": ((0,), "moeray's sampler has no minimum length: the reply may end sooner"),
    "skip_special_tokens": ((True,), "moeray's text never holds control tokens"),
    "spaces_between_special_tokens": ((True,), "moeray's text never holds control tokens"),
    "include_stop_str_in_output": ((False,), "moeray's text ends before the stop string"),
    "truncate_prompt_tokens": ((), "moeray refuses a prompt over the context instead of cutting it"),
    "priority": ((0,), "moeray serves requests in arrival order"),
    "request_id": ((), "moeray makes its own ids"),
    "cache_salt": ((), "moeray's prefix cache is per server"),
    "use_beam_search": ((False,), "moeray has no beam search"),
    "length_penalty": ((1, 1.0), "moeray has no beam search"),
}
_warned: set[str] = set()


def _foreign(name: str, value: Any) -> None:
    """A FOREIGN field: fine at a value that asks for nothing, else one warning per field per process."""
    neutral, why = FOREIGN[name]
    if _asks_nothing(value, neutral) or name in _warned:
        return
    _warned.add(name)
    log.warning("moeray: the request field %r (%s) is accepted and ignored: %s (this warning is shown once)",
                name, json.dumps(value)[:40], why)


# llama-server's names of fields moeray has under OpenAI's or vLLM's name
RENAMED = {"repeat_penalty": "repetition_penalty", "n_predict": "max_tokens"}


def _asks_nothing(value: Any, neutral: tuple) -> bool:
    return value is None or any(value == n and isinstance(value, bool) == isinstance(n, bool) for n in neutral)


def _printable(name: str) -> str:
    """A client's parameter name as an error can quote it: a lone surrogate (valid in JSON) cannot
    travel through pydantic's Rust core or UTF-8, so it is written as its escape."""
    return name.encode("utf-8", "backslashreplace").decode("utf-8")


def _shown(name: str) -> str:
    name = _printable(name)
    return name if len(name) <= 64 else name[:61] + "..."


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: Optional[StrictBool] = None


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")  # no extra field gets past _only_what_moeray_does
    unsupported: ClassVar[dict[str, tuple]] = {}
    endpoint: ClassVar[str] = ""

    model: StrictStr
    max_tokens: Optional[StrictInt] = None
    max_completion_tokens: Optional[StrictInt] = None  # the newer name of max_tokens (chat)
    temperature: Optional[Number] = Field(default=None, ge=0, le=2)
    top_p: Optional[Number] = Field(default=None, gt=0, le=1)
    seed: Optional[StrictInt] = Field(default=None, **INT64)
    stop: Optional[Union[StrictStr, list[StrictStr]]] = None
    # Sampling as vLLM takes it, in OpenAI's and vLLM's ranges (docs/sampling.md: definitions, order)
    top_k: Optional[StrictInt] = Field(default=None, ge=-1)  # -1 or 0: no cut
    min_p: Optional[Number] = Field(default=None, ge=0, le=1)
    repetition_penalty: Optional[Number] = Field(default=None, gt=0, allow_inf_nan=False)
    presence_penalty: Optional[Number] = Field(default=None, ge=-2, le=2)
    frequency_penalty: Optional[Number] = Field(default=None, ge=-2, le=2)
    # token id (a string in JSON) -> added to its logit; the ids are checked against the vocabulary
    logit_bias: Optional[dict[StrictStr, Annotated[Number, Field(ge=-100, le=100)]]] = None
    n: StrictInt = Field(default=1, ge=1, le=128)  # choices, each its own sequence (sharing the prompt's KV)
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    # Tags for OpenAI's own abuse monitoring, storage and prompt caching: by their definition they
    # do not change the response, so they are accepted and change nothing here either.
    user: Optional[StrictStr] = None
    safety_identifier: Optional[StrictStr] = None
    prompt_cache_key: Optional[StrictStr] = None
    metadata: Optional[dict[StrictStr, StrictStr]] = None
    response_format: Optional["ResponseFormat"] = None  # structured output (stages/text/grammar.py)
    # moeray's own: draft and verify tokens for this request (true / false; absent: the server's
    # --speculative). The text is the same either way: greedy exactly, sampled in distribution.
    speculative: Optional[StrictBool] = None
    # vLLM's and llama-server's: generate past the end token, until max_tokens or a stop string
    ignore_eos: Optional[StrictBool] = None

    @model_validator(mode="before")
    @classmethod
    def _only_what_moeray_does(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for old, new in RENAMED.items():
            if old in data:
                if new in data:
                    raise PydanticCustomError("invalid_value", "give '{new}' or llama-server's '{old}', not both",
                                              {"param": old, "old": old, "new": new})
                data = {new if k == old else k: v for k, v in data.items()}
                if old == "n_predict" and data[new] == -1:  # llama-server's "until the end"
                    data[new] = None
        for name, value in data.items():
            if name in cls.model_fields:
                continue
            if name in FOREIGN:
                _foreign(name, value)
                continue
            if name not in cls.unsupported:
                raise PydanticCustomError(
                    "unknown_parameter", "unknown parameter '{shown}': /v1/{endpoint} has no such parameter; "
                    "remove it", {"param": _printable(name), "shown": _shown(name), "endpoint": cls.endpoint})
            neutral = cls.unsupported[name]
            if not _asks_nothing(value, neutral):
                allowed = " or ".join(json.dumps(n) for n in neutral)
                raise PydanticCustomError(
                    "unsupported_parameter", "'{param}' is not supported by this server; leave it out"
                    + (" or send {allowed}" if neutral else ""), {"param": name, "allowed": allowed})
        if data.get("stream_options") is not None and data.get("stream") is not True:
            raise PydanticCustomError("invalid_value", "'stream_options' is only allowed when 'stream' is true",
                                      {"param": "stream_options"})
        return data

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, bias):
        for key in bias or ():
            if not (key.isascii() and key.isdigit()):
                raise PydanticCustomError(
                    "invalid_value", "logit_bias: the key {key} is not a token id; give token ids as strings, "
                    "e.g. {example}",
                    {"param": "logit_bias", "key": json.dumps(_shown(key)), "example": '{"50256": -100}'})
        return bias

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def wanted_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: StrictStr = Field(min_length=1, max_length=64)
    description: Optional[StrictStr] = None
    schema_: Union[dict, StrictBool, None] = Field(default=None, alias="schema")
    strict: Optional[StrictBool] = None


class ResponseFormat(BaseModel):
    """{"type": "text"} | {"type": "json_object"} | {"type": "json_schema", "json_schema": {...}}"""
    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: StrictStr = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: Optional[StrictStr] = None
    parameters: Optional[dict] = None  # a JSON schema of the arguments object
    strict: Optional[StrictBool] = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: FunctionSpec


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: dict  # {"name": ...}


class FunctionCallIn(BaseModel):
    """The function of an assistant's earlier call, as a client sends it back."""
    model_config = ConfigDict(extra="allow")

    name: StrictStr
    arguments: Union[StrictStr, dict, None] = None  # a JSON text (OpenAI's), or the object itself


class ToolCallIn(BaseModel):
    model_config = ConfigDict(extra="allow")

    id: Optional[StrictStr] = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Union[StrictStr, list[dict], None] = None
    name: Optional[StrictStr] = None
    tool_calls: Optional[list[ToolCallIn]] = None  # an assistant's earlier calls
    tool_call_id: Optional[StrictStr] = None  # a tool message answers this call
    reasoning_content: Optional[StrictStr] = None  # an assistant's earlier reasoning (vLLM's name)
    reasoning: Optional[StrictStr] = None  # the same, by its newer name

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, content):
        """The list-of-parts form: text parts only (the model reads text); an image or audio part is
        a 400, not dropped."""
        for part in content if isinstance(content, list) else ():
            kind = part.get("type")
            if kind != "text":
                raise PydanticCustomError("unsupported_value", "a content part of type {kind} is not supported: "
                                          "this model reads text parts only", {"kind": repr(kind)})
            if not isinstance(part.get("text"), str):
                raise PydanticCustomError("invalid_value", "a text content part needs 'text', a string", {})
        return content

    def text(self) -> str:
        """The message's text; OpenAI's list-of-parts form is the concatenation of its text parts."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p["text"] for p in self.content)


class ChatCompletionRequest(_Request):
    unsupported: ClassVar[dict[str, tuple]] = UNSUPPORTED_CHAT
    endpoint: ClassVar[str] = "chat/completions"

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: Optional[StrictBool] = None
    top_logprobs: Optional[StrictInt] = Field(default=None, ge=0, le=20)
    tools: Optional[list[Tool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: Optional[StrictBool] = None
    # Variables of the chat template (Qwen3's enable_thinking, DeepSeek-V3.1's thinking), as vLLM takes them.
    chat_template_kwargs: Optional[dict[StrictStr, Any]] = None
    reasoning_effort: Optional[Literal["none", "minimal", "low", "medium", "high"]] = None  # a template variable too
    # Thinking tokens before the reasoning is closed (-1 unlimited, 0 none; docs/chat-formats.md#reasoning-budget):
    # vLLM's name, and llama-server's two
    thinking_token_budget: Optional[StrictInt] = None
    reasoning_budget_tokens: Optional[StrictInt] = None
    thinking_budget_tokens: Optional[StrictInt] = None


class CompletionRequest(_Request):
    unsupported: ClassVar[dict[str, tuple]] = UNSUPPORTED_COMPLETIONS
    endpoint: ClassVar[str] = "completions"

    prompt: Union[StrictStr, list[StrictInt]]  # text, or token ids
    logprobs: Optional[StrictInt] = Field(default=None, ge=0, le=5)  # alternatives per token, as OpenAI


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from a cached prefix (prefill skipped)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: Optional[PromptTokensDetails] = None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


# ---------------------------------------------------------------- chat responses


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class TokenLogprobEntry(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: Optional[list[TokenLogprobEntry]] = None
    refusal: Optional[list[TokenLogprobEntry]] = None


class ToolCallFunction(BaseModel):
    name: Optional[str] = None
    arguments: Optional[str] = None


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction




class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: Optional[str]
    reasoning_content: Optional[str] = None  # the thinking, apart from the answer (as vLLM and llama-server)
    tool_calls: Optional[list[ToolCallOut]] = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ResponseMessage
    finish_reason: Optional[str]
    logprobs: Optional[ChatLogprobs] = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    # {"index", "id", "type", "function": {"name", "arguments"}} as OpenAI streams a call: the id, type and
    # name in its first piece only, then argument fragments (plain dicts: absent keys stay absent).
    tool_calls: Optional[list[dict]] = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: Optional[str] = None
    logprobs: Optional[ChatLogprobs] = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Optional[Usage] = None


# ---------------------------------------------------------------- text completion responses


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[Optional[float]] = []
    top_logprobs: list[Optional[dict[str, float]]] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: Optional[str]
    logprobs: Optional[CompletionLogprobs] = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None


# ---------------------------------------------------------------- models, errors


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "moeray"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    error: ErrorBody


_Request.model_rebuild()
ChatCompletionRequest.model_rebuild()
CompletionRequest.model_rebuild()
