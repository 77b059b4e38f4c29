"""The one config tree: every default of the engine, the launch and the server lives here, once.

    ServeOptions ─┬─ launch: LaunchOptions   (stages, placement, expert caches: read by the driver)
                  │    └─ stage: StageOptions (kernels, threads, layouts, graphs: sent to every stage
                  │                           actor with its load; stages/kernels/settings.py)
                  └─ engine: EngineConfig    (KV slots, context, step packing: read by the engine)

`moeray serve`, `moeray run` and `moeray generate` build their flags from these dataclasses
(`add_engine_arguments`, `add_launch_arguments`), so a flag's default is the field's default
and a change here changes every command. The commands then fold this process's debugging
overrides (MOERAY_*, moeray/environment.py) into what they built, and print each one: the
stages on every node run the result. docs/configuration.md lists every field and override.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field, replace
from typing import Optional

from moeray import environment
from moeray.errors import ConfigError, MoerayError
from moeray.planner.kv import CACHE_TYPE_CHOICES
from moeray.stages.kernels.settings import BACKENDS, HOST_EXPERTS, REPACK_MODES, TRITON, StageOptions

CACHE_POLICIES = ("static", "adaptive", "lru")

# With no GPU, the stages run on these simulated cards, sized for the default model: 16 sequences
# of 512 tokens take 360 MiB of float32 KV cache over its 30 layers, the trunk (its GGUF blocks,
# the Q8_0 embedding on the first stage and again as the tied head on the last) ~74 MiB, and the
# caches then hold about half of the 380 MiB of Q4_1 experts (the hot half: most lookups hit).
DEFAULT_SIMULATED = "176MiB,176MiB,144MiB,144MiB"

# How the one process of `moeray serve --local` uses ggml's threads (stages/kernels/threads.ThreadSettings),
# where its StageOptions leave them unset: chosen by bench/serve_sweep.py beside llama-server.
LOCAL_THREADS = dict(poll=1, parallel_bytes=1 << 20, adapt=True)
# A model whose decode token reads more than BIG_TOKEN_BYTES of weights keeps every thread on every
# graph, its workers spinning (poll 100) between them: its steps take hundreds of milliseconds, so
# what one thread saves per graph (a wake-up, the barriers) is small beside them, and adapting was
# measured to lose: the 30B-A3B shape served to 4 clients gave 9.0 / 9.1 / 8.4 tok/s adapting
# against 11.6 / 12.1 / 11.7 with every thread fixed (docs/performance.md#served), while the default
# model's 1-client rate fell from 60 to 44 tok/s without adapting (poll 1).
BIG_TOKEN_BYTES = 1 << 30
BIG_LOCAL_THREADS = dict(poll=100, parallel_bytes=1 << 20, adapt=False)


def local_threads(token_bytes: int) -> dict:
    """`moeray serve --local`'s ggml thread settings for a model whose decode token reads
    `token_bytes` of weights (StageOptions' ggml_* fields, where set, win)."""
    return BIG_LOCAL_THREADS if token_bytes > BIG_TOKEN_BYTES else LOCAL_THREADS


@dataclass
class EngineConfig:
    max_seqs: int = 16  # sequence slots: requests running at once
    max_len: Optional[int] = None  # prompt + output tokens per request; None: the model's context
    token_budget: int = 128  # new tokens per micro-batch step
    prefill_chunk: int = 64  # prompt tokens of one request per step
    # ... and the step's tokens, when no sequence is decoding: nothing then waits on a bigger step,
    # and a long prompt's chunks of 512 (llama.cpp's ubatch) ran 3.2x faster than chunks of 64 on the
    # default model (bench/long_prompt.py, 512 tokens: 11.3 s of CPU against 35.7)
    prefill_alone: int = 512
    micro_batches: int = 2  # lanes: steps in flight at once
    step_timeout_s: float = 60.0  # a step slower than this counts as a hung stage
    # The KV cache, in blocks of 16 tokens shared by all running sequences: a fixed count, or a
    # fraction of the devices' free bytes; neither: the planner trades it against expert slots.
    kv_blocks: Optional[int] = None
    kv_fraction: Optional[float] = None
    prefix_reuse: bool = True  # reuse the KV of a prompt prefix another request computed
    # Hybrid models: checkpoints of the recurrent state the stages hold (cluster/state_checkpoints.py),
    # what prefix reuse resumes from; None: the planner trades them against KV and expert slots.
    state_checkpoints: Optional[int] = None
    # Speculative decoding (cluster/speculation.py): auto | off | ngram | draft | mtp; a request's
    # `speculative` flag overrides it. Draft lengths are priced per step (planner/draft_length.py),
    # at most max_draft tokens a row, and paused where they measure a loss. Off by default: on the
    # default model's CPU a drafted token costs most of a step, so auto gains little at one client
    # and runs within noise of plain decoding at 16 clients (0.94-1.02x; docs/speculative.md#measured).
    speculative: str = "off"
    max_draft: int = 32
    # On stages in several processes, a lone stream's next decode step is issued before the last one
    # comes back, its token sent from the last stage to the first directly (cluster/engine.py
    # _may_chain): the stages do not wait for the engine's round trip between its tokens.
    chained_decode: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.micro_batches <= self.max_seqs:
            raise MoerayError(f"need 1 <= micro_batches ({self.micro_batches}) <= max_seqs ({self.max_seqs})")
        for name in ("max_len", "token_budget", "prefill_chunk", "prefill_alone", "kv_blocks"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise MoerayError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.state_checkpoints is not None and self.state_checkpoints < 0:
            raise MoerayError(f"state_checkpoints must be >= 0 (0: none), got {self.state_checkpoints}")
        if self.kv_fraction is not None and not 0 < self.kv_fraction < 1:
            raise MoerayError(f"kv_fraction must be between 0 and 1 (a share of the free device bytes), "
                              f"got {self.kv_fraction}")
        if self.kv_blocks is not None and self.kv_fraction is not None:
            raise MoerayError("give --kv-blocks or --kv-fraction, not both")
        from moeray.cluster.speculation import MODES

        if self.speculative not in MODES:
            raise MoerayError(f"--speculative {self.speculative!r} is not one of {', '.join(MODES)}")
        if self.max_draft < 1:
            raise MoerayError(f"max_draft must be >= 1 (a draft's most tokens; --speculative off turns drafts off), "
                              f"got {self.max_draft}")


@dataclass
class LaunchOptions:
    n_stages: int = 4
    simulate: Optional[list[int]] = None  # byte budgets of simulated CPU devices, one per stage
    strategy: str = "PACK"  # placement group strategy: PACK | SPREAD
    objective: str = "latency"  # planner objective: latency | throughput
    split: str = "auto"  # or "K=8,15,23"
    # A stage keeps its whole trunk on its device (StageModel has no host-side trunk path yet),
    # so the planner is told exactly that instead of being free to place pieces on the host.
    trunk: str = "head=gpu,embed=gpu,layers=all"
    # Routing profile: the planner's heat and the caches' fill. None: the embedded default model's
    # recorded profile (stages/runtime/default_profile.py; the driver resolves it), uniform for other models.
    profile: Optional[str] = None
    # Every stage's expert cache: adaptive measured best on bench/cache.py's replay of the default
    # model (within 0.2 points of static when the profile is the traffic, up to 2.7 points better
    # when routing shifts, ~19 better with no profile); static | adaptive | lru.
    cache_policy: str = "adaptive"
    torch_threads: Optional[int] = None
    # How every stage computes (kernel backend, ggml's threads, weight layouts, graphs): sent to
    # each stage actor, which runs it whatever its node's environment says.
    stage: StageOptions = field(default_factory=StageOptions)
    # b of the planner's mass curve H(f) = 1 - (1 - f)^b; None: fitted to the profile's counts
    # (3 for a ranking without counts, 1 with no profile): planner/mass.py
    cover_b: Optional[float] = None
    timeout_s: float = 300.0  # probe, load, connect: a stage slower than this is reported
    address: Optional[str] = None  # join this Ray cluster instead of starting one
    # Every stage appends its routing to DIR/stage<i>.trace (a folder each node can write), so a
    # served run can be replayed offline against other policies and Belady's optimum.
    record_routing: Optional[str] = None
    verbose_plan: bool = False  # print every trunk decision and slot layout, not only the departures
    # The part of a GPU each stage reserves (0.5: two stages per card, each planned with half of
    # it); None: a card per stage while there are enough, else an even share of each.
    gpus_per_stage: Optional[float] = None
    # Speculative decoding's draft model: a small GGUF of the same vocabulary, run on the first
    # stage and priced there as trunk (its weights and a KV pool of the plan's block count).
    draft: Optional[str] = None
    # The host tier of every node (state checkpoints, then KV blocks its stages' pools evict, found
    # again by prefix hash): auto (1/8 of MemAvailable less the model's files, planner/kv.py), off,
    # a share of that (0.25) or a size (8GiB), split among the node's stages.
    kv_host: str = "auto"

    def __post_init__(self) -> None:
        from moeray.planner.kv import check_host_tier

        self.kv_host = check_host_tier(self.kv_host)
        if self.gpus_per_stage is not None and not 0 < self.gpus_per_stage <= 1:
            raise MoerayError(f"--gpus-per-stage {self.gpus_per_stage}: a stage runs on one card, give a share "
                              "0 < x <= 1 (0.5: two stages per card)")
        if self.cover_b is not None and not self.cover_b > 0:
            raise ConfigError("cover_b", self.cover_b, "b of the mass curve must be > 0, e.g. 3")
        if self.cache_policy not in CACHE_POLICIES:
            raise MoerayError(f"cache policy '{self.cache_policy}' is not one of {', '.join(CACHE_POLICIES)}")


@dataclass
class RequestLimits:
    """The most one request may ask of the server: beyond a bound it is a 4xx naming the field
    (413 for the body), checked before anything is rendered, tokenised or compiled, on every route
    that generates (cluster/edge.py). The bounds are well above what real clients send (OpenAI
    itself takes 4 stop strings, 128 tools, schemas of 5,000 properties nested 10 deep)."""
    max_body_bytes: int = 16 << 20  # a request's body; a 15 MiB prompt still gets its own answer
    max_json_depth: int = 64  # arrays and objects nested in the body
    max_messages: int = 4096  # messages (or input items) of one conversation
    max_stop: int = 16  # stop strings
    max_stop_chars: int = 1024  # characters of one stop string
    max_logit_bias: int = 1024  # logit_bias entries
    max_tools: int = 128  # tools (functions) offered
    max_schema_depth: int = 32  # objects and arrays nested in one JSON schema (a tool's, response_format's)
    max_schema_nodes: int = 20_000  # values in one JSON schema (5,000 properties take ~10,000)
    # A grammar compiled longer than this is a 400 (off the event loop, on a worker thread).
    grammar_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_json_depth", "max_messages", "max_stop", "max_stop_chars",
                     "max_logit_bias", "max_tools", "max_schema_depth", "max_schema_nodes"):
            if getattr(self, name) < 1:
                raise MoerayError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.grammar_timeout_s > 0:
            raise MoerayError(f"grammar_timeout_s must be > 0, got {self.grammar_timeout_s}")


LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps the server on this machine."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass
class ServeOptions:
    model: Optional[str] = None  # GGUF path; None = the embedded default model
    model_name: Optional[str] = None  # the id clients send; default: the file's stem
    # More ids the server answers to (vLLM's --served-model-name takes several); responses name model_name
    model_aliases: tuple[str, ...] = ()
    # Answer a request whatever model it names (as llama-server does): agents send their own names
    # for side calls (Claude Code's small fast model) and would otherwise get a 404
    any_model: bool = False
    local: bool = False  # one process, no stage actors (LocalPipeline)
    launch: LaunchOptions = field(default_factory=LaunchOptions)
    engine: EngineConfig = field(default_factory=EngineConfig)
    max_waiting: int = 64  # requests queued for a slot before 429
    limits: RequestLimits = field(default_factory=RequestLimits)
    # Requests the server holds beyond its running and waiting ones, each only until the door answers
    # it (a 429, a 4xx): Serve's max_ongoing_requests is max_seqs + max_waiting + this, so a burst
    # reaches the door (which refuses in milliseconds) instead of Serve's queue.
    door_requests: int = 256
    # Serve's own queue in front of the replica (max_queued_requests): beyond it Serve answers 429.
    serve_queue: int = 64
    # Host headers the server answers (a DNS-rebinding page names its own); None: any. `moeray
    # serve` fills in the loopback names when it binds a loopback address.
    allowed_hosts: Optional[tuple[str, ...]] = None
    # GET /metrics wants the API key like /v1/* (False: open, for a scraper that has none)
    metrics_need_key: bool = True
    # SIGTERM: stop admitting, let running requests finish for this long, then end the rest with an
    # error (a stream: an error event and [DONE]); Serve's graceful shutdown is given this and more.
    drain_s: float = 30.0
    api_key: Optional[str] = None
    metrics_interval_s: float = 2.0
    # Metrics through Ray (ray.util.metrics -> Prometheus). False (`--local --no-metrics`): none, and
    # no Ray at all: its metrics recorder cost the one process ~3 ms a token (docs/performance.md#served).
    metrics: bool = True
    # --local: bytes of the one simulated device (holds every expert of the default model)
    local_budget: int = 4 << 30
    # (--local's ggml threads are launch.stage.threads; None: every core the one process may run on)
    # How chat templates are called and replies read (stages/text/chat/): None = the GGUF's own family
    chat_format: Optional[str] = None
    # POST /v1/responses kept in memory for previous_response_id and GET /v1/responses/{id}: the most
    # recently used ones (a response continued from or read counts as used); 0 keeps none
    responses_store: int = 256
    # Output tokens of a request that sets no limit (llama-server's -n): None is 256 on the chat and
    # completions routes and the rest of the context on /v1/responses (Codex sends no limit)
    default_max_tokens: Optional[int] = None
    # A chat template used instead of the GGUF's (its text; `serve --chat-template FILE` reads it)
    chat_template: Optional[str] = None
    # Thinking tokens a reply may spend before its reasoning is closed, where a request sets none
    # (stages/text/reasoning_budget.py): -1 unlimited, 0 no thinking (llama-server's --reasoning-budget)
    reasoning_budget: int = -1

    def __post_init__(self) -> None:
        if self.max_waiting < 0 or self.door_requests < 1 or self.serve_queue < 1:
            raise MoerayError(f"need max_waiting >= 0, door_requests >= 1 and serve_queue >= 1; got {self.max_waiting}, "
                              f"{self.door_requests} and {self.serve_queue}")
        if self.drain_s < 0:
            raise MoerayError(f"drain_s must be >= 0 (0: end every request at once), got {self.drain_s}")


def resolve_model(path: str | None, rebuild: bool = False) -> str:
    """The GGUF to run: the given file, or the embedded default model (built on first use). A
    model in parts is named by any of its parts (stages/gguf/parts.py): the first is returned,
    as llama.cpp loads it; the parts themselves are checked when the header is read."""
    from pathlib import Path

    if path is None:
        from moeray.stages.gguf.default_model import default_model_path

        return str(default_model_path(rebuild=rebuild))
    if not Path(path).is_file():
        raise FileNotFoundError(f"{path}: no such file")
    from moeray.stages.gguf.parts import first_part_path

    first = first_part_path(path)
    return first if Path(first).is_file() else path


# ---------------------------------------------------------------- command-line flags


def add_chat_format_argument(p: argparse.ArgumentParser) -> None:
    from moeray.stages.text.chat import FORMATS

    p.add_argument("--chat-format", choices=("auto", *FORMATS), default="auto", metavar="NAME",
                   help="how the chat template is called and replies are read (reasoning, tool calls): "
                        f"{', '.join(FORMATS)}; auto (default): the GGUF's family, from its template's markers "
                        "(docs/chat-formats.md)")


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    d = EngineConfig
    g = p.add_argument_group("engine")
    g.add_argument("--max-seqs", type=int, default=d.max_seqs, help=f"sequences running at once (KV slots; default {d.max_seqs})")
    g.add_argument("--max-len", type=int, default=d.max_len,
                   help="prompt + output tokens per sequence (default: the model's context length)")
    g.add_argument("--micro-batches", type=int, default=None,
                   help=f"micro-batches in flight (default {d.micro_batches}; `moeray serve --local`: 1)")
    g.add_argument("--prefill-chunk", type=int, default=d.prefill_chunk, help=f"prompt tokens per request per step (default {d.prefill_chunk})")
    g.add_argument("--prefill-alone", type=int, default=d.prefill_alone,
                   help="prompt tokens per step while no sequence is decoding (nothing waits on a bigger step; "
                        f"default {d.prefill_alone})")
    g.add_argument("--token-budget", type=int, default=d.token_budget, help=f"new tokens per micro-batch step (default {d.token_budget})")
    g.add_argument("--step-timeout", type=float, default=d.step_timeout_s,
                   help=f"seconds before a step counts as hung (default {d.step_timeout_s:.0f})")
    kv = g.add_mutually_exclusive_group()
    kv.add_argument("--kv-blocks", type=int, default=d.kv_blocks,
                    help="KV cache blocks of 16 tokens on every stage (default: the planner trades KV against expert slots)")
    kv.add_argument("--kv-fraction", type=float, default=d.kv_fraction,
                    help="share of the devices' free bytes the KV cache takes, e.g. 0.3 (instead of --kv-blocks)")
    g.add_argument("--no-prefix-reuse", action="store_true",
                   help="compute every prompt in full (default: reuse the KV of a prompt prefix already computed)")
    g.add_argument("--state-checkpoints", type=int, default=d.state_checkpoints, metavar="N",
                   help="hybrid models (DeltaNet layers): checkpoints of the recurrent state the stages keep, "
                        "from which a conversation's next turn resumes, and which speculation's verify rows borrow "
                        "as spares (0: none, every prompt prefilled whole and no drafts; default: the planner "
                        "trades them against KV and expert slots)")
    g.add_argument("--speculative", choices=("auto", "off", "ngram", "draft", "mtp"), default=d.speculative,
                   help="speculative decoding: draft tokens and verify them in one step (auto: every drafter the "
                        f"model has, priced per step; default {d.speculative}); a request's `speculative` overrides it")
    g.add_argument("--max-draft", type=int, default=d.max_draft,
                   help=f"the most drafted tokens one verify row carries (default {d.max_draft})")
    g.add_argument("--no-chained-decode", action="store_true",
                   help="on stages in several processes, wait for each decode step before issuing the next (default: a "
                        "lone stream's next step goes ahead, its token sent from the last stage to the first)")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    d = EngineConfig
    return EngineConfig(max_seqs=args.max_seqs, max_len=args.max_len, token_budget=args.token_budget,
                        prefill_chunk=args.prefill_chunk, prefill_alone=args.prefill_alone,
                        micro_batches=args.micro_batches if args.micro_batches is not None else d.micro_batches,
                        step_timeout_s=args.step_timeout, kv_blocks=args.kv_blocks, kv_fraction=args.kv_fraction,
                        prefix_reuse=not args.no_prefix_reuse,
                        state_checkpoints=getattr(args, "state_checkpoints", None), speculative=args.speculative,
                        max_draft=args.max_draft, chained_decode=not args.no_chained_decode)


def add_limits_arguments(p: argparse.ArgumentParser) -> None:
    """RequestLimits as flags (docs/operations.md#bounds)."""
    d = RequestLimits
    g = p.add_argument_group("request bounds (beyond one: a 4xx naming the field)")
    for name, what in (("max_body_bytes", "bytes of a request's body (413 beyond)"),
                       ("max_json_depth", "arrays and objects nested in a request's JSON"),
                       ("max_messages", "messages of one conversation"),
                       ("max_stop", "stop strings of one request"),
                       ("max_stop_chars", "characters of one stop string"),
                       ("max_logit_bias", "logit_bias entries of one request"),
                       ("max_tools", "tools of one request"),
                       ("max_schema_depth", "objects and arrays nested in one JSON schema (tools, response_format)"),
                       ("max_schema_nodes", "values in one JSON schema")):
        g.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name), metavar="N",
                       help=f"{what} (default {getattr(d, name)})")
    g.add_argument("--grammar-timeout", type=float, default=d.grammar_timeout_s, metavar="S",
                   help="seconds a request's grammar (response_format, a forced tool call) may take to compile, "
                        f"off the event loop, before it is a 400 (default {d.grammar_timeout_s:.0f})")


