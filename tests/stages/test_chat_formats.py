"""Chat formats (stages/text/chat/): every family's published template called as transformers'
apply_chat_template is, its replies read into OpenAI's message whole and streamed (every split of
every marker), malformed calls kept as content, a call cut by max_tokens dropped without a trace,
the generic JSON format of templates without one, and the grammar that forces a call in the
family's own format, its arguments confined to the schema. The served tool loop on tiny models of
each family: tests/e2e/test_chat_serve.py; forced calls through the engine on the default model
under every template: tests/e2e/test_forced_calls.py."""
from __future__ import annotations

import contextlib
import json

import pytest

from chat_models import FAMILIES, fast_tokenizer, moeray_tokenizer
from llama_templates import FAMILIES as TEMPLATE_FILES
from llama_templates import OTHERS, template
from moeray.stages.text.chat import FORMATS, Turn, chat_format, detect

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"},
        "options": {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]},
                                                     "days": {"type": "array", "items": {"type": "integer"}}}}},
        "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}, "offset": {"type": "integer"}},
                   "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
ARGS_A = {"city": "Paris"}
ARGS_B = {"city": "Tōkyō", "options": {"unit": "celsius", "days": [1, 2]}}
REASONING = "Two cities: two calls."


def openai_conversation(follow_up: bool) -> list[dict]:
    """As a client sends it (and as the server passes it on: content "" for none)."""
    conv = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the weather in Paris and in Tōkyō?"},
        {"role": "assistant", "content": "", "reasoning_content": REASONING, "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(ARGS_A)}},
            {"id": "call_b", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": json.dumps(ARGS_B, ensure_ascii=False)}}]},
        {"role": "tool", "tool_call_id": "call_a", "content": '{"sky": "sunny"}'},
        {"role": "tool", "tool_call_id": "call_b", "content": '{"sky": "rain"}'},
    ]
    if follow_up:
        conv += [{"role": "assistant", "content": "Sunny in Paris, rain in Tōkyō."},
                 {"role": "user", "content": "And tomorrow?"}]
    return conv


def hf_conversation(family: str, follow_up: bool) -> tuple[list[dict], list[dict] | None]:
    """The same conversation written by hand as each model's documentation has users write it for
    transformers: arguments as objects; gpt-oss one call per assistant message, each answered in
    turn, reasoning as `thinking`; DeepSeek-V3.1 the tools described in the system prompt (its card)."""
    call = lambda args: {"type": "function", "function": {"name": "get_weather", "arguments": args}}  # noqa: E731
    conv = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the weather in Paris and in Tōkyō?"},
        {"role": "assistant", "content": "", "reasoning_content": REASONING, "tool_calls": [call(ARGS_A), call(ARGS_B)]},
        {"role": "tool", "content": '{"sky": "sunny"}'},
        {"role": "tool", "content": '{"sky": "rain"}'},
    ]
    tools = TOOLS
    if family == "gpt-oss":
        conv[2:] = [{"role": "assistant", "content": "", "thinking": REASONING, "tool_calls": [call(ARGS_A)]},
                    {"role": "tool", "content": '{"sky": "sunny"}'},
                    {"role": "assistant", "content": "", "tool_calls": [call(ARGS_B)]},
                    {"role": "tool", "content": '{"sky": "rain"}'}]
    if family in ("deepseek-v3.1", "deepseek-r1"):
        from moeray.stages.text.chat.deepseek import tool_description

        conv[0] = {"role": "system", "content": "You are a helpful assistant.\n\n" + tool_description(TOOLS)}
        tools = None
    if follow_up:
        conv += [{"role": "assistant", "content": "Sunny in Paris, rain in Tōkyō."},
                 {"role": "user", "content": "And tomorrow?"}]
    return conv, tools


TEMPLATE_FORMATS = {"qwen3": "hermes", "qwen2.5": "hermes", "qwen3-coder": "qwen3_xml", "qwen3.5": "qwen3_xml",
                    "deepseek-v3.1": "deepseek", "deepseek-r1": "deepseek", "glm-4.6": "glm", "kimi-k2": "kimi_k2",
                    "kimi-k2-thinking": "kimi_k2", "gpt-oss": "harmony"}
VARIABLES = {"deepseek-v3.1": {"thinking": True}, "gpt-oss": {"reasoning_effort": "high"}}
TOKENS = {"qwen3": "qwen3", "qwen2.5": "qwen3", "qwen3-coder": "qwen3", "qwen3.5": "qwen3", "deepseek-v3.1": "deepseek-v3.1",
          "deepseek-r1": "deepseek-v3.1", "glm-4.6": "glm-4.6", "kimi-k2": "kimi-k2-thinking",
          "kimi-k2-thinking": "kimi-k2-thinking", "gpt-oss": "gpt-oss", "phi-3.5": "qwen3", "gemma-2": "qwen3"}


@pytest.fixture(scope="module")
def tokenizers():
    """(transformers tokenizer, moeray Tokenizer) per template, with the family's special tokens."""
    out = {}
    for name in [*TEMPLATE_FILES, *OTHERS]:
        fam = FAMILIES[TOKENS[name]]
        fast = fast_tokenizer(fam, template(name), ["What is the weather in Paris? It is sunny."], 320)
        out[name] = (fast, moeray_tokenizer(fast))
    return out


