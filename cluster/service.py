"""The owner of one server's engine: model, tokenizer, pipeline, engine thread and metrics.

`Service(opts)` runs the driver (probe -> plan -> load -> wire, `moeray.cluster.driver.launch`), or
with `--local` loads the whole model in this process (cluster/local_pipeline.py), then starts the
engine thread (cluster/engine_loop.py) and the metrics poller. The HTTP app (cluster/serve_app.py)
reads it and posts requests to its engine thread; it never touches the engine itself.
"""
from __future__ import annotations

import dataclasses
import os
import threading
from pathlib import Path

from moeray.cluster import openai_schema as oa
from moeray.cluster.config import ServeOptions, local_threads, resolve_model
from moeray.cluster.engine_loop import EngineLoop, Stream
from moeray.cluster.timeline import TimelineLog, stage_hops
from moeray.errors import MoerayError
from moeray.stages.runtime.heap import freeze_heap


def host_tier_bytes(header, asked: str = "auto") -> int:
    """Host memory `serve --local` gives its host tier (a hybrid model's state checkpoints its device
    has no room for, then the KV blocks its pool evicts): `--kv-host` against this machine's
    MemAvailable less the model's files (planner/kv.py host_tier_room)."""
    from moeray.planner.kv import host_tier_room
    from moeray.stages.kernels.repack import mem_available

    return host_tier_room(asked, mem_available(), sum(p.size for p in header.parts))


def local_stage_options(stage, token_bytes: int):
    """`serve --local`'s StageOptions: `stage` with what it leaves unset filled for the one
    process: ggml's threads every core it may run on, their settings by the model's size."""
    from moeray.stages.kernels.threads import ThreadSettings

    threads = ThreadSettings.of(stage, ThreadSettings(**local_threads(token_bytes)))
    return dataclasses.replace(stage, threads=stage.threads or len(os.sched_getaffinity(0)), **threads.options())


def _experts_line(cfg, report) -> str:
    """Where `--local`'s routed experts live (StageActor.load, whole_cache_only)."""
    from moeray.units import format_bytes

    if not cfg.is_moe:
        return "experts: none (a dense model)"
    if report.cache_slots:
        return f"experts: {report.cache_resident} resident in {report.cache_slots} slots of the simulated device"
    return (f"experts: every routed expert computed from host memory ({format_bytes(report.free_bytes)} of the "
            "simulated device is left after KV, recurrent states and trunk, less than all of them; a part of them there would "
            "read no fewer bytes and split each layer's step)")


def host_report(host) -> dict | None:
    """The host tier's ledger for /v1/stages (each stage's own bytes moved are in its `kv`)."""
    if host is None:
        return None
    s = host.stats
    return {"blocks": host.n, "held_blocks": host.n_held, "saved_blocks": s.saved, "hit_blocks": s.hits,
            "hit_tokens": s.hit_tokens, "evicted_blocks": s.evicted}


