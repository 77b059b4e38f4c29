"""Forced tool calls on a model that was never trained for the format: the default model's weights
(SmolLM2, upcycled) under every family's published template (llama.cpp's models/templates), and
under templates without a tool format (its own, Gemma's: the generic JSON one), run greedy
through the engine with the grammar of the family's call and, where the template thinks, a
reasoning budget. Each reply reads back as one structured call of the function asked for, its
arguments valid against the schema and holding no other keys, nothing of the format left in
`content`; a reply cut by max_tokens inside its call gives no call and no markup. The same through
`moeray serve --local` with a thinking template (--chat-template) and the budget set per request."""
from __future__ import annotations

import dataclasses
import json

import jsonschema
import pytest

from llama_templates import FAMILIES as TEMPLATE_FILES
from llama_templates import template

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 24}}, "required": ["zone"]}}}
MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the weather in Paris?"}]
BUDGET = 6  # thinking tokens before the block is closed for the model
MAX_TOKENS = 120
# Variables that open each thinking template's reasoning (the others decide by themselves).
VARIABLES = {"deepseek-v3.1": {"thinking": True}, "gpt-oss": {"reasoning_effort": "low"}}
# Every family's template, and two without a tool format; which tool_choice each is asked with.
TEMPLATES = [*TEMPLATE_FILES, "own", "gemma-2"]
NAMED = {"qwen2.5", "qwen3-coder", "deepseek-r1", "kimi-k2", "own"}  # the others: "required"
# Text that would show the format leaked into content.
MARKUP = ("<tool_call", "</tool_call", "<function=", "<parameter", "<arg_key", "<arg_value", "tool▁", "<|tool_call",
          "<|channel|>", "<|message|>", "functions.", '"tool_calls"', "<think>", "</think>", "get_weather")


@pytest.fixture(scope="module")
def engine(default_model_path):
    """One engine over the default model for every template (the vocabulary is the same: only the
    prompt and the grammar change with the template)."""
    from moeray.cluster.config import EngineConfig
    from moeray.cluster.engine import Engine
    from moeray.cluster.local_pipeline import LocalPipeline
    from moeray.stages.text.tokenizer import Tokenizer

    from moeray.stages.kernels import threads

    # Graphs keep one thread count: one that learns from its own timings whether one thread or all
    # compute it (ThreadSettings.adapt) splits a lone query's keys differently under another load, and
    # this untrained model's near-tie logits then turn a greedy reply another way from run to run.
    before = (threads.ggml_threads(), threads.thread_settings())
    threads.set_threads(before[0], dataclasses.replace(before[1], adapt=False))
    blocks = len(TEMPLATES) * 72  # 1152 tokens a sequence: the longest prompt (gpt-oss's) and its reply
    pipe = LocalPipeline.from_file(str(default_model_path), blocks, 4 << 30, max_seqs=len(TEMPLATES))
    config = EngineConfig(max_seqs=len(TEMPLATES), max_len=2048, kv_blocks=blocks, micro_batches=1)
    tok = Tokenizer.from_gguf(default_model_path)
    yield Engine(pipe, config, tok), tok
    threads.set_threads(*before)


def turn_and_params(tok, name: str, max_tokens: int = MAX_TOKENS):
    """The request as the server builds it (cluster/request_extras.py force_call): the prompt in the
    template's family's format, the grammar of the call tool_choice forces, the reasoning budget."""
    from moeray.stages.text.chat import chat_format
    from moeray.stages.text.sampling import SamplingParams

    tpl = tok.chat_template if name == "own" else template(name)
    fmt = chat_format(tpl)
    tok = dataclasses.replace(tok, chat_template=tpl).with_rendered(fmt.markers())
    turn = fmt.render(tok, MESSAGES, [WEATHER, TIME], VARIABLES.get(name, {}), budget=BUDGET)
    named = name in NAMED
    grammar = turn.forced_grammar(tok, "get_weather" if named else None, parallel=not named)
    budget = turn.reasoning_budget(tok, BUDGET)
    return tok, turn, SamplingParams(max_tokens=max_tokens, grammar=grammar, reasoning=budget)


@pytest.fixture(scope="module")
def replies(engine):
    """Every template's forced call, all in one batch: (tokenizer, turn, request) by template."""
    eng, tok = engine
    out = {}
    for name in TEMPLATES:
        t, turn, params = turn_and_params(tok, name)
        out[name] = (t, turn, eng.add(t.encode(turn.prompt), params))
    eng.run([r for _, _, r in out.values()], timeout_s=3000)
    return out


