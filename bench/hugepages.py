"""Huge pages vs plain memory for the weights a decode token streams (stages/kernels/host_memory.py), on
the default model, in one process: four models loaded side by side (the host path read from the
mapping vs from the huge-page copy; every expert resident in plain vs huge-page slots) and decoded
in turn, 8 rounds, so drifting load hits all alike. The time is the process's CPU time per token
with one ggml thread: the compute and its memory stalls, not the time spent preempted by other
jobs on a shared machine.

    python bench/hugepages.py [--rounds 8] [--json out.json]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from results import write_results  # noqa: E402

VARIANTS = {  # label -> (MOERAY_HUGEPAGES, MOERAY_HOST_EXPERTS, every expert resident)
    "host path, mapping": ("0", "mapped", False),
    "host path, huge-page copy": ("1", "auto", False),
    "all resident, plain slots": ("0", "mapped", True),
    "all resident, huge-page slots": ("1", "auto", True),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=24, help="decode tokens per round")
    ap.add_argument("--json")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(1)
    from decode import prompt_ids
    from moeray.stages.kernels import settings, threads
    from moeray.stages.gguf.default_model import default_model_path
    from moeray.stages.gguf.reader import GGUFFile
    from moeray.stages.runtime.model import load_cached, load_model
    from moeray.stages.text.tokenizer import Tokenizer

    threads.set_threads(1)
    path = str(default_model_path())
    cfg = GGUFFile(path).config
    every = cfg.n_layers * cfg.n_experts
    models = {}
    for label, (huge, host, resident) in VARIANTS.items():
        settings.update(hugepages=huge != "0", host_experts=host)  # read at load
        models[label] = load_cached(path, n_slots=every)[0] if resident else load_model(path)
    ids = prompt_ids(Tokenizer.from_gguf(path), 32, 0)
    ms = {label: [] for label in models}
    for _ in range(args.rounds):
        for label, m in models.items():
            kv = m.new_kv_cache(1, len(ids) + args.tokens + 8)
            logits = m.step([ids], [0], kv)
            for _ in range(4):  # warm
                logits = m.step([[int(logits[0].argmax())]], [0], kv)
            t0 = time.process_time()
            for _ in range(args.tokens):
                logits = m.step([[int(logits[0].argmax())]], [0], kv)
            ms[label].append((time.process_time() - t0) / args.tokens * 1e3)
    print(f"{'variant':32s} {'ms/token (CPU, median)':>24s}  rounds")
    for label, v in ms.items():
        print(f"{label:32s} {np.median(v):24.2f}  {' '.join(f'{x:.1f}' for x in v)}")
    if args.json:
        write_results(args.json, {"ms": ms})
    return 0


if __name__ == "__main__":
    sys.exit(main())