def limits_from_args(args: argparse.Namespace) -> RequestLimits:
    names = [f for f in RequestLimits.__dataclass_fields__ if f != "grammar_timeout_s"]
    return RequestLimits(**{n: getattr(args, n) for n in names}, grammar_timeout_s=args.grammar_timeout)


def add_launch_arguments(p: argparse.ArgumentParser) -> None:
    d = LaunchOptions
    g = p.add_argument_group("stages and placement")
    g.add_argument("--stages", type=int, default=d.n_stages, help=f"pipeline stages, one device each (default {d.n_stages})")
    g.add_argument("--simulate-devices", metavar="SIZES",
                   help="CPU devices with these byte budgets, e.g. 256MiB,256MiB,192MiB,192MiB "
                        f"(default with no GPU: {DEFAULT_SIMULATED}, the first --stages of them)")
    g.add_argument("--spread", action="store_true", help="place stages on different nodes (SPREAD), not PACK")
    g.add_argument("--address", help="join this Ray cluster (default: start a local one)")
    g.add_argument("--objective", choices=("latency", "throughput"), default=d.objective)
    g.add_argument("--split", default=d.split, help="auto, or K=8,15,23: the first layer of stages 1..S-1")
    g.add_argument("--profile", metavar="PATH", default=d.profile,
                   help="routing profile for the planner and the stages' expert caches")
    g.add_argument("--cache-policy", choices=CACHE_POLICIES, default=d.cache_policy,
                   help="the stages' expert caches: static (the profile fill), adaptive (decayed heat, swaps "
                        f"with hysteresis) or lru (default {d.cache_policy})")
    g.add_argument("--cover-b", type=float, metavar="B", default=d.cover_b,
                   help="b of the planner's mass curve H(f)=1-(1-f)^b (default: fitted to the profile's counts)")
    g.add_argument("--record-routing", metavar="DIR", default=d.record_routing,
                   help="every stage appends its routing decisions to DIR/stage<i>.trace (replay them with "
                        "bench/cache.py or bench/serve_hits.py)")
    g.add_argument("--verbose", action="store_true",
                   help="print the plan's every trunk decision and slot layout, not only those that depart from the default")
    g.add_argument("--draft", metavar="MODEL.gguf", default=d.draft,
                   help="a draft model for speculative decoding: a small GGUF of the same vocabulary, run on the "
                        "first stage (--speculative auto uses it where it drafts better than the n-gram lookup)")
    g.add_argument("--kv-host", metavar="SIZE", default=d.kv_host,
                   help="host memory each node gives its stages' evicted KV blocks and state checkpoints, found "
                        "again by prefix and copied back instead of prefilled: auto (1/8 of MemAvailable less the "
                        "model's files), off, a share (0.25) or a size (8GiB) (default auto)")
    g.add_argument("--gpus-per-stage", type=float, metavar="SHARE", default=d.gpus_per_stage,
                   help="the part of a GPU each stage reserves, e.g. 0.5: two stages share a card, each "
                        "planned with half of it (default: a card per stage, shared evenly when stages > GPUs)")
    add_stage_arguments(p)


