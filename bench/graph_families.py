"""The fused MoE layer and the stage graph on the families with a shared expert, dense layers,
sigmoid / biased routing, and gpt-oss: decode ms a step with each mode, alternated in
one process.

Modes: `torch` (MOERAY_TRUNK_GRAPH=0: torch's ops between the matmuls), `off` (MOERAY_FUSED_MOE=0:
each layer's trunk graph, then torch routing, the experts, shared expert and dense FFN after it),
`layer` (MOERAY_STAGE_GRAPH=0: each layer's whole FFN inside its graph), `stage` (the default: a
decode step as one graph; gpt-oss before this: `torch`, its sinks, windows and YaRN had no graph
form). Files: small synthetic GGUFs of the qwen2moe, glm4moe and gpt-oss families (bench/shapes.py,
random Q4_K blocks, MXFP4 experts for gpt-oss, written once into the cache dir, under 1 GB each);
`--where`: the host path, every expert resident in slots, half of each layer's experts resident
(split layers: routed experts after the graph, the shared expert inside).

    python bench/graph_families.py [--batch 1 16] [--rounds 5] [--json out.json]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from results import write_results  # noqa: E402
from shapes import Shape, write_shape  # noqa: E402

# Small members of each family (hidden 1024; Qwen1.5-MoE's and GLM-4.5-Air's proportions).
SMALL = {
    "qwen2moe": Shape("qwen2moe", layers=12, hidden=1024, heads=8, kv_heads=8, head_dim=128, experts=60, used=4,
                      expert_ff=512, shared_ff=2048, vocab=49152, norm_topk=False),
    "glm4moe": Shape("glm4moe", layers=12, hidden=1024, heads=8, kv_heads=2, head_dim=128, experts=64, used=8,
                     expert_ff=512, shared_ff=512, dense_lead=1, dense_ff=4096, vocab=49152, weights_scale=2.5),
    "gpt-oss": Shape("gpt-oss", layers=12, hidden=1024, heads=16, kv_heads=4, head_dim=64, experts=32, used=4,
                     expert_ff=1024, vocab=49152, rope_theta=150000.0),
    # DeepSeek-V3 / Kimi-K2's attention at hidden 1024: MLA with a q LoRA, the 512 + 64 latent,
    # 128 + 64 per query head; a dense first layer, sigmoid + bias routing in 8 groups of 4, 2 shared
    "deepseek2": Shape("deepseek2", layers=12, hidden=1024, heads=8, kv_heads=1, head_dim=192, experts=64, used=6,
                       expert_ff=512, shared_ff=1024, dense_lead=1, dense_ff=4096, vocab=49152, groups=(8, 4),
                       weights_scale=2.5, rope_theta=10000.0, kv_lora=512, q_lora=384, rope_dim=64, v_dim=128),
}
MODES = {"torch": None, "off": (False, False), "layer": (True, False), "stage": (True, True)}


def decode_ms(model, batch: int, steps: int) -> float:
    """ms a decode step of `batch` sequences after a 16-token prompt each."""
    kv = model.new_kv_cache(batch, 16 + steps + 8)
    logits = model.step([list(range(100, 116))] * batch, list(range(batch)), kv)
    t = time.perf_counter()
    for _ in range(steps):
        logits = model.step([[int(x)] for x in logits.argmax(-1)], list(range(batch)), kv)
    return 1e3 * (time.perf_counter() - t) / steps


def main() -> None:
    from moeray.stages.runtime.model import load_cached, load_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", nargs="+", default=list(SMALL), choices=list(SMALL))
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--where", nargs="+", default=["host", "resident"], choices=["host", "resident", "half"])
    ap.add_argument("--json", metavar="PATH", help="also write the rows here")
    args = ap.parse_args()
    torch.set_num_threads(2)
    rows = []
    for family in args.family:
        path = write_shape(f"small-{family}", shape=SMALL[family])
        cfg = load_model(path, backend="ggml").config
        for where in args.where:
            if where == "host":
                model = load_model(path, backend="ggml")
            else:
                per_layer = cfg.n_experts if where == "resident" else cfg.n_experts // 2
                model, _ = load_cached(path, backend="ggml", n_slots=len(cfg.moe_layers) * per_layer)
            trunk = model.trunk
            for batch in args.batch:
                res = {k: [] for k in MODES}
                with torch.inference_mode():
                    for r in range(args.rounds + 1):  # round 0 warms every mode's graphs
                        for k, mode in MODES.items():
                            model.trunk = None if mode is None else trunk
                            model.fuse_moe, model.stage_graph = mode or (False, False)
                            ms = decode_ms(model, batch, args.steps if r else 4)
                            if r:
                                res[k].append(ms)
                med = {k: statistics.median(v) for k, v in res.items()}
                rows.append({"family": family, "where": where, "batch": batch, "median_ms": med})
                print(f"{family:9s} {where:8s} batch {batch:2d}: " + ", ".join(
                    f"{k} {med[k]:.2f} ms" for k in MODES) + f"  | off/stage {med['off'] / med['stage']:.2f}x,"
                      f" torch/stage {med['torch'] / med['stage']:.2f}x", flush=True)
            del model
    if args.json:
        write_results(args.json, {"rounds": args.rounds, "steps": args.steps, "rows": rows})


if __name__ == "__main__":
    main()
