"""The tool loop end to end, per family: the `openai` client against `moeray serve --local` on a
tiny model of the family that learned one tool loop in its own chat format (tests/chat_models.py),
carrying the family's published template. The call comes back as `tool_calls`, the reasoning as
`reasoning_content`, whole and streamed; the tool's result goes back and the answer comes; and
`tool_choice: "required"` makes the model call where it would have answered, in its family's format.
Parsers, templates and grammars on their own: tests/stages/test_chat_formats.py."""
from __future__ import annotations

import json

import pytest

from chat_models import ANSWER, FAMILIES, QUESTION, RESULT, THOUGHT_1, THOUGHT_2, WEATHER, family_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=list(FAMILIES))
def served(request):
    """(family, openai client, model name) of `moeray serve FAMILY.gguf --local`."""
    openai = pytest.importorskip("openai")
    from serve_process import start_serve

    from moeray.stages.runtime.transport import free_port

    family = FAMILIES[request.param]
    path = family_model(family)
    server = start_serve([str(path), "--local", "--no-metrics", "--max-seqs", "2", "--max-len", "1024",
                          "--model-name", family.name, "--ready-timeout", "240"], free_port())
    try:
        yield family, openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    finally:
        server.stop()


def ask(family, client, messages, **kw):
    """A request as the family's tool loop was learned: gpt-oss with a reasoning_effort, DeepSeek-V3.1
    with its template's thinking on (chat_template_kwargs)."""
    variables = dict(family.variables)
    if "reasoning_effort" in variables:
        kw["reasoning_effort"] = variables.pop("reasoning_effort")
    if variables:
        kw["extra_body"] = {"chat_template_kwargs": variables}
    return client.chat.completions.create(model=family.name, messages=messages, tools=[WEATHER], max_tokens=120, **kw)


def test_the_tool_loop(served):
    family, client = served
    messages = [{"role": "user", "content": QUESTION}]
    r = ask(family, client, messages)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None and choice.message.reasoning_content == THOUGHT_1
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert call.id == ("functions.get_weather:0" if family.format == "kimi_k2" else call.id) and call.id

    # Streamed: the same message, the reasoning in its own deltas, the call's id and name first.
    chunks = list(ask(family, client, messages, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == THOUGHT_1
    assert "".join(d.content or "" for d in deltas) == ""
    pieces = [t for d in deltas for t in (d.tool_calls or [])]
    assert pieces[0].id and pieces[0].function.name == "get_weather" and pieces[0].function.arguments == ""
    assert all(p.index == 0 and p.id is None and p.function.name is None for p in pieces[1:])
    assert "".join(p.function.arguments for p in pieces) == call.function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]

    # The client runs the tool and sends the reply it got, with the result: the model answers.
    messages += [{"role": "assistant", "content": choice.message.content,
                  "reasoning_content": choice.message.reasoning_content,
                  "tool_calls": [call.model_dump()]},
                 {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    r = ask(family, client, messages)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == ANSWER
    assert r.choices[0].message.tool_calls is None
    # DeepSeek-V3.1's template opens no reasoning after a tool's result; the others reason again.
    assert r.choices[0].message.reasoning_content == (None if family.format == "deepseek" else THOUGHT_2)


def test_required_tool_choice_makes_the_model_call_in_its_own_format(served):
    """Where the model answers (it has the result), `required` makes it call: the grammar of its
    family's format lets it reason first (as it learned to), then allows only a call."""
    family, client = served
    from chat_models import tool_loop

    _, messages = tool_loop(family)
    r = ask(family, client, messages, tool_choice="required", parallel_tool_calls=False)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Lima", "Tokyo")
    assert choice.message.reasoning_content == (None if family.format == "deepseek" else THOUGHT_2)


def test_a_call_cut_short_comes_back_as_its_text(served):
    """A stop string inside the call's arguments ends the reply there: the half call is no call, its
    text is the content, finish_reason stays "stop" (nothing dropped, no error)."""
    family, client = served
    stops = ['Paris"', "Paris\n</parameter>", "Paris</arg_value>"]  # the argument, in each format (not the reasoning's)
    r = ask(family, client, [{"role": "user", "content": QUESTION}], stop=stops)
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    assert choice.message.reasoning_content == THOUGHT_1
    reply = family.reply_call
    after = reply.index("<|end|>" if family.format == "harmony" else "</think>")
    cut = min(i for s in stops if (i := reply.find(s)) >= 0)
    assert choice.message.content == reply[reply.index(">", after) + 1:cut].strip()


def test_template_inputs_out_of_range_are_400s_naming_them(served):
    import openai

    family, client = served
    msgs = [{"role": "user", "content": QUESTION}]
    for kw, param in ((dict(extra_body={"chat_template_kwargs": {"add_generation_prompt": False}}), "chat_template_kwargs"),
                      (dict(extra_body={"chat_template_kwargs": ["enable_thinking"]}), "chat_template_kwargs"),
                      (dict(reasoning_effort="extreme"), "reasoning_effort")):
        with pytest.raises(openai.BadRequestError) as exc:
            client.chat.completions.create(model=family.name, messages=msgs, max_tokens=4, **kw)
        assert exc.value.body["param"] == param, exc.value.body
    if family.format == "harmony":  # gpt-oss knows low, medium and high
        with pytest.raises(openai.BadRequestError) as exc:
            client.chat.completions.create(model=family.name, messages=msgs, max_tokens=4, reasoning_effort="minimal")
        assert exc.value.body["param"] == "reasoning_effort" and "low, medium, high" in exc.value.body["message"]


def test_chat_format_flag_overrides_the_files_family():
    """`--chat-format plain` on a model whose template writes Hermes calls: the server reads no calls,
    so a request with tools is a 400 naming `tools` and the format (auto serves the same file's calls
    in test_the_tool_loop)."""
    openai = pytest.importorskip("openai")
    from serve_process import start_serve

    from moeray.stages.runtime.transport import free_port

    family = FAMILIES["qwen3"]
    server = start_serve([str(family_model(family)), "--local", "--no-metrics", "--max-seqs", "2", "--max-len", "1024",
                          "--model-name", family.name, "--chat-format", "plain", "--ready-timeout", "240"], free_port())
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        with pytest.raises(openai.BadRequestError) as exc:
            ask(family, client, [{"role": "user", "content": QUESTION}])
        assert exc.value.body["param"] == "tools" and "`plain` chat format" in exc.value.body["message"], exc.value.body
    finally:
        server.stop()