def add_stage_arguments(p: argparse.ArgumentParser) -> None:
    """StageOptions as flags: how every stage computes (defaults: the fields')."""
    d = StageOptions
    g = p.add_argument_group("how every stage computes (sent to each stage; docs/configuration.md)")
    g.add_argument("--backend", "--kernels", dest="backend", choices=BACKENDS, default=d.backend,
                   help="kernel backend of every stage: ggml (quantised blocks, ggml's CPU kernels), dequant "
                        "(pure torch), exact (float32 copies: debugging, 4 bytes a weight); auto picks the best")
    g.add_argument("--repack", choices=REPACK_MODES, default=d.repack,
                   help="weight layout: fast (ggml's repacked rows wherever it has kernels), on (only where a "
                        f"row's bits stay batch-invariant), off (the GGUF's blocks) (default {d.repack})")
    g.add_argument("--host-experts", choices=HOST_EXPERTS, default=d.host_experts,
                   help="routed experts on the host: auto (a copy in huge pages when it leaves 4 GiB free), "
                        f"mapped (read in place from the file), repacked (always a copy) (default {d.host_experts})")
    g.add_argument("--ggml-poll", type=int, metavar="N", default=d.ggml_poll,
                   help="how long idle ggml workers spin for the next graph (ggml's poll level; default 100, "
                        "serve --local: by model size)")
    g.add_argument("--ggml-parallel-kb", type=int, metavar="KB", default=d.ggml_parallel_kb,
                   help="a graph reading fewer KiB of weights runs on one thread (default 0, serve --local: 1024)")
    g.add_argument("--ggml-adapt", choices=("on", "off"), default=None,
                   help="each graph learns whether one thread or all compute it faster (default off, "
                        "serve --local: on for models under 1 GiB a token)")
    g.add_argument("--triton", choices=TRITON, default=d.triton,
                   help="the card's Triton GGUF kernels (auto: on CUDA when triton imports)")
    g.add_argument("--cache-type-k", "-ctk", dest="cache_type_k", choices=CACHE_TYPE_CHOICES, default=d.cache_type_k,
                   help="how the KV cache stores K rows: f32, f16, q8_0, q4_0 (llama.cpp's -ctk); auto (default): "
                        "q8_0 on a stage where the room it frees buys expert slots worth more than its reads, else f16")
    g.add_argument("--cache-type-v", "-ctv", dest="cache_type_v", choices=CACHE_TYPE_CHOICES, default=d.cache_type_v,
                   help="how the KV cache stores V rows (llama.cpp's -ctv; an MLA model's latent follows K); "
                        "auto (default) as for K")
    g.add_argument("--fa-tiled-rows", type=int, metavar="N", default=d.fa_tiled_rows,
                   help="the fewest query rows of a sequence that take ggml's tiled flash attention (and from which "
                        f"quantised K/V are read as float32 for it; default {d.fa_tiled_rows}, ggml's own; 16 is faster "
                        "for short chunks over long contexts, but a prompt's last token then gets other logits "
                        "than recomputed alone: docs/kv-cache.md)")
    for name, what in (("hugepages", "weight copies in transparent huge pages"),
                       ("scratch-reuse", "graph intermediates share places once read"),
                       ("trunk-graph", "a layer's trunk as one ggml graph (off: torch's ops)"),
                       ("fused-moe", "routing and experts inside the trunk graph"),
                       ("stage-graph", "a decode step's layers as one graph")):
        g.add_argument(f"--no-{name}", action="store_true", help=f"debugging: turn off {what} (default on)")


