"""The embedded default model's routing profile: which of its experts are hot.

The planner prices a cache by the routed mass it holds, and a cache is filled from a profile;
without one the caches hold arbitrary experts. For the embedded model moeray measures its routing
once: greedy runs of the bundled prompts (stages/data/prompts.json) as one batch, every routing
decision recorded through the trace writer (cache/trace.py), counted into a moeray profile. The
trace and the profile lie beside the model in $MOERAY_CACHE_DIR with a sidecar record of what they
were made from (the model's sha256, the prompts, this module), and are recorded again when any of
those changes or a file is missing. The recording is deterministic: greedy, fixed prompts, fixed
order.

`resolve_profile(profile, model_path)` is the one call the commands (serve, serve --local,
generate, plan) make to decide a run's profile: the one given, else for the embedded model its
recorded one (`default_profile_for`), None for any other model.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

from moeray.errors import MoerayError
from moeray.stages.gguf.default_model import FILE_NAME, _read_record, _sidecar, load_prompts, prompt_token_ids

PROFILE_NAME = FILE_NAME.removesuffix(".gguf") + ".profile.msgpack"
TRACE_NAME = FILE_NAME.removesuffix(".gguf") + ".routing.trace"
MAX_TOKENS = 32  # new tokens per prompt: with the prompts, ~690 routed tokens per layer


class _OneExpertPerLayer:
    """The upcycled model's experts, computed once per layer: every expert of a layer is the same
    FFN bytes (the build copies them; checked here), so sum_r w_r * expert_r(x) equals
    expert_0(x) * sum_r w_r, which is what this returns. Recording then costs one expert per layer
    per step instead of up to 8; the router and its decisions are untouched and all go to
    `on_route`."""

    def __init__(self, host, on_route):
        self.host, self.on_route, self.checked = host, on_route, set()

    def forward(self, layer, x, ids, weights):
        if layer not in self.checked:
            from moeray.stages.gguf.reader import EXPERT_KINDS

            gguf = self.host.gguf
            for kind in EXPERT_KINDS:
                first = bytes(gguf.expert_raw(layer, kind, 0))
                if any(bytes(gguf.expert_raw(layer, kind, e)) != first for e in range(1, gguf.config.n_experts)):
                    raise MoerayError(f"{gguf.path}: the experts of layer {layer} differ; "
                                      "this is not the upcycled default model")
            self.checked.add(layer)
        self.on_route(layer, ids, weights)
        return self.host.weights(layer, 0)(x) * weights.sum(-1, keepdim=True).to(x.dtype)


def whole_step(model, tokens: list[list[int]], slots: list[int], kv):
    """model.step, but every row runs every layer: a step's last layer otherwise computes its
    experts only for the rows the head reads (StageModel.run_layers' out_rows), and a trace would
    then hold a fraction of the last layer's picks. Returns the logits of each sequence's last row."""
    meta = model.batch_meta([len(t) for t in tokens], slots, kv)
    return model.head(model.run_layers(model.embed(tokens), meta, kv)[meta.last_index])


def greedy(model, prompts: list[list[int]], max_tokens: int, end_ids) -> int:
    """All prompts as one batch: one prefill step, then greedy decode steps until every sequence
    has `max_tokens` new tokens or an end token (what an engine does, without one), every row
    through every layer (`whole_step`). Returns the tokens generated."""
    import torch

    n_new = 0
    with torch.inference_mode():
        kv = model.new_kv_cache(len(prompts), max(map(len, prompts)) + max_tokens)
        live = list(range(len(prompts)))
        nxt = whole_step(model, prompts, live, kv).argmax(-1).tolist()
        n_new += len(nxt)
        for _ in range(max_tokens - 1):
            keep = [(i, t) for i, t in zip(live, nxt) if t not in end_ids]
            if not keep:
                break
            live = [i for i, _ in keep]
            nxt = whole_step(model, [[t] for _, t in keep], live, kv).argmax(-1).tolist()
            n_new += len(nxt)
    return n_new


def record_profile(model_path, dst, max_tokens: int = MAX_TOKENS, quiet: bool = False) -> Path:
    """Run the bundled prompts greedily through `model_path` (the upcycled default model), record
    every routing decision to a trace beside `dst`, and write the profile (pair counts, hottest
    first) to `dst`. Both files are replaced atomically."""
    from moeray.cache.attach import routing_trace
    from moeray.cache.trace import read_trace
    from moeray.planner.profile import Profile
    from moeray.stages.gguf.reader import GGUFFile
    from moeray.stages.runtime.model import load_model
    from moeray.stages.blocks.moe import HostExperts
    from moeray.stages.text.tokenizer import Tokenizer

    dst = Path(dst)
    if not quiet:
        print(f"moeray: recording the default model's routing profile into {dst} "
              f"({len(load_prompts())} bundled prompts, {max_tokens} tokens each) ...", file=sys.stderr)
    gguf = GGUFFile(model_path)
    cfg = gguf.config
    tok = Tokenizer.from_metadata(gguf.metadata, source=str(model_path))
    trace = dst.with_name(TRACE_NAME)
    tmp_trace = trace.with_name(trace.name + f".tmp{os.getpid()}")
    tmp_trace.unlink(missing_ok=True)
    writer = routing_trace(tmp_trace, cfg, 0, cfg.n_layers)
    try:
        model = load_model(gguf, experts=_OneExpertPerLayer(HostExperts(gguf), writer))
        greedy(model, prompt_token_ids(tok), max_tokens, tok.end_ids)
    finally:
        writer.close()
    recorded = read_trace(tmp_trace)
    recorded.check_whole(range(cfg.n_layers))
    profile = Profile.from_counts(recorded.counts())
    tmp = dst.with_name(dst.name + f".tmp{os.getpid()}")
    profile.save(tmp)
    os.replace(tmp_trace, trace)
    os.replace(tmp, dst)
    return dst


def profile_inputs(model_path: Path) -> dict:
    """What the profile depends on: the model file, the prompts, and how it is recorded."""
    rec, stat = _read_record(model_path), model_path.stat()
    checked = rec.get("size") == stat.st_size and rec.get("mtime_ns") == stat.st_mtime_ns
    data = Path(__file__).parents[1] / "data"
    return {"model": rec["sha256"] if checked else f"{stat.st_size}:{stat.st_mtime_ns}",
            "prompts": hashlib.sha256((data / "prompts.json").read_bytes()).hexdigest()[:16],
            "recorder": hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16],
            "max_tokens": MAX_TOKENS}


def resolve_profile(profile: str | os.PathLike | None, model_path, say=None) -> str | None:
    """The routing profile a run of `model_path` uses: `profile` as given; else for the embedded
    default model its recorded one (`say` gets a line naming it); else None (the uniform fill:
    another model's routing is not known before it runs)."""
    if profile is not None:
        return str(profile)
    found = default_profile_for(model_path)
    if found is None:
        return None
    if say is not None:
        say(f"profile: {found} (the default model's recorded routing)")
    return str(found)


def default_profile_for(model_path, rebuild: bool = False, quiet: bool = False) -> Path | None:
    """The routing profile to use for `model_path` when the user gave none: for the embedded
    default model, its profile beside it (recorded first if missing or made from other inputs);
    None for any other model, whose routing moeray cannot know before it runs."""
    path = Path(model_path)
    if path.name != FILE_NAME or not path.is_file():
        return None
    dst = path.with_name(PROFILE_NAME)
    want = profile_inputs(path)
    if rebuild or not dst.is_file() or not dst.with_name(TRACE_NAME).is_file() or _read_record(dst) != want \
            or not _adds_up(dst):
        record_profile(path, dst, quiet=quiet)
        _sidecar(dst).write_text(json.dumps(want))
    return dst


def _adds_up(dst: Path) -> bool:
    """The recorded profile counts its trace, and the trace is whole (every layer routed every
    token): one that does not (cut, or made by a recorder that skipped rows) is named and recorded
    again, never planned from."""
    from moeray.cache.trace import TraceError, read_trace
    from moeray.planner.profile import Profile

    try:
        trace = read_trace(dst.with_name(TRACE_NAME))
        trace.check_whole(range(trace.header.n_layers))  # the upcycled model: every layer is MoE
        import numpy as np

        if not np.array_equal(Profile.load(dst).count_table(), trace.counts()):
            raise TraceError(f"{dst}: the profile does not count its trace {dst.with_name(TRACE_NAME)}")
    except (TraceError, MoerayError, OSError, ValueError) as exc:
        print(f"moeray: the default model's routing profile is not whole ({exc}); recording it again",
              file=sys.stderr)
        return False
    return True