@pytest.mark.parametrize("name", TEMPLATES)
def test_a_forced_call_comes_back_structured_and_confined_on_a_model_never_trained_for_it(name, replies):
    tok, turn, req = replies[name]
    text = tok.decode(req.output)
    # One call: the grammar completes, only the end token is left. One or more (required): the model
    # may go on calling until max_tokens, and the call that cuts is dropped.
    assert req.finish_reason == "stop" or name not in NAMED, (name, text)
    reply = turn.parse(text, cut=req.finish_reason == "length")
    assert len(reply.tool_calls) == 1 if name in NAMED else reply.tool_calls, (name, text)  # required: one or more
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for call in reply.tool_calls:
        assert call.name in ({"get_weather"} if name in NAMED else set(schema)), (name, text)
        args = json.loads(call.arguments)
        jsonschema.validate(args, schema[call.name])
        assert set(args) <= set(schema[call.name]["properties"]), (name, args)  # nothing the schema never named
    assert reply.content == "" and not any(m in reply.content for m in MARKUP), (name, text)
    if turn.thinking == "open":  # the prompt left it thinking: the budget closed the block, the call came
        assert turn.format.think[1] in text and reply.reasoning, (name, text)
    if turn.reasoning_budget(tok, BUDGET) is not None and reply.reasoning:
        thought = tok.encode(reply.reasoning, add_bos=False)
        assert len(thought) <= BUDGET + 2, (name, reply.reasoning)  # (re-encoding may split a token or two)
    if name in ("own", "gemma-2"):
        assert turn.format.name == "generic"


def test_the_thinking_templates_think_within_the_budget_before_the_call(replies):
    opened = [n for n, (_, turn, _) in replies.items() if turn.thinking == "open"]
    assert {"qwen3.5", "deepseek-v3.1"} <= set(opened)  # the thinking templates this test must cover


def last_cut(tok, turn, output: list[int]) -> int:
    """The most tokens of `output` that still leave its call unfinished (cut there, it is dropped)."""
    k = len(output)
    while k > 0 and turn.parse(tok.decode(output[:k]), cut=True).tool_calls:
        k -= 1
    return k


@pytest.fixture(scope="module")
def cut_replies(engine, replies):
    """Every template's request again, max_tokens ending it inside its call as late as that can be."""
    eng, tok0 = engine
    out = {}
    for name, (tok, turn, whole) in replies.items():
        n = last_cut(tok, turn, whole.output)
        tok, turn, params = turn_and_params(tok0, name, max_tokens=n)
        out[name] = (eng.add(tok.encode(turn.prompt), params), n)
    eng.run([r for r, _ in out.values()], timeout_s=3000)
    return out


@pytest.mark.parametrize("name", TEMPLATES)
def test_a_forced_call_cut_by_max_tokens_leaves_no_call_and_no_markup(name, replies, cut_replies):
    """The same request with max_tokens ending it one token before its call is whole: no call,
    nothing of it as content, the reasoning as far as it went. Greedy, the run repeats the whole
    reply's tokens, unless a near tie falls the other way (the second run reads its prompt from the
    prefix cache, in another batch): its own tokens are read then, still cut inside the call."""
    tok, turn, whole = replies[name]
    req, n = cut_replies[name]
    assert 0 < n < len(whole.output) and req.finish_reason == "length" and len(req.output) == n
    assert turn.parse(tok.decode(whole.output[:n + 1]), cut=True).tool_calls  # one token more: the call stands
    text = tok.decode(req.output)
    uncut = turn.parse(text)
    assert uncut.tool_calls or uncut.content, (name, text)  # it did end inside the call (read whole, it shows)
    reply = turn.parse(text, cut=True)
    assert reply.tool_calls == [] and reply.content == "", (name, text)
    assert reply.reasoning == uncut.reasoning
    if req.output == whole.output[:n]:
        assert reply.reasoning == turn.parse(tok.decode(whole.output)).reasoning


# ---------------------------------------------------------------- the same through `moeray serve --local`


def serve(default_model_path, *flags: str):
    """`moeray serve MODEL --local FLAGS` and an `openai` client of it (one at a time: each test that
    needs one starts its own, and it stops when the test ends)."""
    openai = pytest.importorskip("openai")
    from serve_process import start_serve

    from moeray.stages.runtime.transport import free_port

    server = start_serve([str(default_model_path), "--local", "--no-metrics", "--max-seqs", "2", "--max-len", "2048",
                          "--model-name", "m", "--ready-timeout", "600", *flags], free_port())
    return server, openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=600)


@pytest.fixture
def thinking_server(default_model_path, tmp_path):
    """The default model served with Qwen3.5's template (its prompt opens <think>) and a server
    default budget."""
    path = tmp_path / "Qwen3.5-4B.jinja"
    path.write_text(template("qwen3.5"))
    server, client = serve(default_model_path, "--chat-template", str(path), "--reasoning-budget", "12")
    try:
        yield client
    finally:
        server.stop()