def stage_options_from_args(args: argparse.Namespace, threads: Optional[int] = None) -> StageOptions:
    return StageOptions(backend=args.backend, threads=threads, ggml_poll=args.ggml_poll,
                        ggml_parallel_kb=args.ggml_parallel_kb,
                        ggml_adapt=None if args.ggml_adapt is None else args.ggml_adapt == "on", repack=args.repack,
                        host_experts=args.host_experts, hugepages=not args.no_hugepages,
                        scratch_reuse=not args.no_scratch_reuse, trunk_graph=not args.no_trunk_graph,
                        fused_moe=not args.no_fused_moe, stage_graph=not args.no_stage_graph, triton=args.triton,
                        cache_type_k=args.cache_type_k, cache_type_v=args.cache_type_v,
                        fa_tiled_rows=args.fa_tiled_rows)


def with_overrides(opts: LaunchOptions, say=lambda line: print(line, file=sys.stderr)) -> LaunchOptions:
    """`opts` with this process's debugging overrides (MOERAY_*, moeray/environment.py) folded in,
    each named by `say`: what a command runs, and sends to every stage, is then one config."""
    stage, lines = environment.fold(opts.stage, "stage")
    out, more = environment.fold(replace(opts, stage=stage), "launch")
    for line in lines + more:
        say(line)
    return out