def test_each_template_chooses_its_family_and_the_architecture_decides_without_markers():
    for name, fmt in TEMPLATE_FORMATS.items():
        assert detect(template(name)) == fmt, name
    assert detect(None, "gpt-oss") == "plain"  # no template: nothing to chat with
    assert detect("{{ messages }}", "glm4moe") == "glm" and detect("{{ messages }}", "llama") == "generic"
    assert detect(template("gemma-2")) == detect(template("phi-3.5")) == "generic"  # no tool format: the generic one
    assert chat_format(template("qwen3"), name="plain").name == "plain"  # --chat-format overrides


@contextlib.contextmanager
def mutable_lists():
    """transformers' renderer with lists that may change: Kimi-K2's published template calls .append()
    and .pop(), which transformers' immutable sandbox refuses (so it cannot render a call at all)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedEnvironment
    from transformers.utils import chat_template_utils as ctu

    ctu._compile_jinja_template.cache_clear()
    ctu.ImmutableSandboxedEnvironment = SandboxedEnvironment
    try:
        yield
    finally:
        ctu.ImmutableSandboxedEnvironment = ImmutableSandboxedEnvironment
        ctu._compile_jinja_template.cache_clear()


@pytest.mark.parametrize("follow_up", [False, True], ids=["up-to-the-results", "with-a-follow-up"])
@pytest.mark.parametrize("name", list(TEMPLATE_FILES))
def test_the_conversation_renders_as_transformers_renders_it(name, follow_up, tokenizers):
    fast, tok = tokenizers[name]
    fmt = chat_format(tok.chat_template)
    turn = fmt.render(tok, openai_conversation(follow_up), TOOLS, VARIABLES.get(name, {}))
    conv, tools = hf_conversation(name, follow_up)
    with mutable_lists():  # (the reference only: moeray renders in transformers' own sandbox)
        expected = fast.apply_chat_template(conv, tools=tools, tokenize=False, add_generation_prompt=True,
                                            **VARIABLES.get(name, {}))
    assert turn.prompt == expected
    # What the conversation holds reaches the prompt, as each template keeps it.
    assert "Tōkyō" in turn.prompt and "celsius" in turn.prompt and "get_time" in turn.prompt
    keeps_reasoning = name in ("qwen3", "qwen3.5", "glm-4.6", "gpt-oss", "kimi-k2-thinking") and not follow_up
    assert (REASONING in turn.prompt) == keeps_reasoning


def test_template_variables_reach_the_template_and_decide_where_the_reply_starts(tokenizers):
    msgs = [{"role": "user", "content": "hi"}]
    tok = tokenizers["qwen3"][1]
    fmt = chat_format(tok.chat_template)
    assert fmt.render(tok, msgs).thinking == "optional"  # Qwen3 opens <think> itself, or not
    off = fmt.render(tok, msgs, variables={"enable_thinking": False})
    assert off.prompt.endswith("<think>\n\n</think>\n\n") and off.thinking == "off"
    tok = tokenizers["qwen3.5"][1]
    assert chat_format(tok.chat_template).render(tok, msgs).thinking == "open"  # the prompt ends in <think>
    tok = tokenizers["deepseek-v3.1"][1]
    fmt = chat_format(tok.chat_template)
    assert fmt.render(tok, msgs).thinking == "off" and fmt.render(tok, msgs, variables={"thinking": True}).thinking == "open"
    tok = tokenizers["gpt-oss"][1]
    fmt = chat_format(tok.chat_template)
    assert "Reasoning: low" in fmt.render(tok, msgs, variables={"reasoning_effort": "low"}).prompt
    from moeray.stages.text.chat import ChatFormatError

    with pytest.raises(ChatFormatError, match="reasoning_effort 'minimal'") as exc:
        fmt.render(tok, msgs, variables={"reasoning_effort": "minimal"})
    assert exc.value.param == "reasoning_effort"
    with pytest.raises(ChatFormatError, match="may not set messages"):
        fmt.render(tok, msgs, variables={"messages": []})


# ---------------------------------------------------------------- reading replies

PARIS = '{"city": "Paris"}'
LIMA = '{"city": "Lima"}'
TRICKY = '{"city": "Tōkyō \\"東京\\" {x}", "options": {"unit": "celsius", "days": [1, 2]}}'  # nested, quotes, unicode
TRICKY_XML = json.dumps({"city": 'Tōkyō "東京" {x}', "options": {"unit": "celsius", "days": [1, 2]}}, ensure_ascii=False)


def msg(content=None, reasoning=None, calls=()):
    return {"content": content, "reasoning": reasoning, "calls": list(calls)}


def hermes_call(args):
    return f'<tool_call>\n{{"name": "get_weather", "arguments": {args}}}\n</tool_call>'


def xml_call(city, options=None):
    opt = f"<parameter=options>\n{json.dumps(options, ensure_ascii=False)}\n</parameter>\n" if options else ""
    return f"<tool_call>\n<function=get_weather>\n<parameter=city>\n{city}\n</parameter>\n{opt}</function>\n</tool_call>"


def glm_call(city, options=None):
    opt = f"<arg_key>options</arg_key>\n<arg_value>{json.dumps(options, ensure_ascii=False)}</arg_value>\n" if options else ""
    return f"<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>{city}</arg_value>\n{opt}</tool_call>"


def ds(*calls, fenced=False):
    if fenced:
        body = "\n".join(f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{a}\n```<｜tool▁call▁end｜>"
                         for a in calls)
    else:
        body = "".join(f"<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{a}<｜tool▁call▁end｜>" for a in calls)
    return f"<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>"


def kimi(*calls):
    body = "".join(f"<|tool_call_begin|>functions.get_weather:{i}<|tool_call_argument_begin|>{a}<|tool_call_end|>"
                   for i, a in enumerate(calls))
    return f"<|tool_calls_section_begin|>{body}<|tool_calls_section_end|>"


def harmony_call(args, header_first=False):
    if header_first:
        return f"<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{args}"
    return f"<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{args}"


W = "get_weather"
XML_TRICKY = xml_call('Tōkyō "東京" {x}', {"unit": "celsius", "days": [1, 2]})
GLM_TRICKY = glm_call('Tōkyō "東京" {x}', {"unit": "celsius", "days": [1, 2]})
ANALYSIS = "<|channel|>analysis<|message|>I need Paris.<|end|>"

# (family whose tokenizer and template are used, the reply as the model writes it, the message)
CASES = {
    "hermes: reasoning and a call": ("qwen3", f"<think>\nI need Paris.\n</think>\n\n{hermes_call(PARIS)}",
                                     msg(None, "I need Paris.", [(W, PARIS)])),
    "hermes: parallel calls": ("qwen3", f"{hermes_call(PARIS)}\n{hermes_call(LIMA)}", msg(None, None, [(W, PARIS), (W, LIMA)])),
    "hermes: text then a call": ("qwen3", f"Let me check.\n{hermes_call(PARIS)}", msg("Let me check.", None, [(W, PARIS)])),
    "hermes: nested, quotes, unicode": ("qwen3", hermes_call(TRICKY), msg(None, None, [(W, TRICKY)])),
    "hermes: an answer": ("qwen3", "<think>\nEasy.\n</think>\n\nIt is <b>sunny</b>.", msg("It is <b>sunny</b>.", "Easy.")),
    "hermes: text after the calls": ("qwen3", f"{hermes_call(PARIS)}\nDone.", msg("Done.", None, [(W, PARIS)])),
    "qwen3_xml: open reasoning and a call": ("qwen3.5", f"I need Paris.\n</think>\n\n{xml_call('Paris')}",
                                             msg(None, "I need Paris.", [(W, PARIS)])),
    "qwen3_xml: parallel calls": ("qwen3.5", f"ok\n</think>\n\n{xml_call('Paris')}\n{xml_call('Lima')}",
                                  msg(None, "ok", [(W, PARIS), (W, LIMA)])),
    "qwen3_xml: text then a call": ("qwen3.5", f"ok\n</think>\n\nLet me check.\n\n{xml_call('Paris')}",
                                    msg("Let me check.", "ok", [(W, PARIS)])),
    "qwen3_xml: nested, quotes, unicode": ("qwen3.5", f"ok\n</think>\n\n{XML_TRICKY}", msg(None, "ok", [(W, TRICKY_XML)])),
    "qwen3_xml: an answer": ("qwen3.5", "Easy.\n</think>\n\nSunny.", msg("Sunny.", "Easy.")),
    "deepseek: open reasoning and a call": ("deepseek-v3.1", f"I need Paris.</think>{ds(PARIS)}",
                                            msg(None, "I need Paris.", [(W, PARIS)])),
    "deepseek: parallel calls": ("deepseek-v3.1", f"ok</think>{ds(PARIS, LIMA)}", msg(None, "ok", [(W, PARIS), (W, LIMA)])),
    "deepseek: text then a call": ("deepseek-v3.1", f"ok</think>Let me check.{ds(PARIS)}",
                                   msg("Let me check.", "ok", [(W, PARIS)])),
    "deepseek: nested, quotes, unicode": ("deepseek-v3.1", f"ok</think>{ds(TRICKY)}", msg(None, "ok", [(W, TRICKY)])),
    "deepseek: R1's fenced calls": ("deepseek-v3.1", f"ok</think>{ds(PARIS, TRICKY, fenced=True)}",
                                    msg(None, "ok", [(W, PARIS), (W, TRICKY)])),
    "deepseek: an answer": ("deepseek-v3.1", "Easy.</think>Sunny.", msg("Sunny.", "Easy.")),
    "glm: reasoning and a call": ("glm-4.6", f"\n<think>I need Paris.</think>\n{glm_call('Paris')}",
                                  msg(None, "I need Paris.", [(W, PARIS)])),
    "glm: parallel calls": ("glm-4.6", f"\n<think></think>\n{glm_call('Paris')}\n{glm_call('Lima')}",
                            msg(None, None, [(W, PARIS), (W, LIMA)])),
    "glm: text then a call": ("glm-4.6", f"\nLet me check.\n{glm_call('Paris')}", msg("Let me check.", None, [(W, PARIS)])),
    "glm: nested, quotes, unicode": ("glm-4.6", f"\n<think>ok</think>\n{GLM_TRICKY}", msg(None, "ok", [(W, TRICKY_XML)])),
    "glm: an answer": ("glm-4.6", "\n<think>Easy.</think>\nSunny.", msg("Sunny.", "Easy.")),
    "kimi_k2: reasoning and a call": ("kimi-k2-thinking", f"<think>I need Paris.</think>{kimi(PARIS)}",
                                      msg(None, "I need Paris.", [(W, PARIS)])),
    "kimi_k2: parallel calls": ("kimi-k2-thinking", kimi(PARIS, LIMA), msg(None, None, [(W, PARIS), (W, LIMA)])),
    "kimi_k2: text then a call": ("kimi-k2-thinking", f"Let me check.{kimi(PARIS)}", msg("Let me check.", None, [(W, PARIS)])),
    "kimi_k2: nested, quotes, unicode": ("kimi-k2-thinking", kimi(TRICKY), msg(None, None, [(W, TRICKY)])),
    "kimi_k2: an answer": ("kimi-k2-thinking", "<think>Easy.</think>Sunny.", msg("Sunny.", "Easy.")),
    "harmony: reasoning and a call": ("gpt-oss", ANALYSIS + harmony_call(PARIS), msg(None, "I need Paris.", [(W, PARIS)])),
    "harmony: the template's header order": ("gpt-oss", ANALYSIS + harmony_call(PARIS, header_first=True),
                                             msg(None, "I need Paris.", [(W, PARIS)])),
    "harmony: a preamble then a call": ("gpt-oss", "<|channel|>commentary<|message|>Let me check.<|end|>" + harmony_call(PARIS),
                                        msg("Let me check.", None, [(W, PARIS)])),
    "harmony: nested, quotes, unicode": ("gpt-oss", harmony_call(TRICKY)[len("<|start|>assistant"):],
                                         msg(None, None, [(W, TRICKY)])),
    "harmony: an answer": ("gpt-oss", ANALYSIS + "<|start|>assistant<|channel|>final<|message|>Sunny.", msg("Sunny.", "I need Paris.")),
    "generic: a call": ("phi-3.5", f'{{"tool_calls": [{{"name": "get_weather", "arguments": {PARIS}}}]}}',
                        msg(None, None, [(W, PARIS)])),
    "generic: parallel calls": ("phi-3.5", f'{{"tool_calls": [{{"name": "get_weather", "arguments": {PARIS}}}, '
                                           f'{{"name": "get_weather", "arguments": {LIMA}}}]}}',
                                msg(None, None, [(W, PARIS), (W, LIMA)])),
    "generic: nested, quotes, unicode": ("phi-3.5", f'{{"tool_calls": [{{"name": "get_weather", "arguments": {TRICKY}}}]}}',
                                         msg(None, None, [(W, TRICKY)])),
    "generic: an answer": ("phi-3.5", '{"response": "It is <b>sunny</b> in T\u014dky\u014d \\"\u6771\u4eac\\" \\ud83d\\ude00."}',
                           msg('It is <b>sunny</b> in Tōkyō "東京" \U0001f600.')),
    "generic: text that is not its JSON": ("phi-3.5", "Sunny, {maybe}.", msg("Sunny, {maybe}.")),
}

MALFORMED = {  # nothing dropped: the model's text comes back as content
    "hermes: not JSON": ("qwen3", 'Sure. <tool_call>\n{"name": get_weather}\n</tool_call> ok'),
    "hermes: cut off": ("qwen3", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'),
    "qwen3_xml: an unclosed parameter": ("qwen3.5", "ok\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>"),
    "deepseek: arguments not JSON": ("deepseek-v3.1", "ok</think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{city: Paris}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
    "glm: text in the call": ("glm-4.6", "<tool_call>get_weather\n<arg_key>city</arg_key>\nParis\n</tool_call>"),
    "kimi_k2: arguments not an object": ("kimi-k2-thinking", "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>[1, 2]<|tool_call_end|><|tool_calls_section_end|>"),
    "harmony: arguments not JSON": ("gpt-oss", "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{city"),
    "generic: arguments not JSON": ("phi-3.5", '{"tool_calls": [{"name": "get_weather", "arguments": {city: 1}}]}'),
}


def turn_for(family: str, tokenizers, tools=TOOLS) -> Turn:
    _, tok = tokenizers[family]
    fmt = chat_format(tok.chat_template)
    return fmt.render(tok, [{"role": "user", "content": "hi"}], tools, VARIABLES.get(family, {}))


def as_dict(m) -> dict:
    return {"content": m.content or None, "reasoning": m.reasoning or None,
            "calls": [(c.name, c.arguments) for c in m.tool_calls]}


def streamed(turn: Turn, pieces) -> tuple[dict, list]:
    """What a client makes of the deltas of `pieces` fed one by one: the message, and the call deltas."""
    reader, deltas = turn.reader(), []
    for p in pieces:
        deltas.append(reader.feed(p))
    deltas.append(reader.close())
    content = "".join(d.content for d in deltas)
    reasoning = "".join(d.reasoning for d in deltas)
    calls: dict[int, list] = {}
    call_deltas = [c for d in deltas for c in d.calls]
    for c in call_deltas:
        if c.index not in calls:
            assert c.id and c.name and c.arguments == "", "a call's first delta is its id and name"
            calls[c.index] = [c.name, ""]
        else:
            assert c.id is None and c.name is None, "later deltas are argument fragments only"
            calls[c.index][1] += c.arguments
    broken = {i for d in deltas for i in d.broken}
    return {"content": content or None, "reasoning": reasoning or None,
            "calls": [tuple(calls[i]) for i in sorted(calls) if i not in broken]}, call_deltas


def marker_splits(text: str, markers) -> list[list[str]]:
    """The text in two pieces, cut inside a marker, for every position inside every marker in it."""
    out = []
    for m in set(markers):
        start = text.find(m)
        while start >= 0:
            out += [[text[:start + k], text[start + k:]] for k in range(1, len(m))]
            start = text.find(m, start + 1)
    return out


def token_pieces(turn: Turn, tok, text: str) -> list[str]:
    """The reply as the engine releases it: tokenized, then detokenized token by token (StopStringStream)."""
    from moeray.stages.text.detokenize import StopStringStream

    tok = tok.with_rendered(turn.format.markers())
    detok = StopStringStream(tok)
    ids = tok.encode(text, add_bos=False)
    return [detok.push(i) for i in ids] + [detok.finish()]


@pytest.mark.parametrize("case", list(CASES))
def test_a_reply_reads_into_the_openai_message_whole_and_streamed(case, tokenizers):
    family, text, expected = CASES[case]
    turn = turn_for(family, tokenizers)
    assert turn.format.name == case.split(":")[0]
    assert as_dict(turn.parse(text)) == expected
    by_char, call_deltas = streamed(turn, list(text))
    assert by_char == expected
    if expected["calls"]:
        assert len([c for c in call_deltas if c.arguments]) >= 2, "arguments arrive in fragments as they are written"
    for pieces in marker_splits(text, turn.format.markers()):
        assert streamed(turn, pieces)[0] == expected, pieces
    pieces = token_pieces(turn, tokenizers[family][1], text)
    assert "".join(pieces) == text  # the markers (control tokens or not) reach the reader
    assert streamed(turn, pieces)[0] == expected


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_call_comes_back_as_its_text(case, tokenizers):
    family, text = MALFORMED[case]
    turn = turn_for(family, tokenizers)
    reasoning, call = text.split(turn.format.think[1], 1) if turn.thinking == "open" else ("", text)
    expected = {"content": call.strip(), "reasoning": reasoning.strip() or None, "calls": []}
    assert as_dict(turn.parse(text)) == expected
    assert streamed(turn, list(text))[0] == expected
    for pieces in marker_splits(text, turn.format.markers()):
        assert streamed(turn, pieces)[0] == expected


def test_without_tools_calls_are_not_read_but_reasoning_is(tokenizers):
    family, text, _ = CASES["hermes: reasoning and a call"]
    turn = turn_for(family, tokenizers, tools=None)
    assert as_dict(turn.parse(text)) == msg(hermes_call(PARIS), "I need Paris.")
    turn = turn_for("gpt-oss", tokenizers, tools=None)
    text = ANALYSIS + harmony_call(PARIS)
    assert as_dict(turn.parse(text)) == msg(harmony_call(PARIS), "I need Paris.")


def test_plain_text_is_content_as_written_and_random_text_is_never_lost(tokenizers):
    from moeray.stages.text.chat import FORMATS

    plain = Turn(FORMATS["plain"](), "", None, "off")
    assert as_dict(plain.parse("  <think>x</think> <tool_call>\n")) == msg("  <think>x</think> <tool_call>\n")
    for family in ("qwen3", "deepseek-v3.1", "glm-4.6", "kimi-k2-thinking", "gpt-oss"):
        turn = turn_for(family, tokenizers)
        text = "a <tool_ call> b <|chan c"
        read = as_dict(turn.parse(text))
        # reasoning where the prompt left the model reasoning (DeepSeek with thinking on), else content
        assert read["reasoning" if turn.thinking == "open" else "content"] == text and not read["calls"], family


# ---------------------------------------------------------------- forcing a call

# The reply of each family that calls get_weather after its reasoning (CASES), and one in another
# family's format, which the grammar must refuse.
FORCED = {"qwen3": ("hermes: reasoning and a call", "glm: reasoning and a call"),
          "qwen3.5": ("qwen3_xml: open reasoning and a call", "hermes: nested, quotes, unicode"),
          "deepseek-v3.1": ("deepseek: open reasoning and a call", "hermes: nested, quotes, unicode"),
          "glm-4.6": ("glm: reasoning and a call", "hermes: reasoning and a call"),
          "kimi-k2-thinking": ("kimi_k2: reasoning and a call", "hermes: reasoning and a call"),
          "gpt-oss": ("harmony: reasoning and a call", "hermes: reasoning and a call")}
PARALLEL = {"qwen3": "hermes: parallel calls", "qwen3.5": "qwen3_xml: parallel calls",
            "deepseek-v3.1": "deepseek: parallel calls", "glm-4.6": "glm: parallel calls",
            "kimi-k2-thinking": "kimi_k2: parallel calls"}


def accepts(grammar: str, tok, text: str) -> bool:
    """Whether the grammar takes the reply `text` (as tokenized) and is complete after it."""
    import llguidance

    from moeray.stages.text.grammar import check_grammar, ll_tokenizer

    check_grammar(grammar, tok)
    m = llguidance.LLMatcher(ll_tokenizer(tok), grammar, log_level=0)
    ids = tok.encode(text, add_bos=False)
    return m.validate_tokens(ids) == len(ids) and m.consume_tokens(ids) and m.is_accepting()


def body(case: str, family: str) -> str:
    """A CASES reply, its reasoning written for this family's prompt (open or not)."""
    return CASES[case][1]