@pytest.fixture
def generic_server(default_model_path):
    """The default model with its own template, which has no tool format: the generic one."""
    server, client = serve(default_model_path)
    try:
        yield client
    finally:
        server.stop()


def test_served_with_its_own_template_the_default_model_calls_tools_in_the_generic_json(generic_server):
    client = generic_server
    kw = dict(model="m", messages=MESSAGES, tools=[WEATHER, TIME], max_tokens=MAX_TOKENS, temperature=0)
    r = client.chat.completions.create(**kw, tool_choice="required")
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    call = choice.message.tool_calls[0]
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]["parameters"])
    # Streamed: the same calls, ids and names first, nothing of the JSON around them as content.
    chunks = list(client.chat.completions.create(**kw, tool_choice="required", stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == ""
    pieces = [t for d in deltas for t in (d.tool_calls or [])]
    assert pieces[0].function.name == call.function.name and pieces[0].id
    assert "".join(t.function.arguments or "" for t in pieces if t.index == 0) == call.function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    # auto: the reply is the JSON too, a call or an answer; an answer is content, decoded.
    r = client.chat.completions.create(**kw)
    message = r.choices[0].message
    assert message.tool_calls or (message.content and not message.content.lstrip().startswith("{"))
    # The call and its result go back: the template gets them as JSON turns, and the model answers.
    follow = MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                         {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny"}'}]
    r = client.chat.completions.create(**{**kw, "messages": follow, "max_tokens": 8}, tool_choice="none")
    assert r.choices[0].message.content and r.choices[0].message.tool_calls is None
    # Cut by max_tokens one token before its first call is whole: length, no call, no JSON as content.
    from moeray.stages.text.chat.generic import GenericReader

    n = cut_inside_first_call(client, kw, lambda: GenericReader([WEATHER, TIME]))
    cut = client.chat.completions.create(**{**kw, "max_tokens": n}, tool_choice="required")
    assert cut.choices[0].finish_reason == "length" and cut.choices[0].message.tool_calls is None
    assert not cut.choices[0].message.content


def cut_inside_first_call(client, kw: dict, reader) -> int:
    """The most tokens of the forced reply (its tokens from logprobs) that leave its first call unfinished."""
    r = client.chat.completions.create(**{**kw, "tool_choice": "required"}, logprobs=True)
    tokens = [e.token for e in r.choices[0].logprobs.content]
    for k in range(len(tokens), 0, -1):
        read = reader()
        read.feed("".join(tokens[:k]))
        read.close(cut=True)
        if not read.message.tool_calls:
            return k
    raise AssertionError("the reply has no call")


def test_served_with_a_thinking_template_the_budget_closes_the_thinking_and_the_call_comes(thinking_server):
    client = thinking_server
    kw = dict(model="m", messages=MESSAGES, tools=[WEATHER], max_tokens=MAX_TOKENS, temperature=0,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    for extra in ({}, {"extra_body": {"thinking_token_budget": 4}}, {"extra_body": {"chat_template_kwargs": {"thinking_budget": 4}}}):
        r = client.chat.completions.create(**kw, **extra)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
        assert choice.message.reasoning_content  # it thought, within its budget, then called
        if extra:
            assert r.usage.completion_tokens < first.usage.completion_tokens  # 4 thinking tokens, not 12
        else:
            first = r
    # No thinking at all: the template's switch (enable_thinking false) closes the block in the prompt.
    r = client.chat.completions.create(**kw, reasoning_effort="none")
    assert r.choices[0].message.reasoning_content is None and r.choices[0].message.tool_calls
    # Streamed: the call, and nothing of the format as content (its arguments valid, not compared with
    # the first run's: read from the prefix cache, a near tie of this untrained model may fall otherwise).
    chunks = list(client.chat.completions.create(**kw, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == ""
    pieces = [t for d in deltas for t in (d.tool_calls or [])]
    assert pieces[0].function.name == "get_weather"
    args = "".join(t.function.arguments or "" for t in pieces)
    jsonschema.validate(json.loads(args), WEATHER["function"]["parameters"])
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    # Cut by max_tokens one token before the call is whole: finish_reason length, no call, no markup.
    from moeray.stages.text.chat import Turn
    from moeray.stages.text.chat.qwen3_xml import Qwen3Xml

    n = cut_inside_first_call(client, kw, lambda: Turn(Qwen3Xml(template("qwen3.5")), "", [WEATHER], "open").reader())
    cut = client.chat.completions.create(**{**kw, "max_tokens": n})
    assert cut.choices[0].finish_reason == "length" and cut.choices[0].message.tool_calls is None
    assert not cut.choices[0].message.content and cut.choices[0].message.reasoning_content
    with pytest.raises(Exception) as exc:
        client.chat.completions.create(**kw, extra_body={"thinking_token_budget": -5})
    assert "thinking_token_budget" in str(exc.value)
