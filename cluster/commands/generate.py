"""`moeray generate [MODEL.gguf] --prompt TEXT ...`: stream a completion from one process.

Text goes to stdout as it is generated; the timing and memory lines go to stderr, so
`moeray generate ... > out.txt` captures only the text. The text comes from the same engine as
`moeray serve` (cluster/engine.py) over a one-process pipeline: same scheduling, same finish rules.
"""
from __future__ import annotations

import argparse
import sys

from moeray.cluster.config import CACHE_POLICIES, LaunchOptions, add_chat_format_argument, resolve_model
from moeray.errors import MoerayError
from moeray.stages.text.sampling import BadSamplingParam, SamplingParams

__all__ = ["add_arguments", "add_sampling_arguments", "run", "resolve_model", "sampling_params_from_args"]


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    """The sampling flags of `moeray generate` and `moeray run` (docs/sampling.md: ranges, order)."""
    d = SamplingParams
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--temperature", type=float, default=d.temperature, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=d.top_k, help="0 = off")
    p.add_argument("--top-p", type=float, default=d.top_p, help="1 = off")
    p.add_argument("--min-p", type=float, default=d.min_p, help="drop tokens less likely than this x the likeliest; "
                                                                 "0 = off")
    p.add_argument("--repetition-penalty", type=float, default=d.repetition_penalty,
                   help="> 1 discourages the prompt's and the output's tokens; 1 = off")
    p.add_argument("--presence-penalty", type=float, default=d.presence_penalty,
                   help="[-2, 2], subtracted from every token already generated; 0 = off")
    p.add_argument("--frequency-penalty", type=float, default=d.frequency_penalty,
                   help="[-2, 2], subtracted per time a token was generated; 0 = off")
    p.add_argument("--logit-bias", action="append", default=[], metavar="ID=BIAS",
                   help="add BIAS in [-100, 100] to token ID's logit (repeatable)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--stop", action="append", default=[], metavar="STR", help="stop before this text (repeatable)")


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    """The flags as SamplingParams; a bad value is a MoerayError naming the flag (before any load)."""
    bias = {}
    for item in args.logit_bias:
        token, _, value = item.partition("=")
        try:
            bias[int(token)] = float(value)
        except ValueError:
            raise MoerayError(f"--logit-bias {item}: give ID=BIAS, e.g. --logit-bias 42=-100") from None
    try:
        return SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
            min_p=args.min_p, repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
            frequency_penalty=args.frequency_penalty, logit_bias=bias, seed=args.seed, stop=tuple(args.stop))
    except BadSamplingParam as exc:
        raise MoerayError(f"--{exc.param.replace('_', '-')}: {exc}") from None


def check_logit_bias(params: SamplingParams, vocab_size: int) -> None:
    outside = [t for t, _ in params.logit_bias if t >= vocab_size]
    if outside:
        raise MoerayError(f"--logit-bias: token id {outside[0]} is not in this model's vocabulary "
                          f"(ids 0 to {vocab_size - 1})")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", help="GGUF file (default: the embedded upcycled SmolLM2 MoE)")
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn with the model's chat template")
    add_chat_format_argument(p)
    add_sampling_arguments(p)
    p.add_argument("--json", action="store_true", help="constrain the output to a JSON object (a grammar mask)")
    p.add_argument("--json-schema", metavar="SCHEMA", help="constrain the output to JSON matching this schema "
                                                           "(inline JSON, or a file path)")
    p.add_argument("--rebuild", action="store_true", help="rebuild the embedded default model first")
    p.add_argument("--exact", action="store_true",
                   help="debugging: dequantise every weight to float32 once (4 bytes a weight) instead of "
                        "computing from the GGUF's blocks; also MOERAY_BACKEND=exact|dequant|ggml")
    c = p.add_argument_group("expert cache (hits from slots on the device, misses from the host copy)")
    c.add_argument("--cache-budget", default="auto", metavar="SIZE",
                   help="bytes the expert cache may hold, e.g. 1GiB or 0 (no cache). auto: on CUDA all free VRAM "
                        "less a reserve; on CPU 200MiB, a simulated budget enforced byte for byte (default auto)")
    c.add_argument("--expert-cache", type=int, default=None, metavar="N",
                   help="at most N slots of the largest expert (within --cache-budget)")
    c.add_argument("--cache-policy", choices=CACHE_POLICIES, default=LaunchOptions.cache_policy,
                   help="static: the profile fill; adaptive: decayed heat, swaps with hysteresis; lru")
    c.add_argument("--cache-layout", choices=("global", "per-layer"), default="per-layer",
                   help="per-layer (default, as every stage): each layer's slots at its own blob size (slot "
                        "layer*q+n); global: slots of the largest blob, filled hottest first across layers")
    c.add_argument("--profile", metavar="FILE", help="routing profile (moeray msgpack, Strata STRP or colibri "
                                                     "heat); default for the embedded model: its recorded profile")
    c.add_argument("--record-routing", metavar="FILE", help="append every routing decision to this msgpack trace")


