"""What the `openai` client receives, per chat family, for a served request with reasoning and a tool call.

    python bench/chat_families.py [--family qwen3 ...] [--json-out chat_families.json]

For each family: the tiny model of tests/chat_models.py (its architecture, its published template,
its special tokens; taught one tool loop in the family's own format, built once per machine and
cached), served by `moeray serve --local`; then, through the `openai` client, the question with one
tool and `tool_choice: "required"` (the grammar forces a call in the family's own format), whole
and streamed. Printed per family: the chat format moeray chose, the JSON body the client received
(as it came over the wire), and what the stream's deltas add up to.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the tiny family models and the serve launcher the tests use

from chat_models import FAMILIES, QUESTION, WEATHER, family_model  # noqa: E402
from serve_process import start_serve  # noqa: E402

from moeray.stages.runtime.transport import free_port  # noqa: E402


def request(family, client, stream: bool):
    """The question with the tool, a call required; the family's template variables as the loop was learned."""
    kw, variables = {}, dict(family.variables)
    if "reasoning_effort" in variables:
        kw["reasoning_effort"] = variables.pop("reasoning_effort")
    if variables:
        kw["extra_body"] = {"chat_template_kwargs": variables}
    return client.chat.completions.with_raw_response.create(
        model=family.name, messages=[{"role": "user", "content": QUESTION}], tools=[WEATHER], tool_choice="required",
        max_tokens=120, temperature=0, stream=stream, **kw)


def streamed_sum(raw) -> dict:
    """The stream's deltas added up as a client adds them: reasoning, content, each call's id, name and arguments."""
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in raw.parse():
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        reasoning += getattr(d, "reasoning_content", None) or ""
        content += d.content or ""
        for t in d.tool_calls or []:
            c = calls.setdefault(t.index, {"id": t.id, "name": t.function.name, "arguments": "", "fragments": 0})
            c["arguments"] += t.function.arguments or ""
            c["fragments"] += 1
        finish = chunk.choices[0].finish_reason or finish
    return {"reasoning_content": reasoning, "content": content, "tool_calls": list(calls.values()),
            "finish_reason": finish}


def serve_family(name: str) -> dict:
    import openai

    family = FAMILIES[name]
    path = family_model(family)
    server = start_serve([str(path), "--local", "--no-metrics", "--max-seqs", "2", "--max-len", "1024",
                          "--model-name", family.name, "--ready-timeout", "240"], free_port())
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        whole = request(family, client, stream=False)
        return {"family": name, "chat_format": family.format, "model": path.name,
                "response": json.loads(whole.http_response.text), "stream": streamed_sum(request(family, client, True))}
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", action="append", choices=list(FAMILIES), help="only these (default: all)")
    ap.add_argument("--json-out", type=Path, help="write every family's result here too")
    args = ap.parse_args()
    results = []
    for name in args.family or list(FAMILIES):
        r = serve_family(name)
        results.append(r)
        msg = r["response"]["choices"][0]["message"]
        print(f"## {name} (--chat-format {r['chat_format']})")
        print(json.dumps(r["response"], indent=2, ensure_ascii=False))
        s = r["stream"]
        calls = ", ".join(f"{c['name']}({c['arguments']}) id {c['id']} in {c['fragments']} deltas" for c in s["tool_calls"])
        same = (s["reasoning_content"] == (msg.get("reasoning_content") or "")
                and [c["arguments"] for c in s["tool_calls"]] == [c["function"]["arguments"] for c in msg["tool_calls"] or []])
        print(f"streamed: reasoning_content {s['reasoning_content']!r}; tool_calls {calls}; "
              f"finish_reason {s['finish_reason']}; same as the whole response: {same}\n")
    if args.json_out:
        args.json_out.write_text(json.dumps(results, indent=2, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