@pytest.mark.parametrize("family", list(FORCED))
def test_a_forced_call_is_written_in_the_familys_own_format(family, tokenizers):
    tok = tokenizers[family][1]
    turn = turn_for(family, tokenizers)
    own, other = (CASES[c][1] for c in FORCED[family])
    required = turn.forced_grammar(tok)
    assert accepts(required, tok, own)
    assert not accepts(required, tok, other)  # another family's call: refused
    assert not accepts(required, tok, "It is sunny.")  # no call: refused
    assert not accepts(turn.forced_grammar(tok, "get_time", parallel=False), tok, own)  # the named function only
    wrong_args = own.replace("Paris", "Paris", 1).replace('"city"', '"town"').replace(">city<", ">town<").replace("=city>", "=town>")
    assert wrong_args != own and not accepts(required, tok, wrong_args)  # arguments follow the schema
    if family in PARALLEL:
        two = CASES[PARALLEL[family]][1]
        assert accepts(required, tok, two) and not accepts(turn.forced_grammar(tok, parallel=False), tok, two)


def test_reasoning_before_a_forced_call_only_where_the_model_reasons(tokenizers):
    tok = tokenizers["qwen3"][1]
    fmt = chat_format(tok.chat_template)
    msgs = [{"role": "user", "content": "hi"}]
    call = hermes_call(PARIS)
    thinking = f"<think>\nI need Paris.\n</think>\n\n{call}"
    optional = fmt.render(tok, msgs, TOOLS).forced_grammar(tok)
    assert accepts(optional, tok, thinking) and accepts(optional, tok, call)
    off = fmt.render(tok, msgs, TOOLS, {"enable_thinking": False}).forced_grammar(tok)
    assert accepts(off, tok, call) and not accepts(off, tok, thinking)
    tok = tokenizers["qwen3.5"][1]
    opened = chat_format(tok.chat_template).render(tok, msgs, TOOLS).forced_grammar(tok)
    xml = xml_call("Paris")
    assert accepts(opened, tok, f"I need Paris.\n</think>\n\n{xml}") and not accepts(opened, tok, xml)
    # DeepSeek-V3.1 thinks only where its prompt opens <think>: after a tool's result (thinking on) the
    # prompt ends in the result, and a forced call comes straight, as the model writes it there.
    from chat_models import FAMILIES as SERVED, tool_loop

    tok = tokenizers["deepseek-v3.1"][1]
    after = chat_format(tok.chat_template).render(tok, tool_loop(SERVED["deepseek-v3.1"])[1], TOOLS, {"thinking": True})
    assert after.thinking == "off"
    forced = after.forced_grammar(tok)
    assert accepts(forced, tok, ds(PARIS)) and not accepts(forced, tok, f"<think>ok</think>{ds(PARIS)}")


