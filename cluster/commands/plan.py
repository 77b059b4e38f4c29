"""`moeray plan`: the placement search for a model and a set of devices, without loading weights.

The model comes from a GGUF (only its header and tensor directory are read, so a header-only
file works), from a --spec JSON, or, given neither, is the embedded default model as for every
other command; the devices from --devices (SIZE[:LAYER_MS[:MISS_MS]], ...) or --devices-json.
Torch-free: planner/ is numpy only and the GGUF header reader is too (building the default model
the first time, or recording its profile, is the exception).
"""
from __future__ import annotations

import dataclasses
import json
import sys

from moeray.planner.devices import load_devices_json, parse_devices
from moeray.planner.profile import Profile
from moeray.planner.search import DEFAULT_CPU_FACTOR, DEFAULT_HANDOFF_MS, plan_placement
from moeray.planner.spec import ModelSpec, TrunkBytes
from moeray.errors import PlacementError


def add_arguments(p) -> None:
    p.add_argument("model", nargs="?", help="MODEL.gguf (a header-only copy is enough; default: the embedded "
                                            "upcycled SmolLM2 MoE, unless --spec is given)")
    p.add_argument("--spec", help='model sizes as JSON: {"n_layers", "n_experts", "n_experts_used", '
                                  '"expert_bytes": [...], "trunk_bytes": {"embedding", "head", "layers": [...]}}')
    p.add_argument("--devices", help="free VRAM per stage in pipeline order, e.g. 12GiB,12GiB,8GiB,8GiB; "
                                     "each item SIZE[:LAYER_MS[:MISS_MS]]")
    p.add_argument("--devices-json", help='[{"name", "free_bytes", "layer_ms", "miss_ms"}, ...]')
    p.add_argument("--profile", help="routing profile: moeray msgpack, Strata STRP or colibri heat file "
                                     "(default for the embedded default model: its recorded profile)")
    p.add_argument("--stages-objective", choices=("latency", "throughput"), default="latency",
                   help="latency: fastest decode step (sum over stages); throughput: fastest slowest stage")
    p.add_argument("--split", default="auto", help="auto, or K=14,31,41 (first layer of stages 1..S-1) to score a given split")
    p.add_argument("--trunk", default="auto", help="auto, off, or e.g. head=gpu,embed=cpu,layers=0-20+30-47")
    p.add_argument("--mass", choices=("auto", "curve", "counts"), default="auto",
                   help="counts: the profile's measured shares; curve: H(f)=1-(1-f)^b, b fitted to the profile's "
                        "counts (--cover-b sets it; no profile: b=1, the uniform share); "
                        "auto (default): counts when the profile has them")
    p.add_argument("--cover-b", type=float, metavar="B", default=None,
                   help="b of the mass curve H(f)=1-(1-f)^b, which then prices every pair (default: fitted)")
    p.add_argument("--backend", choices=("auto", "ggml", "dequant", "exact"), default="auto",
                   help="the stages' kernel backend, priced: exact holds float32 copies (4 bytes a weight), the "
                        "others the GGUF's blocks (default auto)")
    p.add_argument("--max-seqs", type=int, default=1,
                   help="sequences that may run at once: each holds its recurrent state (DeltaNet layers) on the "
                        "layer's card, charged like KV (default 1)")
    p.add_argument("--state-checkpoints", type=int, default=None, metavar="N",
                   help="hybrid models: checkpoints of the recurrent state (one sequence's state each, on every "
                        "recurrent layer's card) kept for prefix reuse (default: traded against the experts, up to "
                        "two per sequence, as many as cost under 2%% of the predicted step)")
    p.add_argument("--kv-tokens", type=int, default=0,
                   help="tokens of KV every stage holds for its layers (e.g. 32768: one sequence at 32K), charged "
                        "at the architecture's KV per token (MLA: latent + rope key; GQA: k and v) in 16 bits "
                        "(default 0: KV not priced)")
    p.add_argument("--cache-type", choices=("f32", "f16", "q8_0", "q4_0"), default="f16",
                   help="the type --kv-tokens are charged in, K and V alike (llama.cpp's -ctk / -ctv; default f16, "
                        "a card's pool); every type's bytes per token and context are printed beside it")
    p.add_argument("--handoff-ms", type=float, default=DEFAULT_HANDOFF_MS, help="time of one stage-to-stage hop")
    p.add_argument("--cpu-factor", type=float, default=DEFAULT_CPU_FACTOR,
                   help="host bytes read per card byte of an expert (2 for an int8 host copy of an int4 slot)")
    p.add_argument("--min-layers", default="1", help="minimum layers per stage: N, or one per stage (2,1,1,1)")
    p.add_argument("--method", choices=("auto", "enumeration", "dp"), default="auto",
                   help="auto: enumeration up to 4 stages, the exact DP beyond")
    p.add_argument("--verbose", action="store_true",
                   help="print every trunk decision and slot layout, not only those that depart from the default")
    p.add_argument("--json", metavar="PATH", help="write the plan as JSON (- for stdout)")
    p.add_argument("--headers-to", metavar="DIR",
                   help="also write header-only copies of the model's file(s) into DIR, under their own names "
                        "(every part of a model in parts): what a machine that only plans, or runs the driver, needs")
    p.add_argument("--plot", metavar="PNG", help="draw the plan (needs matplotlib: moeray[plot])")


