"""Hit rates of the expert cache policies on the default model's real routing.

1. Record: run every prompt of the bundled prompt set (stages/data/prompts.json: chat, code,
   prose) through the default model, greedy, one prompt after another, with its routing
   recorded to one trace file per prompt (kept in --trace-dir and reused on later runs).
2. Profile: `moeray profile make` on the traces of the even-numbered prompts (the profile
   never sees the routing it is scored on; --profile-from all scores in-sample; --profile-from
   none fills in expert-index order, as a stage with no profile does, and replays every prompt).
3. Replay the odd-numbered prompts' traces, one serving session in prompt order, through caches
   of several sizes: static (the profile fill), adaptive (colibri's heat rule), lru (one copy per
   step, as the live cache), lru with unlimited copies (classic LRU), and Belady's offline
   optimum; and print beside them the held mass the planner predicts for the same fill: by its
   H curve (b fitted to the profile's counts; b = 1, the uniform share, with no profile) and by
   the profile's counts.

    .venv/bin/python bench/cache.py                     # record (first run only) and replay
    .venv/bin/python bench/cache.py --json cache.json   # also write the numbers
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from results import write_results  # noqa: E402

from moeray.cache.replay import belady, replay  # noqa: E402
from moeray.cache.residency import Slots  # noqa: E402
from moeray.cache.trace import Trace, read_trace  # noqa: E402
from moeray.planner.fill import fill_stage  # noqa: E402
from moeray.planner.mass import mass_model  # noqa: E402
from moeray.planner.profile import Profile  # noqa: E402
from moeray.planner.slots import per_layer_slots  # noqa: E402


def record(trace_dir: Path, max_tokens: int, threads: int) -> list[Path]:
    """Greedy runs of every bundled prompt, one at a time, with routing recorded; returns the trace
    paths. Recorded as the default model's profile is (stages/runtime/default_profile.py): every expert of
    a layer is the same FFN, so each layer computes one expert; the routing is the model's own."""
    import torch

    from moeray.cache.attach import routing_trace
    from moeray.stages.gguf.default_model import default_model_path, load_prompts, prompt_token_ids
    from moeray.stages.runtime.default_profile import _OneExpertPerLayer, greedy
    from moeray.stages.gguf.reader import GGUFFile
    from moeray.stages.runtime.model import load_model
    from moeray.stages.blocks.moe import HostExperts
    from moeray.stages.text.tokenizer import Tokenizer

    torch.set_num_threads(threads)
    gguf = GGUFFile(default_model_path(quiet=True))
    cfg = gguf.config
    tok = Tokenizer.from_metadata(gguf.metadata, source=str(gguf.path))
    experts = _OneExpertPerLayer(HostExperts(gguf), None)
    model = load_model(gguf, experts=experts)
    trace_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, (p, ids) in enumerate(zip(load_prompts(), prompt_token_ids(tok))):
        out = trace_dir / f"{i:02d}-{p['kind']}.trace"
        paths.append(out)
        if out.exists():
            continue
        tmp = out.with_suffix(".partial")
        tmp.unlink(missing_ok=True)
        experts.on_route = routing_trace(tmp, cfg, 0, cfg.n_layers)
        t0 = time.perf_counter()
        n_new = greedy(model, [ids], max_tokens, tok.end_ids)
        experts.on_route.close()
        os.replace(tmp, out)
        print(f"recorded {out.name}: {len(ids)} prompt + {n_new} new tokens "
              f"in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return paths


def concat(traces: list[Trace]) -> Trace:
    out = Trace(traces[0].header)
    for t in traces:
        out.records.extend(t.records)
        out.paths.extend(t.paths)
    return out


def run_bench(paths: list[Path], sizes: list[int], layout: str, profile_from: str) -> dict:
    traces = [read_trace(p) for p in paths]
    h = traces[0].header
    L, E, T = h.n_layers, h.n_experts, h.n_layers * h.n_experts
    if profile_from == "all":
        fit, score = traces, traces
    elif profile_from == "none":
        fit, score = [], traces
    elif profile_from == "half":
        fit, score = traces[0::2], traces[1::2]
    else:   # one kind of prompt profiles, the other kinds are served: a shift of the routing
        fit = [t for t in traces if profile_from in Path(t.paths[0]).name]
        score = [t for t in traces if profile_from not in Path(t.paths[0]).name]
        if not fit or not score:
            raise SystemExit(f"--profile-from {profile_from}: no traces named *{profile_from}* (or only those)")
    if fit:
        prof = Profile.from_counts(sum(t.counts() for t in fit))
        curve_model = mass_model(prof, "curve")
        counts = mass_model(prof, "counts").pair_mass(prof)
    else:   # what a stage without a profile fills: the interleaved index order, arbitrary experts
        prof = Profile.uniform(L, E)
        curve_model = mass_model(None, "curve")
        counts = curve_model.pair_mass(prof)
    session = concat(score)
    curve = curve_model.pair_mass(prof)
    rank = {p: r for r, p in enumerate(prof.pairs)}
    rows = []
    for n in sizes:
        if layout == "per-layer":
            lay = per_layer_slots(n, [1] * L)
            slots = Slots.from_layout(lay)
        else:
            slots = Slots(False, 0, n)
        if slots.per_layer:
            fill = sorted((p for l in range(L) for p in fill_stage(slots.quota, l, l + 1, prof, [1] * L)),
                          key=rank.__getitem__)
        else:
            fill = fill_stage(n, 0, L, prof, [1] * L)     # equal blobs: slot = 1 unit
        held = [rank[p] for p in fill]
        row = {"slots": slots.n_slots, "held_fraction": len(fill) / T,
               "predicted_curve": float(curve[held].sum()), "predicted_counts": float(counts[held].sum())}
        for name, kw in (("static", {}), ("adaptive", {}), ("lru", {}), ("lru_inf", {"copies_per_step": None})):
            r = replay(session, "lru" if name == "lru_inf" else name, slots, fill, **kw)
            row[name] = r.hit_rate
            row[name + "_copies"] = r.copies
        row["belady"] = belady(session, slots).hit_rate
        rows.append(row)
    return {"model": f"{L} layers x {E} experts, top-{h.k}", "layout": layout, "profile_from": profile_from,
            "curve_b": curve_model.b, "curve_b_source": curve_model.source,
            "traces_profiled": [str(t.paths[0]) for t in fit], "traces_replayed": [str(t.paths[0]) for t in score],
            "replayed_tokens": session.n_tokens, "replayed_lookups": sum(len(r.ids) * h.k for r in session.records),
            "rows": rows}


def slot_bytes_report() -> dict:
    """Bytes one slot holds on this process's kernel backend against the expert's bytes in the GGUF."""
    from moeray.stages.gguf.default_model import default_model_path
    from moeray.stages.gguf.reader import GGUFFile
    from moeray.stages.blocks.moe import HostExperts

    host = HostExperts(GGUFFile(default_model_path(quiet=True)))
    gguf_type = host.gguf.info("blk.0.ffn_gate_exps.weight").ggml_type.name
    return {"slot_bytes": host.slot_bytes(0), "gguf_expert_bytes": int(host.gguf.expert_bytes(0)),
            "gguf_type": gguf_type, "backend": host.backend}


def print_table(res: dict) -> None:
    if "slot" in res:
        s = res["slot"]
        print(f"one slot holds {s['slot_bytes']:,} bytes per expert ({s['backend']} backend); the GGUF stores it in "
              f"{s['gguf_expert_bytes']:,} bytes ({s['gguf_type']}), {s['slot_bytes'] / s['gguf_expert_bytes']:.1f}x")
    print(f"default model ({res['model']}), {res['layout']} slots; profile from "
          f"{len(res['traces_profiled'])} prompts, replayed {len(res['traces_replayed'])} prompts "
          f"({res['replayed_tokens']} tokens, {res['replayed_lookups']} lookups); H curve b={res['curve_b']:.2f} "
          f"({res['curve_b_source']})")
    head = (f"{'slots':>5} {'held':>6} | {'pred H':>7} {'pred cnt':>8} | {'static':>7} {'adaptive':>8} "
            f"{'lru':>7} {'lru inf':>7} {'belady':>7} | {'swaps':>5} {'lru cp':>6}")
    print(head)
    print("-" * len(head))
    for r in res["rows"]:
        print(f"{r['slots']:>5} {100 * r['held_fraction']:>5.1f}% | {100 * r['predicted_curve']:>6.1f}% "
              f"{100 * r['predicted_counts']:>7.1f}% | {100 * r['static']:>6.1f}% {100 * r['adaptive']:>7.1f}% "
              f"{100 * r['lru']:>6.1f}% {100 * r['lru_inf']:>6.1f}% {100 * r['belady']:>6.1f}% | "
              f"{r['adaptive_copies']:>5} {r['lru_copies']:>6}")
    print("held: slots as a share of all pairs; pred H / pred cnt: the planner's predicted held mass "
          "for the static fill (H curve / profile counts); the rest: measured hit rates in replay; "
          "swaps / lru cp: expert copies made by adaptive / lru (at most one per step)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace-dir", default=str(Path(os.environ.get("MOERAY_CACHE_DIR") or
                                                     Path.home() / ".cache" / "moeray") / "traces"),
                    help="where the recorded traces live (recorded once, then reused)")
    ap.add_argument("--traces", nargs="*", help="replay these traces instead of recording the prompt set")
    ap.add_argument("--max-tokens", type=int, default=48, help="new tokens per prompt when recording")
    ap.add_argument("--threads", type=int, default=1, help="torch threads when recording")
    ap.add_argument("--sizes", default="8,16,24,32,48,64,96,128,160,200", help="cache sizes in slots")
    ap.add_argument("--layout", choices=("global", "per-layer"), default="global")
    ap.add_argument("--profile-from", choices=("half", "all", "none", "chat", "code", "prose"), default="half",
                    help="half: profile the even prompts, replay the odd ones; all: in-sample; none: no profile "
                         "(index-order fill), replay all; chat/code/prose: profile that kind, replay the others "
                         "(a routing shift)")
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = ap.parse_args(argv)
    paths = [Path(p) for p in args.traces] if args.traces else record(Path(args.trace_dir), args.max_tokens, args.threads)
    if args.profile_from == "half" and len(paths) < 2:
        ap.error("--profile-from half needs at least two traces")
    res = run_bench(paths, [int(s) for s in args.sizes.split(",")], args.layout, args.profile_from)
    if not args.traces:
        res["slot"] = slot_bytes_report()
    print_table(res)
    if args.json:
        write_results(args.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
