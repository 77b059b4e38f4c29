"""What the sampling parameters cost the last stage per step: `sample()` on a batch of rows.

    python bench/sampling.py --rows 16

The rows are real: the embedded default model's logits (49,152 tokens) after `--rows` different
prompts. For each mix of parameters, the median time of one `sample()` call (CPU, float32, one
torch thread), every penalised row's TokenHistory holding a 1,000-token prompt and a 1,000-token
output. The plain mixes (greedy; temperature and top-p) are the yardsticks: the table gives each
mix's time and its extra per row over its yardstick, beside the model's own decode step for the
same rows (`StageModel.step`, the whole model in this process).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from moeray.stages.text.sampling import SamplingParams, TokenHistory, sample

from results import write_results  # noqa: E402

MIXES = {
    "greedy": SamplingParams(),
    "greedy + penalties": SamplingParams(repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5),
    "greedy + logit_bias (10 ids)": SamplingParams(logit_bias={i * 97: 5.0 for i in range(10)}),
    "sampled (T, top_p)": SamplingParams(temperature=0.8, top_p=0.95, seed=1),
    "sampled + top_k, min_p": SamplingParams(temperature=0.8, top_p=0.95, top_k=20, min_p=0.05, seed=1),
    "sampled + every field": SamplingParams(temperature=0.8, top_p=0.95, top_k=20, min_p=0.05, seed=1,
                                            repetition_penalty=1.1, presence_penalty=1.5, frequency_penalty=0.5,
                                            logit_bias={i * 97: 5.0 for i in range(10)}),
}


PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "My favourite fruit is",
           "The weather today", "In 1969, the first", "Water boils at", "A good book is", "The best way to learn",
           "Cats and dogs", "import numpy as", "The sun rises in the", "Music makes people", "Paris is known for",
           "The recipe needs", "Tomorrow I will"]


def real_logits(rows: int) -> tuple[torch.Tensor, float]:
    """The default model's logits after `rows` prompts, and the seconds of one decode step of them."""
    from moeray.stages.gguf.default_model import default_model_path
    from moeray.stages.runtime.model import load_model
    from moeray.stages.text.tokenizer import Tokenizer

    path = str(default_model_path(quiet=True))
    model, tok = load_model(path), Tokenizer.from_gguf(path)
    prompts = [tok.encode(PROMPTS[i % len(PROMPTS)]) for i in range(rows)]
    kv = model.new_kv_cache(rows, 64)
    logits = model.step(prompts, list(range(rows)), kv)
    nxt = [[int(t)] for t in logits.argmax(-1)]
    times = []
    for _ in range(5):
        t = time.perf_counter()
        model.step(nxt, list(range(rows)), kv)
        times.append(time.perf_counter() - t)
    return logits.float(), statistics.median(times)


def time_mix(params: SamplingParams, logits: torch.Tensor, reps: int) -> float:
    rows, vocab = logits.shape
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (1000,), generator=g).tolist()
    output = torch.randint(0, vocab, (1000,), generator=g).tolist()
    histories = [TokenHistory(vocab, prompt, output) if params.needs_history else None for _ in range(rows)]
    gens = [params.new_generator() for _ in range(rows)]
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        sample(logits, [params] * rows, gens, None, histories)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--threads", type=int, default=1, help="torch threads (a stage shares its cores with ggml)")
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    logits, decode_s = real_logits(args.rows)
    torch.set_num_threads(args.threads)  # loading may have changed it
    rows = []
    print(f"the model's decode step for these {args.rows} rows: {decode_s * 1e3:.1f} ms")
    print(f"| parameters | sample(), {args.rows} rows | extra per row over its plain mix |")
    print("|---|---|---|")
    base = None
    for name, params in MIXES.items():
        s = time_mix(params, logits, args.reps)
        if name in ("greedy", "sampled (T, top_p)"):
            base = s
        extra = (s - base) / args.rows
        rows.append(dict(mix=name, step_s=s, extra_per_row_s=extra, decode_s=decode_s))
        print(f"| {name} | {s * 1e3:.2f} ms | {extra * 1e6:+.0f} µs |", flush=True)
    if args.json:
        write_results(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
