"""How a stage computes: one record, `StageOptions`, of every kernel and graph setting.

The config tree carries it (LaunchOptions.stage, cluster/config.py) and the driver sends it to
every stage actor, which makes it its process's (`use`) before it reads a weight: a stage on any
node runs what the driver decided. The kernels ask `current()` when they build something (a
matrix, a graph, a thread pool), never per multiply. A process that was given none (a bench
script, a test, `moeray generate`) runs the defaults with its own debugging overrides
(moeray/environment.py) folded in at first use, and says which.
"""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, replace
from typing import Callable, Optional

from moeray import environment
from moeray.errors import ConfigError
from moeray.planner.kv import CACHE_TYPE_CHOICES

log = logging.getLogger("moeray.kernels")

BACKENDS = ("auto", "ggml", "dequant", "exact")
REPACK_MODES = ("on", "fast", "off")
HOST_EXPERTS = ("auto", "mapped", "repacked")
TRITON = ("auto", "on", "off")

_WHY = {
    "backend": "choose one of auto, ggml, dequant, exact (auto: ggml where ggml-python loads, else dequant)",
    "repack": ("choose one of on, fast, off (on: ggml's repacked layout where a row's result stays the same "
               "at every batch size; fast: also Q4_K, whose rows then differ by ~1e-7 between batch sizes; "
               "off: the plain layout)"),
    "host_experts": ("choose auto (a copy when it fits), mapped (read the experts in place from the file "
                     "mapping) or repacked (always copy them at load, in ggml's repacked layout where it has "
                     "kernels: more RAM)"),
    "triton": "choose one of auto, on, off (auto: on CUDA when triton imports; on: on the CPU too, interpreted)",
    "cache_type_k": ("choose one of auto, f32, f16, q8_0, q4_0 for the K rows of the KV cache (auto: as the plan "
                     "prices it per stage, f16 without a plan)"),
    "cache_type_v": ("choose one of auto, f32, f16, q8_0, q4_0 for the V rows of the KV cache (auto: as the plan "
                     "prices it per stage, f16 without a plan)"),
}
_CHOICES = {"backend": BACKENDS, "repack": REPACK_MODES, "host_experts": HOST_EXPERTS, "triton": TRITON,
            "cache_type_k": CACHE_TYPE_CHOICES, "cache_type_v": CACHE_TYPE_CHOICES}


