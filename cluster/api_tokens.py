"""POST /tokenize and POST /detokenize in vLLM's shapes: a prompt's tokens, or a conversation's as the
chat route renders it (the model's chat format calling its template, tools included), and the text of
token ids. `max_model_len` is the context one request may use.
"""
from __future__ import annotations

import asyncio
from typing import Any, Literal, Optional

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from moeray.cluster import chat_edge as edge


class TokenizeRequest(BaseModel):
    """{"prompt": ...} or {"messages": [...]} (vLLM's two forms)."""
    model_config = ConfigDict(extra="forbid")

    model: Optional[StrictStr] = None
    prompt: Optional[StrictStr] = None
    messages: Optional[list[dict]] = Field(default=None, min_length=1)
    tools: Optional[list[dict]] = None
    chat_template_kwargs: Optional[dict[StrictStr, Any]] = None
    # the BOS token (when the model adds one) in front; default: yes for a prompt, and for messages
    # what the chat route feeds the model (the template writes its own specials)
    add_special_tokens: Optional[StrictBool] = None
    add_generation_prompt: Literal[True] = True  # the chat route always asks for the assistant's turn
    continue_final_message: Literal[False] = False
    return_token_strs: Optional[StrictBool] = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Optional[StrictStr] = None
    tokens: list[StrictInt]


def _check_model(service, model: Optional[str]) -> None:
    if model is not None and not service.serves(model):
        raise edge.APIError(404, f"the model '{model}' does not exist; this server serves "
                           f"{', '.join(service.model_names)}", param="model", code="model_not_found")


def _tokens(service, body: TokenizeRequest) -> list[int]:
    if (body.prompt is None) == (body.messages is None):
        raise edge.bad_request("give either 'prompt' (a text) or 'messages' (a conversation)", "prompt")
    tokenizer = service.tokenizer
    if body.prompt is not None:
        edge.refuse_untokenized(service, body.prompt, "prompt")
        return tokenizer.encode(body.prompt, add_bos=True if body.add_special_tokens is None else body.add_special_tokens)
    chat = edge.chat_request({k: v for k, v in {"model": service.model_name, "messages": body.messages,
                                                "tools": body.tools,
                                                "chat_template_kwargs": body.chat_template_kwargs}.items()
                              if v is not None})
    ids, text = edge.prompt_tokens(service, chat, edge.Thinking())
    # unset: the tokens the chat route feeds the model; false: the template's text alone (vLLM's default)
    return ids if body.add_special_tokens is None else tokenizer.encode(text, add_bos=body.add_special_tokens)


async def tokenize(body: TokenizeRequest, request: Request):
    service = request.app.state.service
    _check_model(service, body.model)
    ids = await asyncio.to_thread(_tokens, service, body)
    return {"count": len(ids), "max_model_len": service.context, "tokens": ids,
            "token_strs": [service.tokenizer.token_text(i) for i in ids] if body.return_token_strs else None}


async def detokenize(body: DetokenizeRequest, request: Request):
    service = request.app.state.service
    _check_model(service, body.model)
    vocab = service.tokenizer.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise edge.bad_request(f"token ids must be in [0, {vocab}); got {bad[0]}", "tokens")
    return {"prompt": service.tokenizer.decode(body.tokens)}


def add_routes(app_, service) -> None:
    app_.post("/tokenize")(tokenize)
    app_.post("/detokenize")(detokenize)