class Service:
    """Model, tokenizer, pipeline, engine thread and metrics of one server."""

    def __init__(self, opts: ServeOptions, log=print):
        from moeray.cluster.engine import Engine
        from moeray.cluster.local_pipeline import LocalPipeline
        from moeray.stages.gguf.reader import read_gguf_header
        from moeray.stages.text.chat import chat_format
        from moeray.stages.text.tokenizer import Tokenizer

        self.opts = opts
        self.path = resolve_model(opts.model)
        if opts.model_name:
            self.model_name = opts.model_name
        elif opts.model is None:
            from moeray.stages.gguf.default_model import MODEL_NAME

            self.model_name = MODEL_NAME
        else:
            from moeray.stages.gguf.parts import model_stem

            self.model_name = model_stem(self.path)  # NAME, not NAME-00001-of-00004
        # Every id a request may name: the first is the one responses carry (as vLLM answers)
        self.model_names = list(dict.fromkeys([self.model_name, *opts.model_aliases]))
        header = read_gguf_header(self.path)
        self.header_config = header.config
        engine_cfg = opts.engine
        self.tokenizer = Tokenizer.from_metadata(header.metadata, source=self.path)
        if opts.chat_template is not None:  # --chat-template: instead of the file's
            self.tokenizer = dataclasses.replace(self.tokenizer, chat_template=opts.chat_template)
        # How this family's template is called and its replies read (--chat-format, else from the file);
        # the detokenizer shows the format's markers, control tokens or not.
        self.chat = chat_format(self.tokenizer.chat_template, header.metadata.get("general.architecture"),
                                opts.chat_format)
        self.tokenizer = self.tokenizer.with_rendered(self.chat.markers())
        self.tokenizer.max_token_bytes  # noqa: B018 - read the vocabulary once now, not on a request
        try:  # the template compiled and its renderer imported now: seconds the first request would wait
            self.chat.render(self.tokenizer, [{"role": "user", "content": "hello"}])
        except Exception:  # noqa: BLE001 - no template, or one that refuses this message: the requests say why
            pass
        self.created = oa.now()
        self.launched = None
        self.lines: list[str] = []
        self.timelines = TimelineLog()  # where the last requests' time went (cluster/timeline.py)
        if opts.local:
            if opts.launch.torch_threads:
                import torch

                torch.set_num_threads(opts.launch.torch_threads)
            from moeray.stages.kernels import settings
            from moeray.stages.kernels.backend import ggml_available
            from moeray.stages.kernels.threads import ggml_threads
            from moeray.stages.runtime.default_profile import resolve_profile

            stage = local_stage_options(opts.launch.stage, header.token_bytes())
            settings.use(stage)
            if ggml_available():
                ggml_threads()  # fixed now, before torch's first op (threads.set_threads says why)
            profile = resolve_profile(opts.launch.profile, self.path)
            from moeray.cluster.placement import local_kv_plan, plan_kv_types, uses_mtp

            from moeray.stages.runtime.model import stage_trunk_bytes

            cfg = header.config
            types = plan_kv_types(cfg, (stage.cache_type_k, stage.cache_type_v), ["simulated"])
            kv = local_kv_plan(cfg, engine_cfg, opts.local_budget, types,
                               trunk_bytes=stage_trunk_bytes(header, 0, cfg.n_layers),
                               expert_bytes=cfg.n_experts * sum(header.expert_bytes(l) for l in range(cfg.n_layers)),
                               host_bytes=host_tier_bytes(header, opts.launch.kv_host))
            engine_cfg = dataclasses.replace(engine_cfg, max_len=kv.context, kv_blocks=kv.blocks,
                                             state_checkpoints=kv.checkpoints + kv.host_checkpoints)
            self.local = LocalPipeline.from_file(self.path, kv.blocks, opts.local_budget,
                                                 profile, opts.launch.cache_policy, engine_cfg.max_seqs, stage,
                                                 draft=opts.launch.draft, mtp=uses_mtp(header, engine_cfg),
                                                 state_checkpoints=kv.checkpoints,
                                                 host_checkpoints=kv.host_checkpoints, kv_types=types,
                                                 host_blocks=kv.host_blocks)
            pipeline = self.local
            self.lines.append(f"one process: layers 0-{header.config.n_layers - 1} on {self.local.stage.device.name}")
            self.lines.append(_experts_line(header.config, self.local.load_report))
            self.lines.append(kv.line())
            kv.type_rule = "one process: its device holds every expert it caches, nothing to trade" if "auto" in (
                stage.cache_type_k, stage.cache_type_v) else "as asked"
            self.lines.append(kv.types_line())
            if kv.host_blocks:
                self.lines.append(kv.host_line())
            if kv.checkpoint_rule:
                from moeray.cluster.placement import state_bytes_by_layer
                from moeray.planner.report import checkpoint_line

                self.lines.append(checkpoint_line(state_bytes_by_layer(header.config, 1), [(0, header.config.n_layers)],
                                                  kv.checkpoints, kv.stage_bytes[0] // max(1, kv.blocks),
                                                  kv.checkpoint_rule))
        else:
            from moeray.cluster.driver import launch

            self.launched = launch(self.path, opts.launch, engine_cfg, log=self._log(log))
            pipeline = self.launched.pipeline()
            engine_cfg = self.launched.engine  # the context and the KV blocks the plan settled
        self.engine = Engine(pipeline, engine_cfg, self.tokenizer)
        try:  # the last stage's grammar masks, before requests come (StageActor.warm_grammars)
            if self.launched is None:
                self.local.stage.warm_grammars()
            else:
                self.launched.group.actors[-1].warm_grammars.remote()
        except Exception:  # noqa: BLE001 - not needed to serve: the first grammar request builds them
            pass
        self.metrics = self.poller = None
        if opts.metrics:  # --no-metrics: none
            try:
                from moeray.cluster.metrics import Metrics, Poller

                self.metrics = Metrics(self.model_name)
                self.poller = Poller(self.metrics, self.stage_stats, lambda: (self.loop.counts["running"],
                                                                              self.loop.counts["waiting"]),
                                     opts.metrics_interval_s, read_kv=self.kv_report, read_faults=self.faults_report,
                                     read_spec=self.spec_report)
            except ImportError:  # no Ray: serve without metrics
                pass
        self.tokens_out = 0  # tokens handed to clients (vllm:generation_tokens_total)
        from moeray.cluster.prometheus import ServedMetrics

        # GET /metrics on the serving port, Ray or not (cluster/prometheus.py)
        self.prometheus = ServedMetrics(self.model_name, lambda: self.loop.counts, self.kv_report, self.stage_stats,
                                        self.faults_report, self.spec_report, lambda: self.tokens_out,
                                        stage_every_s=opts.metrics_interval_s)
        self.loop = EngineLoop(self.engine, max_waiting=opts.max_waiting, on_tokens=self._on_tokens).start()
        if self.poller is not None:
            self.poller.start()
        # What start-up built stays: out of the garbage collector's walks (stages/runtime/heap.py)
        freeze_heap()
        # The grammar engine's view of the vocabulary takes a second to build: now, beside the first
        # requests, not inside the first one that asks for structured output.
        threading.Thread(target=self._warm_grammar, name="moeray-grammar-warm", daemon=True).start()

    def _warm_grammar(self) -> None:
        try:
            from moeray.stages.text.grammar import ll_tokenizer

            ll_tokenizer(self.tokenizer, self.n_vocab)
        except Exception:  # noqa: BLE001 - no llguidance: a grammar request says so itself
            pass
        freeze_heap(collect=False)  # ... and the grammar engine's view of the vocabulary

    def serves(self, model: str) -> bool:
        """A request naming `model` is for this server (one of its names, or any with --any-model)."""
        return self.opts.any_model or model in self.model_names

    @property
    def context(self) -> int:
        """Tokens one sequence can hold: the context, and no more than the whole KV pool (which a
        re-plan after a node loss may change)."""
        return min(self.engine.config.max_len, self.engine.scheduler.kv_tokens)

    def faults_report(self) -> dict:
        """What failed and what was done: the driver's counts and events, and why nothing serves
        now (None while serving)."""
        down = self.loop.down if hasattr(self, "loop") else None
        if self.launched is None:
            return {"stage_failures": self.engine.stats.failures, "down": down, "events": [],
                    "recovering": self.loop.recovering if hasattr(self, "loop") else None,
                    "stages_serving": 0 if down else 1}
        down = down or self.launched.down
        recovering = self.launched.recovering
        return {**self.launched.faults, "down": down, "recovering": recovering,
                "events": list(self.launched.events),
                "stages_serving": 0 if down or recovering else self.launched.group.n_stages}

    def _log(self, log):
        def say(line: str) -> None:
            self.lines.append(line)
            if log is not None:
                log(line)
        return say

    def _on_tokens(self, delivered: list[tuple[Stream, int]], now: float) -> None:
        """One step's deliveries (on the engine thread): the token count, a TTFT or an ITL per request."""
        n = sum(k for _, k in delivered)
        self.tokens_out += n
        ttfts = [now - s.t_submit for s, _ in delivered if s.t_last is None]
        itls = [(now - s.t_last) / k for s, k in delivered if s.t_last is not None]
        self.prometheus.tokens(ttfts, itls)
        if self.metrics is not None:
            self.metrics.tokens(n, ttfts, itls)

    def request_done(self, stream: Stream, reason: str) -> None:
        """A request ended (on the event loop): its latency, queue time and token counts for /metrics."""
        import time

        req = stream.req
        queued = None
        if req is not None and getattr(req, "t_admitted", None) is not None:
            queued = req.t_admitted - req.t_arrive
        self.prometheus.done(reason, time.perf_counter() - stream.t_submit, queued, len(stream.prompt),
                             stream.sent_tokens)

    @property
    def n_vocab(self) -> int:
        """The logits' width the last stage masks a grammar over (the model's, which a padded
        embedding may make wider than the tokenizer's vocabulary)."""
        return self.header_config.vocab_size

    def prepare_grammar(self, extras, error) -> None:
        """On a worker thread: compile the request's grammar here (a bad one is `error`'s 400) and
        where it is applied, so that no step waits on a compile: this process keeps it for --local;
        over Ray the last stage compiles its own copy now, beside its steps."""
        from moeray.cluster import request_extras as xt

        if self.launched is not None and extras.grammar is not None and self.launched.recovering is None:
            try:  # the last stage starts compiling its own copy now (StageActor.prepare_grammar)
                self.launched.group.actors[-1].prepare_grammar.remote(extras.grammar)
            except Exception:  # noqa: BLE001 - a stage restarting: its step compiles the grammar itself
                pass
        xt.check_extras(self, extras, error)

    def drain(self, timeout_s: float) -> int:
        """SIGTERM: stop admitting, let what runs finish for up to `timeout_s`, end the rest with
        an error (EngineLoop.drain)."""
        return self.loop.drain(timeout_s)

    def stage_stats(self, timeout_s: float = 10.0):
        """Each stage's live numbers (StageActor.stats: StageStats), with a deadline."""
        if self.launched is not None and self.launched.recovering is not None:
            return []  # the stages are being restarted or re-planned: faults_report says why
        stats = [self.local.stage.stats()] if self.launched is None else self.launched.stage_stats(timeout_s)
        kv = self.kv_report()
        for s in stats:
            if s.kv is not None:  # one block table for all stages: the engine's ledger counts for each
                s.kv.update(used=kv["used_blocks"], free=kv["free_blocks"], cached=kv["cached_blocks"])
        return stats

    def live_profile(self) -> bytes:
        """GET /v1/admin/profile: every stage's routed picks per (layer, expert) since it started,
        as one moeray profile with counts: re-plan (`--profile`) with the traffic really served."""
        import numpy as np

        from moeray.planner.profile import Profile

        if self.launched is not None and self.launched.recovering is not None:
            raise MoerayError(f"the stages are being restarted or re-planned (after: {self.launched.recovering}); "
                              "ask again in a moment")
        cfg = self.header_config
        counts = np.zeros((cfg.n_layers, cfg.n_experts), dtype=np.int64)
        for st in self.stage_stats():
            if st.cache and st.cache.get("routed"):
                first, end = st.cache["layers"]
                counts[first:end] += np.asarray(st.cache["routed"], dtype=np.int64)
        if counts.sum() == 0:
            raise MoerayError("no routing decisions yet: serve some requests first")
        return Profile.from_counts(counts).to_bytes()

    def stages_report(self) -> dict:
        """GET /v1/stages: the records become JSON here, at the edge."""
        from moeray.stages.kernels.host_memory import process_rss_bytes  # torch: not at this module's import

        stats = [dataclasses.asdict(s) for s in self.stage_stats()]
        timings = [s.pop("timings", None) or [] for s in stats]  # raw: summed up in "pipeline"
        for s in stats:
            if s.get("cache"):
                s["cache"].pop("per_layer", None)  # per-layer rows: ask the stage; this is the summary
                s["cache"].pop("routed", None)  # the per-expert table: GET /v1/admin/profile
        return {
            "model": self.model_name, "path": self.path, "context": self.context,
            "plan": self.launched.lines if self.launched is not None else self.lines, "stages": stats,
            "engine": {**self.loop.counts, **dataclasses.asdict(self.engine.stats),
                       "max_seqs": self.opts.engine.max_seqs,
                       "micro_batches": self.engine.config.micro_batches, "alive": self.loop.alive,
                       "last_failure": self.loop.last_failure},
            "kv": self.kv_report(),
            "speculation": self.spec_report(),
            "faults": self.faults_report(),
            "server": {"pid": os.getpid(), "rss_bytes": process_rss_bytes()},
            "stream": self.timelines.summary(),
            "pipeline": self.pipeline_report(timings),
        }

    def pipeline_report(self, timings: list[list]) -> dict:
        """The last steps' times (ms, medians): each stage's wait for its input, its compute and its
        send (the last: head and sampling), and on Ray stages on this node the driver's remote
        calls, each hop between stages and the result's way back (cluster/timeline.py stage_hops)."""
        pipe = self.engine.pipeline
        driver = list(getattr(pipe, "timings", ()))
        same_clock = bool(driver) and self.launched is not None and pipe.same_clock()
        return stage_hops(driver, timings, same_clock)

    def spec_report(self) -> dict:
        """Speculative decoding's counters: the mode, verify rows, drafted and accepted tokens, the
        acceptance rate and the tokens a verify row gave on average (cluster/speculation.py)."""
        spec = self.engine.speculation
        if spec is None:
            return {"mode": "off", "why": "this pipeline does not verify drafts, or a model with recurrent layers "
                                          "has no spare state slots (--state-checkpoints 0)"}
        price = spec.price
        return {"mode": spec.mode, **spec.stats.as_dict(),
                "step_price": None if price is None else {"fixed_ms": round(price.fixed_ms, 3),
                                                          "token_ms": round(price.token_ms, 3),
                                                          "expert_scale": round(price.expert_scale, 3),
                                                          "draft_ms": round(price.draft_ms, 3),
                                                          "verify_row_ms": round(price.verify_row_ms, 3)}}

    def kv_report(self) -> dict:
        """The engine's KV ledger (read from the HTTP thread: plain counters, a moment stale at worst)."""
        bm = self.engine.scheduler.blocks
        return {"blocks": bm.n_blocks, "block_tokens": bm.block_size, "used_blocks": bm.n_used,
                "free_blocks": bm.n_available, "cached_blocks": bm.n_cached,
                "prefix_reuse": bm.prefix_reuse, "prompt_tokens": bm.stats.prompt_tokens,
                "cached_tokens": bm.stats.cached_tokens, "prefix_hit_rate": bm.hit_rate,
                "preemptions": bm.stats.preemptions, "host": host_report(bm.host)}

    def close(self) -> None:
        if self.poller is not None:
            self.poller.stop()
        self.loop.stop()
        if self.launched is not None:
            self.launched.shutdown()