def launch_options_from_args(args: argparse.Namespace, simulate: Optional[list[int]],
                             threads: Optional[int] = None) -> LaunchOptions:
    """LaunchOptions from the flags, this process's debugging overrides folded in (`with_overrides`)."""
    return with_overrides(LaunchOptions(
        n_stages=args.stages, simulate=simulate, strategy="SPREAD" if args.spread else "PACK",
        objective=args.objective, split=args.split, profile=args.profile, cache_policy=args.cache_policy,
        torch_threads=1 if simulate else None, stage=stage_options_from_args(args, threads),
        cover_b=args.cover_b, verbose_plan=getattr(args, "verbose", False), address=args.address,
        record_routing=args.record_routing, gpus_per_stage=args.gpus_per_stage, draft=getattr(args, "draft", None),
        kv_host=getattr(args, "kv_host", "auto")))


def simulated_devices(args: argparse.Namespace, has_gpus: bool, command: str) -> Optional[list[int]]:
    """The simulated budgets to run on: --simulate-devices, else with no GPU the default cards."""
    import sys

    from moeray.units import parse_sizes

    sim = args.simulate_devices
    if sim is None and not has_gpus:
        if args.stages > len(DEFAULT_SIMULATED.split(",")):
            raise MoerayError("no GPUs here: pass --simulate-devices with one size per stage")
        sim = ",".join(DEFAULT_SIMULATED.split(",")[: args.stages])
        print(f"moeray {command}: no GPUs in the cluster, simulating {sim}", file=sys.stderr)
    return parse_sizes(sim) if sim else None
