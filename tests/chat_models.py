"""Tiny models of each family that speak their family's chat format.

Each family: its published template (tests/llama_templates.py), its special tokens (control ones
as in the real vocabulary, the others added as text, as llama.cpp's converter types them), its end
tokens, and a tiny random model of its architecture (tests/tiny_models.py). `write_family_model`
then teaches the model one tool loop written in the family's own format (a few hundred Adam steps on
two turns: a question answered by reasoning and a call, and the call's result answered by reasoning
and text), so that `moeray serve` on it gives what the real model gives: reasoning, calls, answers.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city"}},
                   "required": ["city"]}}}
QUESTION = "What is the weather in Paris?"
RESULT = '{"temperature": 18, "sky": "sunny"}'
ANSWER = "It is sunny in Paris, 18 °C."
THOUGHT_1 = "The user wants the weather in Paris."
THOUGHT_2 = "The tool says sunny."


@dataclass
class Family:
    name: str  # the test's name of the family
    template: str  # key in llama_templates.FAMILIES
    format: str  # the chat format moeray should choose
    arch: str  # tiny_models builder
    control: list[str]  # special tokens (never text)
    text_tokens: list[str] = field(default_factory=list)  # added tokens that are text (<think>, <tool_call>)
    bos: str | None = None
    eos: str = "<|im_end|>"
    roles: dict[str, str] = field(default_factory=dict)  # more end tokens: {"eot": ..., "eom": ...}
    variables: dict = field(default_factory=dict)  # chat_template_kwargs the tool loop is run with
    reply_call: str = ""  # what the model writes for the question (reasoning and a call), its end token included
    reply_answer: str = ""  # what it writes once it has the result


CHATML = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN_TEXT = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
DEEPSEEK = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
            "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
            "<｜tool▁sep｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"]
KIMI = ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>",
        "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
        "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<think>", "</think>"]
GLM = ["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]
GLM_TEXT = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
            "</arg_value>", "<tool_response>", "</tool_response>"]
HARMONY = ["<|endoftext|>", "<|start|>", "<|message|>", "<|end|>", "<|channel|>", "<|return|>", "<|call|>",
           "<|constrain|>"]
CITY = json.dumps({"city": "Paris"})

FAMILIES = {f.name: f for f in [
    Family("qwen3", "qwen3", "hermes", "qwen3moe", CHATML, QWEN_TEXT,
           reply_call=f'<think>\n{THOUGHT_1}\n</think>\n\n<tool_call>\n{{"name": "get_weather", "arguments": {CITY}}}\n'
                      "</tool_call><|im_end|>",
           reply_answer=f"<think>\n{THOUGHT_2}\n</think>\n\n{ANSWER}<|im_end|>"),
    Family("qwen3.5", "qwen3.5", "qwen3_xml", "qwen3moe", CHATML, QWEN_TEXT,
           reply_call=f"{THOUGHT_1}\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
                      "</parameter>\n</function>\n</tool_call><|im_end|>",
           reply_answer=f"{THOUGHT_2}\n</think>\n\n{ANSWER}<|im_end|>"),
    Family("deepseek-v3.1", "deepseek-v3.1", "deepseek", "deepseek3", DEEPSEEK, ["<think>", "</think>"],
           bos="<｜begin▁of▁sentence｜>", eos="<｜end▁of▁sentence｜>", variables={"thinking": True},
           reply_call=f"{THOUGHT_1}</think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{CITY}"
                      "<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>",
           reply_answer=f"{ANSWER}<｜end▁of▁sentence｜>"),
    Family("glm-4.6", "glm-4.6", "glm", "glm4moe", GLM, GLM_TEXT, eos="<|endoftext|>",
           roles={"eot": "<|user|>", "eom": "<|observation|>"},
           reply_call=f"\n<think>{THOUGHT_1}</think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
                      "<arg_value>Paris</arg_value>\n</tool_call><|observation|>",
           reply_answer=f"\n<think>{THOUGHT_2}</think>\n{ANSWER}<|user|>"),
    Family("kimi-k2-thinking", "kimi-k2-thinking", "kimi_k2", "deepseek3", KIMI, bos="[BOS]",
           reply_call=f"<think>{THOUGHT_1}</think><|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
                      f"<|tool_call_argument_begin|>{CITY}<|tool_call_end|><|tool_calls_section_end|><|im_end|>",
           reply_answer=f"<think>{THOUGHT_2}</think>{ANSWER}<|im_end|>"),
    Family("gpt-oss", "gpt-oss", "harmony", "gpt_oss", HARMONY, eos="<|return|>", variables={"reasoning_effort": "low"},
           reply_call=f"<|channel|>analysis<|message|>{THOUGHT_1}<|end|><|start|>assistant<|channel|>commentary "
                      f"to=functions.get_weather <|constrain|>json<|message|>{CITY}<|call|>",
           reply_answer=f"<|channel|>analysis<|message|>{THOUGHT_2}<|end|><|start|>assistant<|channel|>final"
                        f"<|message|>{ANSWER}<|return|>"),
]}


def fast_tokenizer(family: Family, template: str, corpus: list[str], vocab_size: int):
    """A byte-level BPE trained on `corpus` with the family's special and text tokens, carrying its template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(family.text_tokens), special_tokens=family.control,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in family.text_tokens])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=family.eos, bos_token=family.bos)
    fast.chat_template = template
    return fast


def moeray_tokenizer(fast):
    """moeray's Tokenizer over the same backend (what Tokenizer.from_gguf gives for the written file)."""
    from moeray.stages.text.tokenizer import Tokenizer

    added = fast.backend_tokenizer.get_added_tokens_decoder()
    control = frozenset(i for i, t in added.items() if t.special)
    return Tokenizer(backend=fast.backend_tokenizer, bos_id=fast.bos_token_id, eos_id=fast.eos_token_id,
                     add_bos=False, chat_template=fast.chat_template,
                     end_ids=frozenset({fast.eos_token_id}), special_ids=control)
