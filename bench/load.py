"""Load test a running moeray server (or any OpenAI-compatible one).

    python bench/load.py http://127.0.0.1:8000 --clients 16 --duration 60 [--json out.json]
    python bench/load.py URL --clients 16 --system-prompt-tokens 300   # chat traffic, one system prompt

N clients, each sending streamed chat completions back to back for a bounded time. Prints
requests/s, output tokens/s, p50/p99 time to first token and inter-token latency, and errors.
Tokens are counted from each stream's `usage` (so text that arrives in one chunk is not
undercounted); latencies are measured at the client, over HTTP, as a user sees them.

--system-prompt-tokens N puts the same system prompt of about N tokens before every question
(chat traffic of one application): the table then adds the prompt tokens sent, those the server
reports as cached (`usage.prompt_tokens_details.cached_tokens`: its prefix reuse) and the prefill
tokens it really computed. Run it against `moeray serve` and `moeray serve --no-prefix-reuse`.

--forced-tokens makes every output token of client i the token FORCED_TOKEN + i (a logit bias of
+100), so two servers of the same file compute the same token streams. A random-weight shape file
(bench/shapes.py) has near-tied logits: each engine's greedy text differs from the first token,
its sequences then route to other experts, and a step of several sequences reads another number
of experts. With the streams forced, both servers do the same work; each client's own token keeps
the sequences apart, as different conversations are.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import threading
import time
from urllib.parse import urlparse

from results import write_results  # noqa: E402

FORCED_TOKEN = 1000  # client i's forced token with --forced-tokens: an ordinary word piece of every BPE vocabulary here

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a CPU cache is in two sentences.",
    "List three uses of copper.",
    "Why is the sky blue?",
    "Give me a short tip for learning Python.",
    "What does a pipeline stage do?",
    "Name a famous painting and its painter.",
]


def system_prompt(n_tokens: int) -> str:
    """About n_tokens of one fixed system prompt (numbered house rules: ~10 tokens a rule with a
    BPE tokenizer such as SmolLM2's; the server's usage says exactly how many)."""
    rules = ["answer in plain words", "keep it short", "say so when you do not know", "never invent a source",
             "use metric units", "be polite", "give one example when it helps", "avoid jargon"]
    lines = ["You are the assistant of a small engineering team. Follow these house rules."]
    for i in range(max(0, (n_tokens - 14) // 10)):
        lines.append(f"Rule {i + 1}: {rules[i % len(rules)]}.")
    return "\n".join(lines)


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


class Client(threading.Thread):
    def __init__(self, i: int, url, model: str, args, stop_at: float):
        super().__init__(daemon=True)
        self.i, self.url, self.model, self.args, self.stop_at = i, url, model, args, stop_at
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.requests = self.tokens = 0
        self.prompt_tokens = self.cached_tokens = 0
        self.errors: list[str] = []

    def run(self) -> None:
        n = 0
        while time.monotonic() < self.stop_at:
            prompt = PROMPTS[(self.i + n) % len(PROMPTS)]
            n += 1
            try:
                self.one(prompt)
            except Exception as exc:  # noqa: BLE001 - counted, reported
                self.errors.append(f"{exc.__class__.__name__}: {exc}"[:200])
                time.sleep(0.2)

    def one(self, prompt: str) -> None:
        messages = [{"role": "user", "content": prompt}]
        if self.args.system:
            messages.insert(0, {"role": "system", "content": self.args.system})
        request = {"model": self.model, "messages": messages,
                   "max_tokens": self.args.max_tokens, "temperature": self.args.temperature,
                   "stream": True, "stream_options": {"include_usage": True}}
        if self.args.forced_tokens:
            request["logit_bias"] = {str(FORCED_TOKEN + self.i): 100}
        body = json.dumps(request)
        headers = {"Content-Type": "application/json"}
        if self.args.api_key:
            headers["Authorization"] = f"Bearer {self.args.api_key}"
        conn = http.client.HTTPConnection(self.url.hostname, self.url.port or 80, timeout=self.args.timeout)
        t0 = time.perf_counter()
        try:
            conn.request("POST", "/v1/chat/completions", body=body, headers=headers)
            r = conn.getresponse()
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {r.read()[:200].decode(errors='replace')}")
            last, usage = None, None
            for line in r:  # bounded by the socket timeout and the server's max_tokens
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise RuntimeError(chunk["error"].get("message", "error in stream"))
                if chunk.get("usage") and not chunk.get("choices"):
                    usage = chunk["usage"]
                if any((c.get("delta") or {}).get("content") for c in chunk.get("choices", [])):
                    now = time.perf_counter()
                    if last is None:
                        self.ttft.append(now - t0)
                    else:
                        self.itl.append(now - last)
                    last = now
            self.requests += 1
            self.tokens += int(usage["completion_tokens"]) if usage else 0
            if usage:
                self.prompt_tokens += int(usage.get("prompt_tokens", 0))
                self.cached_tokens += int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
        finally:
            conn.close()


def model_id(url, api_key: str | None, timeout: float) -> str:
    conn = http.client.HTTPConnection(url.hostname, url.port or 80, timeout=timeout)
    conn.request("GET", "/v1/models", headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    r = conn.getresponse()
    data = json.loads(r.read())
    conn.close()
    if r.status != 200:
        raise SystemExit(f"GET /v1/models: HTTP {r.status}: {data}")
    return data["data"][0]["id"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("url", help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--duration", type=float, default=60.0, help="seconds to start new requests")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--model", help="model id (default: the server's first)")
    p.add_argument("--api-key", default=os.environ.get("MOERAY_API_KEY"))
    p.add_argument("--timeout", type=float, default=120.0, help="socket timeout per request")
    p.add_argument("--system-prompt-tokens", type=int, default=0,
                   help="the same system prompt of about this many tokens before every question (default: none)")
    p.add_argument("--forced-tokens", action="store_true",
                   help="client i's every output token forced to token %d + i (a logit bias): the same token "
                        "streams on every server (random-weight shape files)" % FORCED_TOKEN)
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)
    args.system = system_prompt(args.system_prompt_tokens) if args.system_prompt_tokens > 0 else ""

    url = urlparse(args.url)
    model = args.model or model_id(url, args.api_key, args.timeout)
    stop_at = time.monotonic() + args.duration
    clients = [Client(i, url, model, args, stop_at) for i in range(args.clients)]
    t0 = time.perf_counter()
    for c in clients:
        c.start()
    for c in clients:  # each finishes its last request: at most one timeout past the duration
        c.join(args.duration + args.timeout + 10)
    wall = time.perf_counter() - t0

    ttft = [x for c in clients for x in c.ttft]
    itl = [x for c in clients for x in c.itl]
    errors = [e for c in clients for e in c.errors]
    requests, tokens = sum(c.requests for c in clients), sum(c.tokens for c in clients)
    prompt_tokens, cached = sum(c.prompt_tokens for c in clients), sum(c.cached_tokens for c in clients)
    result = {
        "url": args.url, "model": model, "clients": args.clients, "duration_s": round(wall, 2),
        "max_tokens": args.max_tokens, "requests": requests, "errors": len(errors),
        "requests_per_s": requests / wall, "output_tokens_per_s": tokens / wall, "output_tokens": tokens,
        "ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99),
        "itl_p50_s": percentile(itl, 0.5), "itl_p99_s": percentile(itl, 0.99),
        "itl_mean_s": statistics.fmean(itl) if itl else float("nan"),
        "prompt_tokens": prompt_tokens, "cached_prompt_tokens": cached,
        "prefill_tokens_computed": prompt_tokens - cached,
        "system_prompt_tokens": args.system_prompt_tokens,
        "first_errors": errors[:5],
    }
    print(f"{model} at {args.url}: {args.clients} clients for {wall:.1f} s, max_tokens {args.max_tokens}")
    print("| clients | req/s | out tok/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | requests | errors |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(f"| {args.clients} | {result['requests_per_s']:.2f} | {result['output_tokens_per_s']:.1f} | "
          f"{result['ttft_p50_s'] * 1e3:.0f} ms | {result['ttft_p99_s'] * 1e3:.0f} ms | "
          f"{result['itl_p50_s'] * 1e3:.0f} ms | {result['itl_p99_s'] * 1e3:.0f} ms | {requests} | {len(errors)} |")
    if prompt_tokens:
        print(f"prompt tokens {prompt_tokens} ({prompt_tokens / max(requests, 1):.0f} a request), cached {cached} "
              f"({100 * cached / prompt_tokens:.1f}%): prefill computed {prompt_tokens - cached} tokens")
    for e in errors[:5]:
        print(f"  error: {e}", file=sys.stderr)
    if args.json:
        write_results(args.json, result)
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())
