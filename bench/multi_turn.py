"""A conversation's second turn on a hybrid model: time to its first token in moeray with state
checkpoints (cluster/state_checkpoints.py) and without them (every prompt prefilled whole, what
hybrid models did before), and in llama-server (its context checkpoints and live slot), on the
same file with the same threads, in the same run.

Turn 1 sends a prompt of --prompt-tokens and takes --answer-tokens of greedy answer; turn 2 sends
that prompt, the answer's own tokens and --new-tokens more, and asks for one token: its time is
the prefill of whatever the engine could not reuse. moeray runs in this process over the pipeline
`moeray serve --local` builds (LocalPipeline.from_file); its time is the engine's, from the
request's arrival to its first token. llama-server runs as a child over HTTP (/completion with
token ids, one slot); its time is its own `timings.prompt_ms` and, beside it, the request's wall time.

    python bench/multi_turn.py --model F.gguf [--prompt-tokens 1024] [--answer-tokens 32]
                               [--new-tokens 64] [--threads 2] [--llama-server PATH] [--json out.json]
"""
from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from results import write_results  # noqa: E402

from moeray.environment import llama_cpp_tool  # noqa: E402



def moeray_turns(path: str, prompt: list[int], n_answer: int, new: list[int], checkpoints: int | None) -> dict:
    """Turn 1 then turn 2 through a one-process engine; checkpoints None: as the local plan
    chooses (moeray serve --local), 0: none."""
    import torch

    from moeray.cluster.config import EngineConfig
    from moeray.cluster.placement import local_kv_plan
    from moeray.cluster.engine import Engine
    from moeray.cluster.local_pipeline import LocalPipeline
    from moeray.stages.blocks.kv_cache import blocks_for
    from moeray.stages.gguf.reader import read_gguf_header
    from moeray.stages.text.sampling import SamplingParams

    total = len(prompt) + n_answer + len(new) + 16
    cfg = EngineConfig(max_seqs=1, max_len=total, micro_batches=1, kv_blocks=blocks_for(total) + 8,
                       state_checkpoints=checkpoints)
    budget = 4 << 30  # moeray serve --local's device: its trunk, KV and states; the experts on the host path
    kv = local_kv_plan(read_gguf_header(path).config, cfg, budget)
    pipe = LocalPipeline.from_file(path, kv.blocks, budget, max_seqs=1, state_checkpoints=kv.checkpoints)
    eng = Engine(pipe, EngineConfig(**{**cfg.__dict__, "kv_blocks": kv.blocks, "state_checkpoints": kv.checkpoints}))
    greedy = SamplingParams(max_tokens=n_answer, ignore_eos=True)
    with torch.inference_mode():
        eng.generate([prompt[:64]], SamplingParams(max_tokens=2, ignore_eos=True))  # warm the graphs
        t = time.perf_counter()
        first = eng.generate([prompt], greedy)[0]
        turn1 = time.perf_counter() - t
        second = eng.add(prompt + first.output + new, SamplingParams(max_tokens=1, ignore_eos=True))
        eng.run([second])
    return {"engine": "moeray", "checkpoints": kv.checkpoints, "turn1_s": turn1,
            "turn2_ttft_s": second.t_first - second.t_arrive, "turn2_prompt": len(second.prompt),
            "turn2_reused": second.cached_tokens, "turn2_prefilled": len(second.prompt) - second.cached_tokens}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(port: int, body: dict, timeout: float) -> tuple[dict, float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    t = time.perf_counter()
    conn.request("POST", "/completion", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = json.loads(resp.read())
    wall = time.perf_counter() - t
    if resp.status != 200:
        raise RuntimeError(f"llama-server: {resp.status} {data}")
    return data, wall


@contextlib.contextmanager
def llama_server(exe: str, path: str, threads: int, ctx: int, extra: tuple[str, ...] = ()):
    """llama-server on `path` with one slot of `ctx` tokens, on a free port (yielded) once healthy."""
    port = _free_port()
    proc = subprocess.Popen([exe, "-m", path, "-t", str(threads), "-tb", str(threads), "-c", str(ctx), "-np", "1",
                             "--host", "127.0.0.1", "--port", str(port), *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("llama-server did not start")
            time.sleep(1)
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def llama_server_turns(exe: str, path: str, threads: int, prompt: list[int], n_answer: int,
                       new: list[int]) -> dict | None:
    if not (exe and Path(exe).exists()):
        return None
    ctx = len(prompt) + n_answer + len(new) + 64
    with llama_server(exe, path, threads, ctx) as port:
        base = {"temperature": 0, "ignore_eos": True, "cache_prompt": True, "return_tokens": True}
        _post(port, {**base, "prompt": prompt[:64], "n_predict": 2}, 3600)  # warm-up
        t = time.perf_counter()
        first, _ = _post(port, {**base, "prompt": prompt, "n_predict": n_answer}, 3600)
        turn1 = time.perf_counter() - t
        answer = first["tokens"]
        second, wall = _post(port, {**base, "prompt": prompt + answer + new, "n_predict": 1}, 3600)
        tm = second["timings"]
        n = len(prompt) + len(answer) + len(new)
        return {"engine": "llama-server", "turn1_s": turn1, "turn2_ttft_s": tm["prompt_ms"] / 1e3,
                "turn2_wall_s": wall, "turn2_prompt": n, "turn2_prefilled": tm["prompt_n"],
                "turn2_reused": n - tm["prompt_n"], "same_answer_length": len(answer) == n_answer}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a hybrid GGUF (qwen3next, qwen35moe)")
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-server", default=llama_cpp_tool("llama-server"),
                    help="llama.cpp's llama-server (default: in the folder LLAMA_CPP_BIN names, else on PATH)")
    ap.add_argument("--no-llama-cpp", action="store_true")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    import torch

    from decode import prompt_ids
    from moeray.stages.kernels.threads import set_threads
    from moeray.stages.text.tokenizer import Tokenizer

    torch.set_num_threads(args.threads)
    set_threads(args.threads)
    tok = Tokenizer.from_gguf(args.model)
    prompt = prompt_ids(tok, args.prompt_tokens, 0)
    new = prompt_ids(tok, args.new_tokens, 7)
    rows = [moeray_turns(args.model, prompt, args.answer_tokens, new, 0),
            moeray_turns(args.model, prompt, args.answer_tokens, new, None)]
    if not args.no_llama_cpp:
        got = llama_server_turns(args.llama_server, args.model, args.threads, prompt, args.answer_tokens, new)
        if got is not None:
            rows.append(got)
    ref = next((r for r in rows if r["engine"] == "llama-server"), None)
    print(f"model {Path(args.model).name}, {args.threads} threads; turn 1: {args.prompt_tokens} prompt tokens, "
          f"{args.answer_tokens} answered; turn 2: those + {args.new_tokens} new")
    print(f"{'engine':<13} {'checkpoints':>11} {'turn 1 s':>9} {'turn 2 prefilled':>17} {'TTFT s':>8} {'x llama-server':>15}")
    for r in rows:
        x = f"{ref['turn2_ttft_s'] / r['turn2_ttft_s']:.2f}" if ref and r is not ref else "-"
        print(f"{r['engine']:<13} {r.get('checkpoints', '-')!s:>11} {r['turn1_s']:>9.1f} "
              f"{r['turn2_prefilled']:>9} of {r['turn2_prompt']:<5} {r['turn2_ttft_s']:>8.2f} {x:>15}")
    if args.json:
        write_results(args.json, {"model": args.model, "threads": args.threads, "prompt_tokens": args.prompt_tokens,
                                  "answer_tokens": args.answer_tokens, "new_tokens": args.new_tokens, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