@dataclass(frozen=True)
class StageOptions:
    """Every setting of how a stage computes (docs/configuration.md has each one's measurements).

    backend           kernels of every matrix: ggml (the GGUF blocks, ggml's CPU kernels), dequant
                      (torch, dequantised per use; Triton on a card), exact (float32 copies, debugging)
    threads           ggml's threads; None: torch's count in this process; 0: every core the
                      process may run on (each process its own: stages on different hosts)
    ggml_poll         how long idle ggml workers spin for the next graph (poll level) ...
    ggml_parallel_kb  ... a graph reading fewer KiB of weights runs on one thread ...
    ggml_adapt        ... each graph learns whether one thread or all compute it faster;
                      None for each: the run's default (a stage: 100, 0, off; `serve --local`: by model size)
    repack            weight layout: fast (ggml's repacked rows wherever it has kernels), on (only
                      where a row's bits stay batch-invariant), off (the GGUF's plain blocks)
    host_experts      routed experts on the host: auto (a copy when it leaves room), mapped, repacked
    hugepages         weight copies in transparent huge pages
    scratch_reuse     a graph's intermediates share places once read (ggml's allocator's rule)
    trunk_graph       a layer's trunk (attention, norms, router) as one ggml graph
    fused_moe         the routing, routed experts, shared expert and dense FFN inside that graph
    stage_graph       a decode step's layers as one graph
    tiled_gemm        llama.cpp's tiled GEMM for K/IQ-quant matrices times 8+ rows (prefill; a
                      row's last float32 bit then depends on whether it ran tiled)
    sgemm_rows        llamafile's sgemm for plain Q8_0, Q4_0, Q5_0 matrices times at least this many
                      rows, 0: never (2: wherever it beats ggml's dot products; on the AVX2 build
                      `make venv` makes it gives a row the same bits, tests/stages/test_ggml_tiled.py)
    fa_tiled_rows     the fewest query rows of a sequence that take ggml's tiled flash attention
                      (float32 GEMMs over tiles of 64 keys; fewer rows: its query-by-query kernel),
                      and from which quantised keys and values are read as float32 for it. 64:
                      ggml's own count; 16 is faster for a returning turn's short chunk, but the two
                      kernels round differently, so a prompt's last token's logits then depend on
                      whether it was computed in the chunk or alone (docs/kv-cache.md)
    triton            the card's Triton GGUF kernels: auto, on, off
    cache_type_k      how the KV cache stores K rows and ...
    cache_type_v      ... V rows: f32, f16, q8_0, q4_0 (llama.cpp's -ctk / -ctv); auto: the plan's
                      choice per stage (planner/kv.py), f16 where nothing plans (docs/kv-cache.md)
    """
    backend: str = "auto"
    threads: Optional[int] = None
    ggml_poll: Optional[int] = None
    ggml_parallel_kb: Optional[int] = None
    ggml_adapt: Optional[bool] = None
    repack: str = "fast"
    host_experts: str = "auto"
    hugepages: bool = True
    scratch_reuse: bool = True
    trunk_graph: bool = True
    fused_moe: bool = True
    stage_graph: bool = True
    tiled_gemm: bool = True
    sgemm_rows: int = 2
    fa_tiled_rows: int = 64
    triton: str = "auto"
    cache_type_k: str = "auto"
    cache_type_v: str = "auto"

    def __post_init__(self) -> None:
        for name, choices in _CHOICES.items():
            if getattr(self, name) not in choices:
                raise ConfigError(name, getattr(self, name), _WHY[name])
        if not isinstance(self.sgemm_rows, int) or self.sgemm_rows < 0:
            raise ConfigError("sgemm_rows", self.sgemm_rows, "give a row count >= 0 (0: never llamafile's sgemm)")
        if not isinstance(self.fa_tiled_rows, int) or isinstance(self.fa_tiled_rows, bool) or self.fa_tiled_rows < 1:
            raise ConfigError("fa_tiled_rows", self.fa_tiled_rows,
                              "give a count of query rows, 1 or more (64: ggml's own, the default)")
        for name in ("threads", "ggml_poll", "ggml_parallel_kb"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 0):
                raise ConfigError(name, v, "give a count >= 0, or None for the default")

    def as_dict(self) -> dict:
        return asdict(self)


_current: StageOptions | None = None
_listeners: list[Callable[[], None]] = []


def current() -> StageOptions:
    """This process's options: those it was given (`use`), else the defaults with this process's
    debugging overrides, read once here and named in the log."""
    global _current
    if _current is None:
        opts, lines = environment.fold(StageOptions(), "stage")
        for line in lines:
            log.info(line)
        _current = opts
    return _current


def use(options: StageOptions) -> None:
    """Make `options` this process's: every matrix, graph and pool made after this call follows them."""
    global _current
    if not isinstance(options, StageOptions):
        raise TypeError(f"use() takes StageOptions, not {type(options).__name__}")
    changed = options != _current
    _current = options
    if changed:
        for forget in _listeners:
            forget()


def update(**changes) -> StageOptions:
    """This process's options with `changes` (checked as StageOptions checks them)."""
    use(replace(current(), **changes))
    return _current


def reset() -> None:
    """Forget the options: the next `current()` starts from the defaults and the environment again."""
    global _current
    _current = None
    for forget in _listeners:
        forget()


def snapshot() -> StageOptions | None:
    """What `restore` puts back: the options given or read so far (None: not yet)."""
    return _current


def restore(saved: StageOptions | None) -> None:
    if saved is not _current:
        reset() if saved is None else use(saved)


def on_change(forget: Callable[[], None]) -> None:
    """Call `forget` whenever the options change (a module's cached graphs, pools, resolved choices)."""
    _listeners.append(forget)