def spec_from_gguf(path: str, backend: str | None = None, header=None) -> ModelSpec:
    """The model's sizes as a stage holds them: the GGUF's own blocks (float32 vectors and
    routers) on the quantised backends, float32 on the exact one - the same pricing as the
    driver's, from stages/gguf/reader.held_bytes. `header`: already read."""
    from moeray.stages.arch import arch_of
    from moeray.stages.gguf.reader import expert_bytes, read_gguf_header, trunk_bytes, trunk_pieces  # torch-free

    backend = "exact" if backend == "exact" else "quantised"
    h = header or read_gguf_header(path)
    cfg = h.config
    if not cfg.n_experts:
        raise PlacementError(f"{path}: a dense model (no routed experts); there is no expert cache to place")
    tb = trunk_bytes(h.tensors, cfg, backend)
    arch = arch_of(cfg)
    state = [arch.state_bytes(cfg, l) for l in range(cfg.n_layers)]
    return ModelSpec(cfg.n_layers, cfg.n_experts, cfg.n_experts_used,
                     [expert_bytes(h.tensors, i, backend) for i in range(cfg.n_layers)],
                     TrunkBytes(int(tb["embedding"]), int(tb["head"]), [int(x) for x in tb["layers"]],
                                trunk_pieces(h.tensors, cfg, backend) if any(state) else []), state,
                     kv_token_bytes=[KV_ITEMSIZE * arch.kv_values(cfg, l) for l in range(cfg.n_layers)])


KV_ITEMSIZE = 2  # a spec's kv_token_bytes are 16-bit: a card's KV pool (stages/blocks/kv_cache.py kv_dtype)


