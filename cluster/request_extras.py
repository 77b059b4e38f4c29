"""What a request asks beyond plain text: log-probabilities, structured output, tools and the
chat template's variables.

The server (cluster/serve_app.py) turns these request fields into SamplingParams (`logprobs`,
`grammar`, `reasoning`: they act on the last stage, stages/runtime/runner.py StageRunner.sample) and
the engine's TokenLogprobs back into OpenAI's response shapes. Tools, their forced calls and the
reply's reading are the model's chat format's (stages/text/chat/); the reasoning budget is
stages/text/reasoning_budget.py's. Every field either does what it asks or is a 400 naming it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from moeray.cluster import openai_schema as oa
from moeray.stages.text.chat import Turn
from moeray.stages.text.grammar import GrammarError, check_grammar, schema_from_response_format
from moeray.stages.text.reasoning_budget import ReasoningBudget
from moeray.stages.text.sampling import TokenLogprob

# Reasoning efforts as thinking tokens: the chat route's reasoning_effort (for a family whose template
# does not read the effort itself; gpt-oss's does: there it reaches the template and sets no budget),
# Responses' reasoning.effort and Anthropic's output_config.effort. None: the server's default.
EFFORT_BUDGETS: dict[str, Optional[int]] = {
    "none": 0, "minimal": 256, "low": 1024, "medium": 8192, "high": 24576, "xhigh": 32768, "max": None,
}
# chat_template_kwargs keys read as a reasoning budget (they reach the template too).
BUDGET_VARIABLES = ("reasoning_budget", "thinking_budget")


@dataclass
class Extras:
    logprobs: Optional[int] = None  # alternatives per token; None: no log-probabilities
    grammar: Optional[str] = None  # the llguidance grammar the output must follow
    tools: Optional[list[dict]] = None  # passed to the chat template; the output is parsed for calls
    grammar_param: str = "response_format"  # the request field the grammar came from
    read_calls: bool = False  # the reply is read for tool calls (tools given, tool_choice not "none")
    forced: Optional[tuple[Optional[str], bool]] = None  # a call tool_choice forces: (function or None: any, parallel)
    variables: dict = dataclasses.field(default_factory=dict)  # chat_template_kwargs and reasoning_effort
    # Tokens the reply may think before its thinking block is closed for it: None the server's default
    # (--reasoning-budget, unlimited unless set), -1 unlimited, 0 no thinking. Set from
    # thinking.budget_tokens, reasoning.effort, chat_template_kwargs or reasoning_effort by the route
    # that parsed the request (chat_budget reads the chat route's fields).
    reasoning_budget: Optional[int] = None
    parallel: bool = True  # parallel_tool_calls: more than one call in a reply
    turn: Optional[Turn] = None  # the rendered chat prompt and how its reply is read (set by the server)
    budget: Optional[ReasoningBudget] = None  # the budget as the last stage enforces it (force_call builds it)


def chat_extras(service, body: oa.ChatCompletionRequest, error) -> Extras:
    """`error(message, param)` builds the 400 to raise."""
    out = Extras(variables=dict(body.chat_template_kwargs or {}), parallel=body.parallel_tool_calls is not False)
    if body.reasoning_effort is not None:
        out.variables["reasoning_effort"] = body.reasoning_effort
    out.reasoning_budget = chat_budget(service.chat, body, error)
    if body.top_logprobs is not None and not body.logprobs:
        raise error("top_logprobs needs logprobs: true", "top_logprobs")
    if body.logprobs:
        out.logprobs = body.top_logprobs or 0
    choice = body.tool_choice
    if body.tools is None and choice not in (None, "none", "auto"):
        raise error("tool_choice needs tools: give the functions the model may call", "tool_choice")
    if body.tools and choice != "none":
        problem = service.chat.tools_problem(service.tokenizer)
        if problem is not None:
            raise error(problem, "tools")
        out.tools = [t.model_dump(exclude_none=True) for t in body.tools]
        out.read_calls = True
        names = [t.function.name for t in body.tools]
        if isinstance(choice, oa.NamedToolChoice):
            name = choice.function.get("name")
            if name not in names:
                raise error(f"tool_choice names the function {name!r}, which is not among the tools {names}",
                            "tool_choice")
            out.forced = (name, False)
        elif choice == "required":
            out.forced = (None, body.parallel_tool_calls is not False)
    out.grammar = _response_format_grammar(body, error)
    if out.forced is not None and out.grammar is not None:
        raise error("response_format cannot be combined with a tool_choice that forces a call", "response_format")
    return out


def chat_budget(fmt, body: oa.ChatCompletionRequest, error) -> Optional[int]:
    """The reasoning budget a chat request asks for (None: the server's default): vLLM's
    `thinking_token_budget` or llama-server's `reasoning_budget_tokens` (`thinking_budget_tokens`), else a budget key of
    `chat_template_kwargs`, else `reasoning_effort` (EFFORT_BUDGETS) where the template does not
    read it."""
    for name in ("thinking_token_budget", "reasoning_budget_tokens", "thinking_budget_tokens"):
        value = getattr(body, name, None)
        if value is not None:
            return checked_budget(value, name, error)
    variables = body.chat_template_kwargs or {}
    for key in BUDGET_VARIABLES:
        if variables.get(key) is not None:
            return checked_budget(variables[key], "chat_template_kwargs", error, f"chat_template_kwargs.{key}")
    if body.reasoning_effort is not None and not fmt.reads_effort:
        return EFFORT_BUDGETS[body.reasoning_effort]
    return None


def checked_budget(value, param: str, error, name: Optional[str] = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < -1:
        raise error(f"{name or param} must be a number of tokens: -1 (unlimited), 0 (no thinking) or more, "
                    f"got {value!r}", param)
    return value


def budget_tokens(service, extras: Extras) -> Optional[int]:
    """The thinking tokens this request may spend: its own budget, else the server's (None: unlimited)."""
    tokens = extras.reasoning_budget
    if tokens is None:
        tokens = getattr(getattr(service, "opts", None), "reasoning_budget", -1)
    return None if tokens is None or tokens < 0 else tokens


def force_call(service, extras: Extras, error) -> None:
    """What the rendered turn decides (so it must be rendered first): the grammar of the call
    tool_choice forces, in the model's own format, after the reasoning where the rendered prompt
    leaves the model reasoning; under tool_choice auto, the grammar of the generic format's reply;
    and the reasoning budget, closed with the family's own marker."""
    tokens = budget_tokens(service, extras)
    if tokens is not None:
        extras.budget = extras.turn.reasoning_budget(service.tokenizer, tokens)
    try:
        if extras.forced is not None:
            name, parallel = extras.forced
            extras.grammar = extras.turn.forced_grammar(service.tokenizer, name, parallel)
            extras.grammar_param = "tool_choice"
        elif extras.read_calls and extras.grammar is None:
            extras.grammar = extras.turn.auto_grammar(service.tokenizer, extras.parallel)
            if extras.grammar is not None:
                extras.grammar_param = "tools"
    except (GrammarError, ValueError) as exc:  # llguidance refuses a schema it cannot compile
        raise error(f"tools: a function's parameters are not a usable JSON schema: {_schema_problem(exc)}",
                    "tools") from None


def _schema_problem(exc: Exception) -> str:
    """What the grammar engine says of a schema, without the grammar it quotes."""
    text = str(exc)
    marker = "failed to compile JSON schema: "
    return text.split(marker, 1)[1].splitlines()[0] if marker in text else text.splitlines()[0]


def completion_extras(service, body: oa.CompletionRequest, error) -> Extras:
    return Extras(logprobs=body.logprobs, grammar=_response_format_grammar(body, error))


def _response_format_grammar(body, error) -> Optional[str]:
    if body.response_format is None:
        return None
    fmt = body.response_format.model_dump(by_alias=True)
    try:
        return schema_from_response_format(fmt)
    except GrammarError as exc:
        raise error(f"response_format: {exc}", "response_format") from None


def _check(service, grammar: str, param: str, error) -> None:
    try:
        check_grammar(grammar, service.tokenizer, getattr(service, "n_vocab", None))
    except GrammarError as exc:
        if param in ("tools", "tool_choice"):  # a call's grammar: its functions' schemas, not the grammar quoted
            raise error(f"tools: a function's parameters are not a usable JSON schema: {_schema_problem(exc)}",
                        "tools") from None
        raise error(f"{param}: {exc}", param) from None


def check_extras(service, extras: Extras, error) -> None:
    """Compile the grammar once here (a bad schema is the client's 400, not a failed step)."""
    if extras.grammar is not None:
        _check(service, extras.grammar, extras.grammar_param, error)


def apply(params, extras: Extras):
    return dataclasses.replace(params, logprobs=extras.logprobs, grammar=extras.grammar, reasoning=extras.budget)


# ---------------------------------------------------------------- responses


def _visible(tokenizer, lps: list[TokenLogprob]) -> list[TokenLogprob]:
    """The end token that finished a sequence is not text: it gets no entry, as its text is empty."""
    return [lp for lp in lps if lp.token not in tokenizer.end_ids]


def chat_logprobs(tokenizer, lps: list[TokenLogprob]) -> oa.ChatLogprobs:
    def entry(token: int, logprob: float):
        text = tokenizer.token_text(token)
        return text, logprob, list(text.encode("utf-8"))

    content = []
    for lp in _visible(tokenizer, lps):
        text, logprob, raw = entry(lp.token, lp.logprob)
        top = [oa.TopLogprob(token=t, logprob=v, bytes=b) for t, v, b in (entry(i, v) for i, v in lp.top)]
        content.append(oa.TokenLogprobEntry(token=text, logprob=logprob, bytes=raw, top_logprobs=top))
    return oa.ChatLogprobs(content=content)


def completion_logprobs(tokenizer, lps: list[TokenLogprob], offset: int = 0) -> oa.CompletionLogprobs:
    """OpenAI's legacy shape; `text_offset` counts characters from the start of the completion
    (`offset`: characters already sent in earlier stream chunks)."""
    out = oa.CompletionLogprobs()
    for lp in _visible(tokenizer, lps):
        text = tokenizer.token_text(lp.token)
        out.tokens.append(text)
        out.token_logprobs.append(lp.logprob)
        out.top_logprobs.append({tokenizer.token_text(i): v for i, v in lp.top})
        out.text_offset.append(offset)
        offset += len(text)
    return out
