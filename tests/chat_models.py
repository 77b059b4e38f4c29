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
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Lima", "Tokyo"]}},
                   "required": ["city"], "additionalProperties": False}}}
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
    Family("qwen3.5", "qwen3.5", "qwen3_xml", "qwen35moe", CHATML, QWEN_TEXT,
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


# ---------------------------------------------------------------- a tiny model that learned the tool loop

MAX_POS = 2048
VOCAB = 768


def tool_loop(family: Family, call_id: str = "call_0") -> tuple[list[dict], list[dict]]:
    """The two requests of the tool loop, as an OpenAI client sends them (its second one carries the
    reply it got: the reasoning, the call, and the tool's result)."""
    first = [{"role": "user", "content": QUESTION}]
    if family.format == "kimi_k2":
        call_id = "functions.get_weather:0"  # the id a Kimi model writes (the template counts calls)
    second = first + [
        {"role": "assistant", "content": "", "reasoning_content": THOUGHT_1, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": CITY}}]},
        {"role": "tool", "tool_call_id": call_id, "content": RESULT}]
    return first, second


def _builder(arch: str):
    import tiny_models

    if arch == "deepseek3":
        return tiny_models.tiny_deepseek3
    if arch == "gpt_oss":
        return tiny_models.tiny_gpt_oss
    if arch == "glm4moe":
        return tiny_models.tiny_glm4moe
    if arch == "qwen35moe":
        from tiny_hybrid import tiny_qwen35moe

        return tiny_qwen35moe
    return tiny_models.BUILDERS[arch]


def model_path(family: Family) -> Path:
    """Where write_family_model's file is kept, once per machine (in the cache beside the default model):
    the key is everything it depends on (the recipe, the family, its template, the GGUF writer and
    tokenizer, the library versions)."""
    import hashlib
    import inspect
    import os

    import torch
    import transformers

    from llama_templates import template
    from moeray.stages.gguf import writer
    from moeray.stages.text import tokenizer

    parts = [inspect.getsource(write_family_model), inspect.getsource(fast_tokenizer), repr(family), repr(WEATHER),
             template(family.template), inspect.getsource(writer), inspect.getsource(tokenizer), VOCAB, MAX_POS,
             torch.__version__, transformers.__version__]
    key = hashlib.sha256("\n".join(map(str, parts)).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("MOERAY_CACHE_DIR") or Path.home() / ".cache" / "moeray") / "chat-models"
    return cache / f"{family.name}-{key}.gguf"


def family_model(family: Family) -> Path:
    """write_family_model's file, made once per machine (model_path)."""
    import os

    path = model_path(family)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        write_family_model(family, tmp)
        tmp.rename(path)
    return path


def write_family_model(family: Family, path: Path, steps: int = 400, seed: int = 0) -> Path:
    """A tiny model of the family's architecture carrying its template, taught the tool loop: asked
    QUESTION with WEATHER it writes `reply_call`; given the result it writes `reply_answer`."""
    import torch
    import torch.nn.functional as F

    from llama_templates import template
    from moeray.stages.gguf.writer import write_gguf
    from moeray.stages.text.chat import chat_format
    from moeray.stages.text.tokenizer import Tokenizer

    tpl = template(family.template)
    fmt = chat_format(tpl)
    assert fmt.name == family.format, (family.name, fmt.name)
    first, second = tool_loop(family)

    def prompts(tok):
        return [fmt.render(tok, msgs, [WEATHER], family.variables).prompt for msgs in (first, second)]

    # The vocabulary learns the texts it will see, so that a prompt is a few hundred tokens.
    draft = moeray_tokenizer(fast_tokenizer(family, tpl, [QUESTION], 300))
    corpus = prompts(draft) + [family.reply_call, family.reply_answer]
    fast = fast_tokenizer(family, tpl, corpus * 4, VOCAB)

    torch.manual_seed(seed)
    model = _builder(family.arch)(seed)
    model.resize_token_embeddings(VOCAB)
    model.config.max_position_embeddings = MAX_POS
    write_gguf(model, path, "F32", tokenizer=fast, name=f"tiny-{family.name}", token_roles=family.roles)
    tok = Tokenizer.from_gguf(path)  # the ids the server will see
    rows = []
    for prompt, reply in zip(prompts(tok), (family.reply_call, family.reply_answer)):
        p, r = tok.encode(prompt), tok.encode(reply, add_bos=False)
        rows.append((torch.tensor(p + r), len(p)))

    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for step in range(steps):
        opt.zero_grad()
        loss, worst = 0.0, float("inf")
        for ids, n in rows:
            logits = model(ids[None]).logits[0, n - 1:-1]
            target = ids[n:]
            loss = loss + F.cross_entropy(logits, target)
            top2 = logits.topk(2, dim=-1)
            margin = torch.where(top2.indices[:, 0] == target, top2.values[:, 0] - top2.values[:, 1],
                                 logits.gather(1, target[:, None])[:, 0] - top2.values[:, 0])
            worst = min(worst, margin.min().item())
        if worst > 2.0:  # every reply token the argmax, by a clear margin: greedy writes the reply
            break
        loss.backward()
        opt.step()
    else:
        raise AssertionError(f"{family.name}: the tiny model did not learn its replies in {steps} steps (margin {worst:.2f})")
    model.eval()
    write_gguf(model, path, "F32", tokenizer=fast, name=f"tiny-{family.name}", token_roles=family.roles)
    return path
