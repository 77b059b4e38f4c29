"""Where one prompt's prefill goes in moeray, layer kind by layer kind, on a GGUF (a real-width cut
from bench/shapes.py is what it is for): wall AND CPU time of each layer's graph call, grouped by the
layer's token mixer (Gated DeltaNet, attention, ...), with the routed experts either inside each
layer's graph (the served path) or, with --split, run after it so that they are timed apart from
the trunk (routing, shared expert and norms stay in the trunk's graph).

CPU seconds are what this process's threads spent (time.process_time): on a machine that other
jobs keep busy they move far less than wall time, so they are the figure to compare engines by.

    python bench/prefill_profile.py --model F.gguf --tokens 512 [--split] [--reps 2] [--threads 2] [--json out.json]
    python bench/prefill_profile.py --model F.gguf --kernels [--llama-bin DIR] [--json out.json]

--kernels runs both engines under `perf record` (Linux perf, cpu-clock samples: CPU time, so a busy
machine moves it little) and prints CPU seconds per prefill by kernel class side by side: moeray's
timed prefills only (this script in a child, perf enabled around them through its control fifo,
--perf-ctl) and `llama-bench -p N -n 0 -r 1` (its warm-up prefill and its one repetition, divided
by two; its model load lands in "other", so llama.cpp's "other" is an upper bound). This is the
table that says which kernel a gap is in (docs/performance-families.md, the Qwen3.6 prefill).
`make venv`'s ggml is stripped, so perf names none of moeray's kernels (they land in "other"): for
this table run it over an unstripped build, `SKBUILD_INSTALL_STRIP=false CMAKE_ARGS="<the Makefile's
GGML_CMAKE_ARGS>" python stages/kernels/ggml_build.py install --target build/ggml-sym`, with
PYTHONPATH=build/ggml-sym. llama-bench comes from --llama-bin, else the folder LLAMA_CPP_BIN names,
else PATH.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from results import write_results  # noqa: E402

from moeray.environment import llama_cpp_tool  # noqa: E402


def layer_kind(layer) -> str:
    return type(layer.attn).__name__


def profile_prefill(path: str, n_tokens: int, reps: int = 2, split: bool = False,
                    perf_ctl: str | None = None) -> dict:
    """ms (wall and CPU) per prefill of n_tokens, in total and per layer kind; the best of `reps`
    prefills (each on a fresh cache slot) after a warm-up prefill of the same length."""
    from decode import prompt_ids
    from moeray.stages.blocks import moe
    from moeray.stages.runtime import trunk_graph
    from moeray.stages.runtime.model import load_model
    from moeray.stages.text.tokenizer import Tokenizer

    model = load_model(path)
    if split:
        model.fuse_moe = False  # routed experts after each layer's graph: timed on their own
    kinds = [layer_kind(l) for l in model.layers]
    ids = prompt_ids(Tokenizer.from_gguf(path), n_tokens, 0)
    spent: dict[str, list[float]] = {}

    def add(part: str, wall: float, cpu: float) -> None:
        w, c = spent.setdefault(part, [0.0, 0.0])
        spent[part] = [w + wall, c + cpu]

    real_layer = trunk_graph.TrunkGraphs.layer
    real_after = moe.MoEBlock.after_graph
    calls = {"i": 0}

    def layer(self, step, x, r, spec, kv, **kw):
        i = calls["i"] % len(kinds)
        calls["i"] += 1
        w, c = time.perf_counter(), time.process_time()
        out = real_layer(self, step, x, r, spec, kv, **kw)
        add(f"layer graph: {kinds[i]}", time.perf_counter() - w, time.process_time() - c)
        return out

    def after_graph(self, *a, **kw):
        w, c = time.perf_counter(), time.process_time()
        out = real_after(self, *a, **kw)
        add("routed experts (after the graph)", time.perf_counter() - w, time.process_time() - c)
        return out

    def one_prefill() -> tuple[float, float]:
        kv = model.new_kv_cache(1, n_tokens + 8)
        calls["i"] = 0
        w, c = time.perf_counter(), time.process_time()
        model.step([ids], [0], kv)
        return time.perf_counter() - w, time.process_time() - c

    trunk_graph.TrunkGraphs.layer, moe.MoEBlock.after_graph = layer, after_graph
    ctl = open(perf_ctl, "w") if perf_ctl else None
    try:
        one_prefill()  # warm-up: graphs built, pages touched
        best = None
        for _ in range(reps):
            spent.clear()
            if ctl:
                ctl.write("enable\n"); ctl.flush()
            got = one_prefill()
            if ctl:
                ctl.write("disable\n"); ctl.flush()
            if best is None or got[1] < best[0][1]:
                best = (got, {k: list(v) for k, v in spent.items()})
    finally:
        trunk_graph.TrunkGraphs.layer, moe.MoEBlock.after_graph = real_layer, real_after
        if ctl:
            ctl.close()
    (wall, cpu), parts = best
    parts["other (embedding, head, python)"] = [wall - sum(v[0] for v in parts.values()),
                                                cpu - sum(v[1] for v in parts.values())]
    return {"tokens": n_tokens, "wall_ms": 1e3 * wall, "cpu_ms": 1e3 * cpu, "tok_s": n_tokens / wall,
            "cpu_tok_s": n_tokens / cpu, "layers": {k: kinds.count(k) for k in dict.fromkeys(kinds)},
            "parts": {k: (1e3 * w, 1e3 * c) for k, (w, c) in parts.items()}}


# Kernel classes of `perf report --sort dso,sym` lines, first match wins. The vec_dot kernels are
# ggml's row-by-row matmul (every row of W times every token, the weight row decoded per token);
# tiled_* is llama.cpp's newer tiled GEMM for K / IQ quants (the weight tile decoded once for 8+
# tokens), tinyBLAS llamafile's sgemm (Q8_0, Q4_0, float), ggml_gemm/gemv the repacked layouts'.
KERNEL_CLASSES = [
    (r"tinyBLAS", "matmul: llamafile sgemm (tinyBLAS)"),
    (r"\btiled_|_tiled_one_expert|mul_mat_id_tiled|mul_mat_tiled", "matmul: tiled GEMM (K / IQ quants)"),
    (r"ggml_gem[mv]_", "matmul: repacked GEMM / GEMV"),
    (r"ggml_vec_dot_(\w+?)_q8", "matmul: vec_dot {0}"),
    (r"ggml_vec_dot_f(16|32)", "matmul: vec_dot f32 / f16 (attention, delta rule's small products)"),
    (r"gated_delta_net", "Gated DeltaNet rule (ggml_gated_delta_net)"),
    (r"ssm_conv", "short conv (ggml_ssm_conv)"),
    (r"flash_attn", "flash attention"),
    (r"quantize_row", "activations quantised for the matmuls"),
    (r"ggml_barrier|libgomp", "threads waiting (barrier / OpenMP spin)"),
]


def kernel_table(perf_data: str, prefills: int):
    """(kernel class, CPU seconds per prefill) for each symbol of a perf.data of cpu-clock samples."""
    import re
    import subprocess

    out = subprocess.run(["perf", "report", "-i", perf_data, "--sort", "dso,sym", "--stdio", "-n", "-F",
                          "sample,dso,sym"], capture_output=True, text=True, check=True).stdout
    freq = sample_hz(perf_data)
    for line in out.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        parts = line.split(None, 2)
        if len(parts) < 3 or not parts[0].isdigit():
            continue
        n, dso, sym = int(parts[0]), parts[1], parts[2]
        label = "other (python, ggml's small ops; llama.cpp: its load too)"
        for pattern, name in KERNEL_CLASSES:
            m = re.search(pattern, f"{dso} {sym}")
            if m:
                label = name.format(*m.groups())
                break
        yield label, n / freq / prefills


def sample_hz(perf_data: str) -> float:
    import re
    import subprocess

    head = subprocess.run(["perf", "report", "-i", perf_data, "--header-only"], capture_output=True,
                          text=True).stdout
    m = re.search(r"sample_freq \} = (\d+)", head) or re.search(r"freq = (\d+)", head)
    return float(m.group(1)) if m else PERF_HZ


PERF_HZ = 499


def compare_kernels(model: str, tokens: int, threads: int, llama_bench: str, reps: int = 1) -> dict:
    """moeray's and llama.cpp's prefill of `tokens` under perf: {class: (moeray s, llama.cpp s)}."""
    import subprocess
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="prefill-perf-"))
    ctl = tmp / "ctl"
    os.mkfifo(ctl)
    rec = ["perf", "record", "-q", "-F", str(PERF_HZ), "-e", "cpu-clock"]
    subprocess.run(rec + ["-D", "-1", "--control", f"fifo:{ctl}", "-o", str(tmp / "moeray.data"), "--",
                          sys.executable, __file__, "--model", model, "--tokens", str(tokens), "--reps", str(reps),
                          "--threads", str(threads), "--perf-ctl", str(ctl)], check=True)
    bench = subprocess.run(rec + ["-o", str(tmp / "llama.data"), "--", llama_bench,
                                  "-m", model, "-t", str(threads), "-p", str(tokens), "-n", "0", "-r", "1"],
                           capture_output=True, text=True, check=True)
    print(bench.stdout.strip())
    table: dict[str, list[float]] = {}
    for i, (data, prefills) in enumerate(((tmp / "moeray.data", reps), (tmp / "llama.data", 2))):
        for label, sec in kernel_table(str(data), prefills):
            table.setdefault(label, [0.0, 0.0])[i] += sec
    return table


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--split", action="store_true", help="routed experts after each layer's graph, timed apart")
    ap.add_argument("--perf-ctl", help="perf's control fifo: sample the timed prefills only")
    ap.add_argument("--kernels", action="store_true", help="both engines under perf: CPU s per kernel class")
    ap.add_argument("--llama-bin", metavar="DIR",
                    help="the folder of llama-bench (default: LLAMA_CPP_BIN's folder, else PATH)")
    ap.add_argument("--json", metavar="PATH", help="also write the results here")
    args = ap.parse_args()
    if args.kernels:
        exe = str(Path(args.llama_bin) / "llama-bench") if args.llama_bin else llama_cpp_tool("llama-bench")
        if exe is None or not Path(exe).is_file():
            raise SystemExit("llama-bench: not found; set LLAMA_CPP_BIN to the folder of llama.cpp's tools, "
                             "put them on PATH or pass --llama-bin DIR")
        table = compare_kernels(args.model, args.tokens, args.threads, exe, args.reps)
        tm, tl = (sum(v[i] for v in table.values()) for i in (0, 1))
        print(f"CPU seconds per prefill of {args.tokens} tokens, {args.threads} threads, by kernel (perf cpu-clock)")
        print(f"{'kernel':<66} {'moeray':>8} {'llama.cpp':>9}")
        for k, (m, l) in sorted(table.items(), key=lambda kv: -max(kv[1])):
            if max(m, l) >= 0.005:
                print(f"{k:<66} {m:8.2f} {l:9.2f}")
        print(f"{'total':<66} {tm:8.2f} {tl:9.2f}   moeray/llama.cpp CPU: {tm / tl:.2f}x")
        if args.json:
            write_results(args.json, {"model": args.model, "tokens": args.tokens, "threads": args.threads,
                                      "kernels": {k: {"moeray_cpu_s": m, "llama_cpp_cpu_s": l}
                                                  for k, (m, l) in table.items()}})
        return 0
    import torch

    torch.set_num_threads(args.threads)  # ggml takes torch's count at first use, as bench/decode.py runs
    r = profile_prefill(args.model, args.tokens, args.reps, args.split, args.perf_ctl)
    print(f"prefill of {r['tokens']} tokens: {r['wall_ms']:.0f} ms wall ({r['tok_s']:.2f} tok/s), "
          f"{r['cpu_ms']:.0f} ms CPU ({r['cpu_tok_s']:.2f} tok per CPU s); layers {r['layers']}")
    print(f"{'part':<45} {'wall ms':>9} {'CPU ms':>9} {'CPU %':>6}")
    for k, (w, c) in sorted(r["parts"].items(), key=lambda kv: -kv[1][1]):
        print(f"{k:<45} {w:9.0f} {c:9.0f} {100 * c / r['cpu_ms']:6.1f}")
    if args.json:
        write_results(args.json, {"model": args.model, "threads": args.threads, **r})
    return 0


if __name__ == "__main__":
    sys.exit(main())
