"""What serving one stream costs beyond the step: the real engine thread, app and HTTP server over a
pipeline whose step only sleeps.

    python bench/serve_overhead.py [--step-ms 12] [--tokens 120] [--requests 20] [--json out.json]

The server process runs moeray's own serving path (cluster/serve_app.py's app under uvicorn, the
engine thread of cluster/engine_loop.py, the engine and scheduler with the default model's
tokenizer and chat template) over a pipeline that sleeps `--step-ms` per step and answers a fixed
text: no model, so whatever the process spends is the serving path's. One client streams chat
completions one at a time. Printed: the server's CPU per token (its CPU time over the run's tokens:
the engine thread's scheduling, postprocess and hand-off, the event loop's SSE writes), the ITL
p50 / p99 over the step's sleep (the latency the path adds), and TTFT. CPU time is counted, not
wall time, so a busy machine blurs it less than it blurs a served model's tok/s.

`--python PATH` runs the server with another interpreter (another checkout's venv: the same script
against that checkout's code, for a before / after in one sitting).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

TEXT = ("The waves of the ocean, a silent beauty,\nA gentle lapping of the shore,\nA reminder of the vastness "
        "of the sea,\nA place where dreams are born. ") * 40


class SleepPipeline:
    """A one-stage pipeline whose step sleeps `step_s` and answers the next token of a fixed text."""

    n_stages = 1

    def __init__(self, step_s: float, tokens: list[int], kv_blocks: int = 512):
        self.step_s, self.tokens, self.kv_blocks = step_s, tokens, kv_blocks
        self.pos: dict[int, int] = {}

    def submit(self, batch):
        from moeray.stages.runtime.step import StepOutput

        time.sleep(self.step_s)
        out = []
        wants = [p is not None and p is not False for p in batch.sample]  # params or None, or bools
        for slot, fresh, want in zip(batch.slots, batch.fresh, wants):
            if fresh:
                self.pos[slot] = 0
            if not want:
                out.append(None)
                continue
            out.append(self.tokens[self.pos[slot] % len(self.tokens)])
            self.pos[slot] += 1
        return StepOutput(out)

    def result(self, handle, timeout_s):
        return handle

    def recover(self):
        pass


def serve(port: int, step_ms: float) -> None:
    """The server process: the app over SleepPipeline, until killed."""
    import uvicorn

    from moeray.cluster import serve_app
    from moeray.cluster.config import EngineConfig, ServeOptions
    from moeray.cluster.engine import Engine
    from moeray.cluster.engine_loop import EngineLoop
    from moeray.cluster.service import Service
    from moeray.stages.gguf.default_model import default_model_path
    from moeray.stages.text.chat import chat_format
    from moeray.stages.text.tokenizer import Tokenizer

    path = str(default_model_path())
    tok = Tokenizer.from_gguf(path)
    service = object.__new__(Service)  # the attributes the app reads, without a model behind them
    service.opts = ServeOptions(local=True, metrics=False)
    service.model_name, service.created, service.path = "sleep", 0, path
    service.model_names = ["sleep"]
    service.chat = chat_format(tok.chat_template, "llama", None)
    service.tokenizer = tok = tok.with_rendered(service.chat.markers())
    cfg = EngineConfig(max_seqs=4, max_len=4096, micro_batches=1, kv_blocks=512)
    service.engine = Engine(SleepPipeline(step_ms / 1e3, tok.encode(TEXT, add_bos=False)), cfg, tok)
    service.metrics = service.poller = service.launched = None
    try:  # GET /metrics' registry, which every served request reports to (cluster/prometheus.py)
        from moeray.cluster.prometheus import ServedMetrics

        service.tokens_out = 0
        service.prometheus = ServedMetrics("sleep", lambda: service.loop.counts, lambda: {}, lambda: [],
                                           lambda: {}, lambda: {}, lambda: service.tokens_out)
    except ImportError:  # a checkout without it
        pass
    try:
        from moeray.cluster.timeline import TimelineLog

        service.timelines = TimelineLog()
    except ImportError:  # a checkout without request timelines
        pass
    service.loop = EngineLoop(service.engine, max_waiting=8).start()
    uvicorn.run(serve_app.build_app(service), host="127.0.0.1", port=port, log_level="warning",
                access_log=False, lifespan="off")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--step-ms", type=float, default=12.0, help="the pipeline's step (a sleep)")
    p.add_argument("--tokens", type=int, default=120, help="tokens a request")
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--python", action="append", default=[], metavar="[LABEL=]PATH",
                   help="the server's interpreter (repeatable: one run each); default this one")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    import psutil

    sys.path.insert(0, str(HERE))
    from stream_timeline import ask, client_figures

    from moeray.stages.runtime.transport import free_port

    rows = []
    for spec in args.python or [f"this checkout={sys.executable}"]:
        label, _, python = spec.rpartition("=")
        port = free_port()
        proc = subprocess.Popen([python or sys.executable, __file__, "--_serve", str(port), str(args.step_ms)],
                                stderr=subprocess.PIPE, start_new_session=True)
        try:
            deadline = time.monotonic() + 300
            while True:
                try:
                    ask(port, "sleep", 4, {})
                    break
                except OSError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise SystemExit(f"the server did not start: {proc.stderr.read().decode()[-2000:]}")
                    time.sleep(0.5)
            for _ in range(3):  # warm
                ask(port, "sleep", args.tokens, {})
            server = psutil.Process(proc.pid)
            t0, x0 = server.cpu_times(), server.num_ctx_switches()
            rs = [ask(port, "sleep", args.tokens, {}) for _ in range(args.requests)]
            t1, x1 = server.cpu_times(), server.num_ctx_switches()
            user, system = t1.user - t0.user, t1.system - t0.system
            cpu = user + system
        finally:
            proc.kill()
            proc.wait(30)
        fig = client_figures(rs)
        row = {"label": label or python, **fig, "cpu_us_per_token": cpu / fig["tokens"] * 1e6,
               "user_us_per_token": user / fig["tokens"] * 1e6, "system_us_per_token": system / fig["tokens"] * 1e6,
               "switches_per_token": (x1.voluntary + x1.involuntary - x0.voluntary - x0.involuntary) / fig["tokens"],
               "itl_over_step_ms": fig["itl_p50_ms"] - args.step_ms}
        rows.append(row)
        print(f"# {row['label']}: {row['cpu_us_per_token']:.0f} us CPU a token", file=sys.stderr, flush=True)
    print(f"a step of {args.step_ms} ms (a sleep), {args.tokens} tokens a request, {args.requests} requests, one client")
    print("| server | CPU per token (user + system) | context switches per token | ITL p50 | ITL p50 over the step "
          "| ITL p99 | TTFT p50 | tok/s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['label']} | {r['cpu_us_per_token']:.0f} us ({r['user_us_per_token']:.0f} + "
              f"{r['system_us_per_token']:.0f}) | {r['switches_per_token']:.1f} | {r['itl_p50_ms']:.2f} ms | "
              f"{r['itl_over_step_ms']:.2f} ms | {r['itl_p99_ms']:.2f} ms | {r['ttft_p50_ms']:.1f} ms | {r['tok_s']:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--_serve":
        serve(int(sys.argv[2]), float(sys.argv[3]))
        sys.exit(0)
    sys.exit(main())