def at_type(per_token: list[int], cache_type: str) -> list[int]:
    """A spec's 16-bit KV bytes per token per layer in `cache_type` (rows of whole 32-value blocks)."""
    from moeray.planner.kv import value_bytes

    return [int(b // KV_ITEMSIZE * value_bytes(cache_type)) for b in per_token]


def kv_line(per_token: list[int], split, n_tokens: int, cache_type: str = "f16") -> str:
    """[kv] what the KV costs each stage at --kv-tokens in --cache-type, from the architecture's layout."""
    from moeray.units import format_bytes

    typed = at_type(per_token, cache_type)
    stages = ", ".join(format_bytes(n_tokens * sum(typed[a:b])) for a, b in split)
    return (f"[kv] {format_bytes(sum(typed))} of KV per token over {sum(1 for k in per_token if k)} layers "
            f"({max(per_token) // KV_ITEMSIZE} values per token per layer, {cache_type}); {n_tokens} tokens "
            f"(--kv-tokens) charged to their layers' cards: {stages}")


def kv_types_line(per_token: list[int], plan) -> str:
    """[kv] every cache type's bytes per token and the context it buys: the tokens one block table
    holds if the room the cards have beside their trunk (and any --kv-tokens already charged)
    went to KV, every expert then read from the host; the least over the stages."""
    from moeray.planner.kv import CACHE_TYPES
    from moeray.units import format_bytes

    parts = []
    for t in CACHE_TYPES:
        typed = at_type(per_token, t)
        fits = [s.expert_room // sum(typed[a:b]) for s, (a, b) in zip(plan.stages, plan.split) if sum(typed[a:b])]
        parts.append(f"{t} {format_bytes(sum(typed))} per token, {min(fits) if fits else 0} tokens")
    return ("[kv] cache types (--cache-type; serve: --cache-type-k / -v): " + "; ".join(parts)
            + " (the context each buys with the room beside the trunk, every expert then from the host)")


def write_headers(header, folder: str) -> None:
    """Header-only copies of every file of the model (each part under its own name) into `folder`."""
    import os

    from moeray.stages.gguf.reader import write_header_only
    from moeray.units import format_bytes

    os.makedirs(folder, exist_ok=True)
    for p in header.parts:
        n = write_header_only(p.path, os.path.join(folder, p.name))
        print(f"header of {p.name}: {format_bytes(n)} written to {folder}", file=sys.stderr)


def run(args) -> int:
    from moeray.cluster.config import LaunchOptions, with_overrides
    from moeray.stages.kernels.settings import StageOptions

    # The flags, with this process's debugging overrides (MOERAY_BACKEND, MOERAY_SPLIT_COVER_B) named
    opts = with_overrides(LaunchOptions(stage=StageOptions(backend=args.backend), cover_b=args.cover_b))
    if args.model and args.spec:
        raise PlacementError("give a MODEL.gguf or --spec model.json, not both")
    if bool(args.devices) == bool(args.devices_json):
        raise PlacementError("give --devices 12GiB,8GiB,... or --devices-json devices.json (one of them)")
    if not args.spec:
        from moeray.cluster.config import resolve_model  # torch-free; builds the default model once

        args.model = resolve_model(args.model)
    header = None
    if args.model:
        from moeray.stages.gguf.reader import read_gguf_header  # torch-free; a model in parts: every part's header

        header = read_gguf_header(args.model)
        if args.headers_to:
            write_headers(header, args.headers_to)
    spec = spec_from_gguf(args.model, opts.stage.backend, header) if args.model else ModelSpec.from_json(args.spec)
    if args.max_seqs < 1:
        raise PlacementError(f"--max-seqs {args.max_seqs}: at least one sequence runs")
    per_seq_state = list(spec.state_bytes)
    if args.kv_tokens < 0:
        raise PlacementError(f"--kv-tokens {args.kv_tokens}: a number of tokens, 0 or more")
    if args.state_checkpoints is not None and args.state_checkpoints < 0:
        raise PlacementError(f"--state-checkpoints {args.state_checkpoints}: a number of checkpoints, 0 or more")
    per_token_kv = list(spec.kv_token_bytes)
    base = spec
    if args.cache_type != "f16" and any(per_token_kv):  # --kv-tokens charged in that type
        base = dataclasses.replace(spec, kv_token_bytes=at_type(per_token_kv, args.cache_type))
    spec = base.with_state_for(args.max_seqs).with_kv_for(args.kv_tokens)
    devices = parse_devices(args.devices) if args.devices else load_devices_json(args.devices_json)
    profile_path = args.profile
    if args.model:
        from moeray.stages.runtime.default_profile import resolve_profile  # torch only if it must be recorded

        profile_path = resolve_profile(args.profile, args.model, say=lambda line: print(line, file=sys.stderr))
    profile = Profile.load(profile_path, spec.n_layers, spec.n_experts) if profile_path else None
    try:
        mins = [int(x) for x in str(args.min_layers).split(",")]
    except ValueError:
        raise PlacementError(f"--min-layers {args.min_layers!r}: a number or one number per stage") from None

    def planned(spec):
        return plan_placement(spec, devices, profile, objective=args.stages_objective, split=args.split,
                              trunk=args.trunk, handoff_ms=args.handoff_ms,
                              min_layers=mins[0] if len(mins) == 1 else mins, mass=args.mass,
                              cpu_factor=args.cpu_factor, method=args.method, cover_b=opts.cover_b)

    plan = planned(spec)
    checkpoints, c_rule, c_tried = 0, "", []
    if any(per_seq_state):  # recurrent state: its checkpoints (prefix reuse) priced against the experts
        from moeray.planner.kv import trade_checkpoints

        def with_checkpoints(c: int):
            return planned(base.with_state_for(args.max_seqs + c).with_kv_for(args.kv_tokens))

        if args.state_checkpoints is not None:
            checkpoints, c_rule = args.state_checkpoints, "as given (--state-checkpoints)"
            plan = with_checkpoints(checkpoints) if checkpoints else plan
        else:
            checkpoints, better, c_tried = trade_checkpoints(with_checkpoints, plan.predicted_ms, 2 * args.max_seqs)
            plan = better or plan
            c_rule = "auto: up to two per sequence, as many as cost under 2% of the predicted step"
            if checkpoints < 2 * args.max_seqs:  # the rest: host memory, which only the stages can measure
                from moeray.planner.kv import HOST_CHECKPOINT_SHARE

                c_rule += (f"; at launch the rest in the nodes' host memory, as far as 1/{HOST_CHECKPOINT_SHARE} "
                           "of what each has available goes")
    out = sys.stderr if args.json == "-" else sys.stdout
    if any(per_seq_state):
        from moeray.planner.report import checkpoint_line, state_line

        plan.notes.append(state_line(per_seq_state, plan.split, args.max_seqs))
        kv_block = 16 * sum(per_token_kv)
        plan.notes.append(checkpoint_line(per_seq_state, plan.split, checkpoints, kv_block, c_rule, c_tried))
    if args.kv_tokens and any(per_token_kv):
        plan.notes.append(kv_line(per_token_kv, plan.split, args.kv_tokens, args.cache_type))
    if any(per_token_kv):
        plan.notes.append(kv_types_line(per_token_kv, plan))
    parts_lines = []
    if header is not None:  # a model in parts: which files each stage's node needs
        from moeray.stages.gguf.parts import stage_parts_lines

        parts_lines = stage_parts_lines(header, plan.split)
    for line in plan.lines(verbose=args.verbose) + parts_lines:
        print(line, file=out)
    if args.json:
        js = plan.to_json()
        if header is not None and header.in_parts:
            for s, (a, b) in zip(js["stages"], plan.split):
                s["parts"] = [header.parts[j].name for j in header.stage_parts(a, b)]
        text = json.dumps(js, indent=1)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    if args.plot:
        from moeray.planner.report import plot_plan

        plot_plan(plan, args.plot)
    return 0