def test_the_markers_are_whole_tokens_as_read_from_a_gguf(tmp_path):
    """Every family's control and text tokens, written to a GGUF and read back (Tokenizer.from_gguf),
    encode as the one token at their id, as llama.cpp matches them: DeepSeek's <｜User｜> is spelled
    outside the byte alphabet, which transformers' converter leaves out."""
    import tiny_models

    from moeray.stages.gguf.writer import write_gguf
    from moeray.stages.text.tokenizer import Tokenizer

    for fam in FAMILIES.values():
        fast = fast_tokenizer(fam, template(fam.template), ["What is the weather in Paris?"], 320)
        path = write_gguf(tiny_models.tiny_llama(), tmp_path / f"{fam.name}.gguf", tokenizer=fast)
        tok = Tokenizer.from_gguf(path)
        for marker in fam.control + fam.text_tokens:
            i = fast.convert_tokens_to_ids(marker)
            assert tok.encode(f"a{marker}b", add_bos=False) == tok.encode("a", add_bos=False) + [i] + tok.encode("b", add_bos=False), (fam.name, marker)
            if i not in tok.end_ids:  # (an end token is no text)
                assert tok.with_rendered([marker]).decode([i]) == marker, marker


# ---------------------------------------------------------------- a reply cut by max_tokens