def run(args: argparse.Namespace) -> int:
    params = sampling_params_from_args(args)  # parameter errors before the (slow) load
    grammar = _grammar(args)
    path = resolve_model(args.model, args.rebuild)
    from moeray.stages.runtime.default_profile import resolve_profile

    args.profile = resolve_profile(args.profile, path)

    from moeray.cluster.generator import Generator
    from moeray.stages.gguf.reader import GGUFFile
    from moeray.stages.runtime.model import memory_report
    from moeray.stages.text.chat import chat_format
    from moeray.stages.text.tokenizer import Tokenizer

    gguf = GGUFFile(path)  # validates the whole file before anything is loaded
    tokenizer = Tokenizer.from_metadata(gguf.metadata, source=path)
    check_logit_bias(params, tokenizer.vocab_size)
    fmt = chat_format(tokenizer.chat_template, gguf.metadata.get("general.architecture"), getattr(args, "chat_format", None))
    tokenizer = tokenizer.with_rendered(fmt.markers())  # the reply shows the format's markers
    if grammar is not None:
        import dataclasses

        from moeray.stages.text.grammar import GrammarError, check_grammar

        try:
            check_grammar(grammar, tokenizer)
        except GrammarError as exc:
            raise MoerayError(f"--json-schema: {exc}") from None
        params = dataclasses.replace(params, grammar=grammar)
    if getattr(args, "exact", False):
        from moeray.stages.kernels.backend import set_backend

        set_backend("exact")
    model, cache = _load_with_experts(gguf, args)
    prompt = (tokenizer.encode(fmt.render(tokenizer, [{"role": "user", "content": args.prompt}]).prompt) if args.chat
              else tokenizer.encode(args.prompt))

    generator = Generator(model, tokenizer)
    for delta in generator.stream(prompt, params):
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    s = generator.stats
    print(
        f"prefill: {s.prefill_tokens} tokens in {s.prefill_s:.2f} s ({s.prefill_tok_s:.1f} tok/s); "
        f"decode: {s.decode_tokens} tokens in {s.decode_s:.2f} s ({s.decode_tok_s:.1f} tok/s)",
        file=sys.stderr,
    )
    print(_format_memory(memory_report(model)), file=sys.stderr)
    if cache is not None:
        print(_format_cache(cache.stats()), file=sys.stderr)
    model.experts.close()  # flushes a routing trace
    return 0


def _grammar(args) -> str | None:
    """--json / --json-schema as a grammar (stages/text/grammar.py), the one `response_format` gives."""
    import json
    import os

    from moeray.stages.text.grammar import json_grammar

    if args.json_schema is None:
        return json_grammar(None) if args.json else None
    text = args.json_schema
    if not text.lstrip().startswith("{") and os.path.isfile(text):
        with open(text) as f:
            text = f.read()
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise MoerayError(f"--json-schema is not JSON ({exc}); give a schema such as "
                          '\'{"type": "object", "properties": {"a": {"type": "integer"}}}\' or a file') from None
    if not isinstance(schema, dict):
        raise MoerayError("--json-schema must be a JSON object (a JSON schema)")
    return json_grammar(schema)


# On CPU the "device" is host RAM: 200 MiB of slots holds ~120 of the default model's 240 Q4_1
# experts (1.6 MiB each), enough to show the cache at work without taking the machine's memory.
CPU_DEFAULT_CACHE = 200 << 20


def _load_with_experts(gguf, args):
    """(model, ExpertCache or None) as the flags ask: the MoE blocks are built with the cache in
    front of the host copy. A budget of 0 runs every expert from the host copy; --record-routing
    still records."""
    from moeray.cache.attach import routing_trace
    from moeray.stages.runtime.model import StageModel, load_cached
    from moeray.stages.blocks.moe import HostExperts
    from moeray.units import parse_size

    cfg = gguf.config
    if not cfg.is_moe:
        if args.record_routing:
            raise MoerayError(f"{gguf.path}: a dense model has no routing to record")
        return StageModel(gguf, 0, cfg.n_layers), None
    if args.cache_budget == "auto":
        budget = CPU_DEFAULT_CACHE
    elif args.cache_budget.strip() == "0":
        budget = 0
    else:
        budget = parse_size(args.cache_budget)
    if budget == 0 and args.expert_cache is None:
        trace = routing_trace(args.record_routing, cfg, 0, cfg.n_layers) if args.record_routing else None
        return StageModel(gguf, 0, cfg.n_layers, experts=HostExperts(gguf, on_route=trace)), None
    return load_cached(gguf, budget_bytes=budget, profile=args.profile, policy=args.cache_policy,
                       record_routing=args.record_routing, layout=args.cache_layout, n_slots=args.expert_cache)


def _format_cache(st: dict) -> str:
    return (f"expert cache: {st['resident']} experts resident in {st['slots']} slots ({st['layout_message']}), "
            f"{st['used_bytes'] / 2**20:.0f} of {st['budget_bytes'] / 2**20:.0f} MiB; "
            f"{st['hits']} hits / {st['lookups']} lookups ({100 * st['hit_rate']:.1f}%), policy {st['policy']}")


def _format_memory(report: dict) -> str:
    def mib(n):
        return f"{n / 2**20:.0f} MiB"

    parts = [f"{k.removesuffix('_bytes').replace('_', ' ')} {mib(v)}" for k, v in report.items() if k.endswith("_bytes")]
    return "memory: " + ", ".join(parts)
