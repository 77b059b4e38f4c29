"""A request's sampling fields as the SamplingParams the last stage samples with, and the n choices'.

The ranges are checked twice: by the schema (cluster/openai_schema.py, OpenAI's and vLLM's ranges,
a 400 naming the field) and by SamplingParams itself (the CLI and the engine take no other way in);
what only the model knows (logit_bias's token ids against its vocabulary) is checked here.
"""
from __future__ import annotations

import dataclasses

from moeray.cluster import openai_schema as oa
from moeray.stages.text.sampling import BadSamplingParam, SamplingParams


def sampling_params(body: oa._Request, max_tokens: int, vocab_size: int, error) -> SamplingParams:
    """`error(message, param)` builds the 400 to raise."""
    bias = {int(token): float(value) for token, value in (body.logit_bias or {}).items()}
    outside = sorted(t for t in bias if t >= vocab_size)
    if outside:
        raise error(f"logit_bias: token id {outside[0]} is not in this model's vocabulary "
                    f"(ids 0 to {vocab_size - 1})", "logit_bias")

    def given(value, default):
        return default if value is None else value

    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=float(given(body.temperature, 0.0)), top_p=float(given(body.top_p, 1.0)),
            top_k=given(body.top_k, 0), min_p=float(given(body.min_p, 0.0)),
            repetition_penalty=float(given(body.repetition_penalty, 1.0)),
            presence_penalty=float(given(body.presence_penalty, 0.0)),
            frequency_penalty=float(given(body.frequency_penalty, 0.0)),
            logit_bias=bias, seed=body.seed, stop=body.stop_strings(), speculative=body.speculative,
            ignore_eos=bool(body.ignore_eos))
    except BadSamplingParam as exc:
        raise error(str(exc), exc.param) from None


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice `index` of n: its own seed stream (seed + index, as vLLM seeds its n children), so a
    seeded request repeats all its choices and they differ from each other; greedy choices are alike."""
    if index == 0 or params.seed is None:
        return params
    return dataclasses.replace(params, seed=params.seed + index)