# Two calls in each family's format (one for harmony, whose <|call|> ends the reply), the second
# then cut short: (case, the text that opens the second call, the text that closes it).
CUT = {"qwen3": ("hermes: parallel calls", "<tool_call>", "</tool_call>"),
       "qwen3.5": ("qwen3_xml: parallel calls", "<tool_call>", "</tool_call>"),
       "deepseek-v3.1": ("deepseek: parallel calls", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"),
       "glm-4.6": ("glm: parallel calls", "<tool_call>", "</tool_call>"),
       "kimi-k2-thinking": ("kimi_k2: parallel calls", "<|tool_call_begin|>", "<|tool_call_end|>"),
       "gpt-oss": ("harmony: reasoning and a call", "<|start|>", None),
       "phi-3.5": ("generic: parallel calls", '{"name"', '}}')}


def cuts(text: str, opener: str, closer: str | None) -> tuple[int, int, list[int]]:
    """Where the last call starts (its opener), where it is whole (None: at the end), and every
    cut between."""
    start = text.rindex(opener)
    end = text.index(closer, start) + len(closer) if closer else len(text)
    return start, end, list(range(start, end))


@pytest.mark.parametrize("family", list(CUT))
def test_a_call_cut_by_max_tokens_is_dropped_and_the_complete_ones_stay(family, tokenizers):
    """Cut anywhere inside the last call (its markers included): the calls before it come back, the cut
    one does not, nothing of its markup reaches content, whole or streamed; cut by anything else
    (a stop string) the same text is a malformed call, kept as content (test_a_malformed_call...)."""
    case, opener, closer = CUT[family]
    _, text, expected = CASES[case]
    turn = turn_for(family, tokenizers)
    start, end, points = cuts(text, opener, closer)
    before = {**expected, "calls": expected["calls"][:-1]}
    for at in points:
        short = text[:at]
        assert as_dict(turn.parse(short, cut=True)) == before, short
        reader = turn.reader()
        deltas = [reader.feed(ch) for ch in short] + [reader.close(cut=True)]
        assert not "".join(d.content for d in deltas), short  # not even while streaming
        assert as_dict(reader.message) == before, short
    assert as_dict(turn.parse(text[:end], cut=True)) == expected  # whole at the cut: it stays
    reasoning = expected["reasoning"]
    for at in range(1, text.index(opener) if family != "gpt-oss" else 1):  # before any call: no call, no markup
        read = as_dict(turn.parse(text[:at], cut=True))
        assert read["calls"] == [] and read["content"] is None and (read["reasoning"] or "") in (reasoning or "")


def test_a_cut_marker_at_the_end_of_text_is_no_text(tokenizers):
    turn = turn_for("qwen3", tokenizers)
    assert as_dict(turn.parse("Let me check.\n<tool_ca", cut=True)) == msg("Let me check.")
    assert as_dict(turn.parse("Let me check.\n<tool_ca")) == msg("Let me check.\n<tool_ca")  # (ended by itself: text)
    turn = turn_for("deepseek-v3.1", tokenizers)
    assert as_dict(turn.parse(f"ok</think>Sure.<｜tool▁calls▁begin｜>", cut=True)) == msg("Sure.", "ok")
    turn = turn_for("gpt-oss", tokenizers)
    assert as_dict(turn.parse(ANALYSIS + "<|start|>assistant<|chan", cut=True)) == msg(None, "I need Paris.")


# ---------------------------------------------------------------- the generic format


def test_the_generic_format_describes_the_tools_and_lays_out_calls_and_results_for_any_template(tokenizers):
    from moeray.stages.text.chat.generic import INSTRUCTION

    for name in OTHERS:
        tok = tokenizers[name][1]
        fmt = chat_format(tok.chat_template)
        assert fmt.name == "generic" and fmt.tools_problem(tok) is None
        turn = fmt.render(tok, openai_conversation(follow_up=True), TOOLS)
        prompt = turn.prompt
        # The tools, one JSON object each, and how to answer, in the system message (Gemma's template
        # refuses one: the text opens the first user message instead).
        assert json.dumps({"name": "get_time", "description": "The time in a zone",
                           "parameters": TIME["function"]["parameters"]}) in prompt and INSTRUCTION in prompt
        assert prompt.index(INSTRUCTION) < prompt.index("What is the weather in Paris")
        # An earlier reply's calls as the JSON the model writes, their results (paired by id) as user turns.
        calls = {"tool_calls": [{"name": "get_weather", "arguments": ARGS_A}, {"name": "get_weather", "arguments": ARGS_B}]}
        assert json.dumps(calls, ensure_ascii=False) in prompt
        assert '{"tool_response": {"name": "get_weather", "id": "call_b", "content": "{\\"sky\\": \\"rain\\"}"}}' in prompt
        # Without tools (tool_choice none) the history is laid out the same, the tools not described,
        # and the reply is text.
        plain = fmt.render(tok, openai_conversation(follow_up=True))
        assert INSTRUCTION not in plain.prompt and json.dumps(calls, ensure_ascii=False) in plain.prompt
        assert plain.text_only
        assert not turn.text_only


def test_the_generic_grammar_holds_every_reply_with_tools_to_its_json(tokenizers):
    tok = tokenizers["phi-3.5"][1]
    turn = turn_for("phi-3.5", tokenizers)
    call = CASES["generic: a call"][1]
    two = CASES["generic: parallel calls"][1]
    answer = '{"response": "It is sunny."}'
    auto = turn.auto_grammar(tok)
    assert accepts(auto, tok, call) and accepts(auto, tok, two) and accepts(auto, tok, answer)
    assert not accepts(auto, tok, "It is sunny.") and not accepts(auto, tok, '{"tool_calls": []}')
    required = turn.forced_grammar(tok)
    assert accepts(required, tok, call) and accepts(required, tok, two) and not accepts(required, tok, answer)
    single = turn.forced_grammar(tok, "get_weather", parallel=False)
    assert accepts(single, tok, call) and not accepts(single, tok, two)
    assert not accepts(turn.forced_grammar(tok, "get_time", parallel=False), tok, call)
    assert not accepts(auto, tok, call.replace('"city"', '"town"'))  # arguments by the schema


# ---------------------------------------------------------------- forced arguments confined to the schema

EXTRA_KEY = {"qwen3": ("hermes: reasoning and a call", PARIS, '{"city": "Paris", "zone": "x"}'),
             "deepseek-v3.1": ("deepseek: open reasoning and a call", PARIS, '{"city": "Paris", "zone": "x"}'),
             "kimi-k2-thinking": ("kimi_k2: reasoning and a call", PARIS, '{"city": "Paris", "zone": "x"}'),
             "gpt-oss": ("harmony: reasoning and a call", PARIS, '{"city": "Paris", "zone": "x"}'),
             "phi-3.5": ("generic: a call", PARIS, '{"city": "Paris", "zone": "x"}'),
             "qwen3.5": ("qwen3_xml: open reasoning and a call", "</parameter>\n", "</parameter>\n<parameter=zone>\nx\n</parameter>\n"),
             "glm-4.6": ("glm: reasoning and a call", "</arg_value>\n", "</arg_value>\n<arg_key>zone</arg_key>\n<arg_value>x</arg_value>\n")}


@pytest.mark.parametrize("family", list(EXTRA_KEY))
def test_forced_arguments_hold_only_the_properties_the_schema_lists(family, tokenizers):
    """xgrammar's strict mode, vLLM's default: a key the function does not declare is refused, at the
    top and in nested objects; a schema that allows more keys says so and gets them."""
    tok = tokenizers[family][1]
    case, plain, extra = EXTRA_KEY[family]
    own = CASES[case][1]
    required = turn_for(family, tokenizers).forced_grammar(tok)
    assert accepts(required, tok, own) and not accepts(required, tok, own.replace(plain, extra, 1))
    nested = own.replace(plain, plain.replace('"Paris"', '"Paris", "options": {"unit": "celsius", "hour": 3}'), 1)
    if nested != own:
        assert not accepts(required, tok, nested)
        assert accepts(required, tok, nested.replace(', "hour": 3', ""))
    open_tool = {"type": "function", "function": {**WEATHER["function"], "parameters": {
        **WEATHER["function"]["parameters"], "additionalProperties": True}}}
    allowed = turn_for(family, tokenizers, tools=[open_tool]).forced_grammar(tok)
    if plain == PARIS:  # (the XML formats write the properties the schema lists, one by one)
        assert accepts(allowed, tok, own.replace(plain, extra, 1))


def test_confined_closes_the_objects_that_list_their_properties():
    from moeray.stages.text.grammar import confined

    schema = {"type": "object", "properties": {
        "a": {"type": "object", "properties": {"b": {"type": "string"}}},
        "any": {"type": "object"},
        "open": {"type": "object", "properties": {"c": {}}, "additionalProperties": {"type": "integer"}},
        "list": {"type": "array", "items": {"properties": {"d": {}}}},
        "either": {"anyOf": [{"properties": {"e": {}}}, {"type": "string"}]},
        "both": {"allOf": [{"properties": {"f": {}}}, {"properties": {"g": {}}}]},
        "ref": {"$ref": "#/$defs/R"}},
        "$defs": {"R": {"type": "object", "properties": {"h": {}}}}}
    out = confined(schema)
    assert out["additionalProperties"] is False and "additionalProperties" not in schema  # a copy
    p = out["properties"]
    assert p["a"]["additionalProperties"] is False and "additionalProperties" not in p["any"]
    assert p["open"]["additionalProperties"] == {"type": "integer"}
    assert p["list"]["items"]["additionalProperties"] is False
    assert p["either"]["anyOf"][0]["additionalProperties"] is False and p["either"]["anyOf"][1] == {"type": "string"}
    assert all("additionalProperties" not in s for s in p["both"]["allOf"])  # each names part of the whole
    assert out["$defs"]["R"]["additionalProperties"] is False


@pytest.mark.parametrize("family", ["qwen3.5", "glm-4.6"])
def test_a_raw_string_argument_keeps_its_length_and_no_markup(family, tokenizers):
    """The XML and GLM formats write a string argument as raw text: it keeps the schema's minLength and
    maxLength, and cannot hold the markup that would end it early for the reader."""
    tok = tokenizers[family][1]
    short = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "minLength": 2, "maxLength": 5}}, "required": ["city"]}}}
    grammar = turn_for(family, tokenizers, tools=[short]).forced_grammar(tok)
    own = CASES[FORCED[family][0]][1]
    assert accepts(grammar, tok, own)  # "Paris": 5 characters
    for city in ("Pariss", "P", "Pa</tool_call>", "Pa<parameter=x>"):
        assert not accepts(grammar, tok, own.replace(">Paris<", f">{city}<").replace("\nParis\n", f"\n{city}\n")), city


def test_a_raw_string_argument_ends_where_the_reader_ends_it(tokenizers):
    """Qwen3-Coder's reader ends a value at the first </parameter>: the grammar does not let the value
    hold one without the newline the template writes before it (a model that writes it bare must
    then write the newline and the marker, and the reader reads what the grammar took)."""
    tok = tokenizers["qwen3.5"][1]
    grammar = turn_for("qwen3.5", tokenizers).forced_grammar(tok)
    own = CASES["qwen3_xml: open reasoning and a call"][1]
    assert accepts(grammar, tok, own)
    assert not accepts(grammar, tok, own.replace("Paris\n</parameter>", "Paris</parameter>\n</tool\n</parameter>"))
