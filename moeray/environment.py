"""The process environment: every variable moeray reads or sets, here and nowhere else.

What moeray does is decided by the config tree (cluster/config.py: ServeOptions, LaunchOptions,
StageOptions, EngineConfig), which the driver sends to every stage actor with its load. The
variables below are not a second way in:

- `MOERAY_*` DEBUGGING OVERRIDES (`OVERRIDES`): each stands for one field of the config tree. They
  are read once, in the process where a run's configuration is made (the `moeray` command, a
  bench script, a one-process run or test), folded into that configuration and named on a line
  (`fold`). A stage actor runs the configuration it was sent and never reads its environment, so
  a variable set on one node cannot make that node's stages differ from the others', and one set
  where `moeray serve` runs reaches every node through the configuration, visibly.
- Inputs that are not knobs: where built models go (MOERAY_CACHE_DIR), the API key's default
  (MOERAY_API_KEY: a secret stays out of argv), the Ray cluster to join (RAY_ADDRESS), the library
  path a foreign libggml could come from (LD_LIBRARY_PATH), Triton's interpreter (TRITON_INTERPRET),
  ggml's own switch for its tiled GEMM (GGML_CPU_TILED_MM, read by ggml itself in each process;
  moeray only reports it: StageOptions.tiled_gemm is the knob), the CMake flags `make venv` builds
  ggml-python with (CMAKE_ARGS, stages/kernels/ggml_build.py), and where the benches and tests find llama.cpp's tools (LLAMA_CPP_BIN, else PATH).
- Variables moeray SETS for the Ray processes it starts (`set_default`).

tests/ and bench/ may set variables for the processes they start; the package reads them only
through this module (tests/test_imports.py checks that no other module touches os.environ).
Torch-free and import-free: every layer of the package may ask it; nothing is read at import time.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
from dataclasses import dataclass
from typing import Callable

from moeray.errors import ConfigError


def _word(raw: str) -> str:
    return raw.strip().lower()


def _flag(raw: str) -> bool:
    v = raw.strip().lower()
    if v in ("1", "on", "true", "yes"):
        return True
    if v in ("0", "off", "false", "no"):
        return False
    raise ValueError("give 1 or 0")


def _count(raw: str) -> int:
    n = int(raw)
    if n < 0:
        raise ValueError("give a count >= 0")
    return n


def _rows(raw: str) -> int:
    if not raw.strip().isdigit() or int(raw) < 1:
        raise ValueError("give a count of query rows, 1 or more")
    return int(raw)


def _positive(raw: str) -> float:
    b = float(raw)
    if not b > 0:
        raise ValueError("must be > 0, e.g. 3")
    return b


def _triton(raw: str) -> str:
    """MOERAY_TRITON: 1 on (on the CPU too, through Triton's interpreter: the tests' switch), 0 off."""
    v = raw.strip().lower()
    return {"1": "on", "0": "off"}.get(v, v)


@dataclass(frozen=True)
class Override:
    name: str  # the variable
    field: str  # the config field it stands for: "stage.<name>" (StageOptions) or "launch.<name>"
    parse: Callable[[str], object]
    doc: str


OVERRIDES = (
    Override("MOERAY_BACKEND", "stage.backend", _word, "kernel backend: ggml | dequant | exact"),
    Override("MOERAY_THREADS", "stage.threads", _count, "ggml's threads (0: every core the process may use)"),
    Override("MOERAY_GGML_POLL", "stage.ggml_poll", _count, "how long ggml's idle workers spin (poll level)"),
    Override("MOERAY_GGML_PARALLEL_KB", "stage.ggml_parallel_kb", _count,
             "a graph reading fewer KiB of weights runs on one thread"),
    Override("MOERAY_GGML_ADAPT", "stage.ggml_adapt", _flag, "each graph learns one thread or all (1/0)"),
    Override("MOERAY_REPACK", "stage.repack", _word, "weight layout: fast | on | off"),
    Override("MOERAY_HOST_EXPERTS", "stage.host_experts", _word, "host experts: auto | mapped | repacked"),
    Override("MOERAY_HUGEPAGES", "stage.hugepages", _flag, "weight copies in transparent huge pages (1/0)"),
    Override("MOERAY_SCRATCH_REUSE", "stage.scratch_reuse", _flag, "graph intermediates share places (1/0)"),
    Override("MOERAY_TRUNK_GRAPH", "stage.trunk_graph", _flag, "a layer's trunk as one ggml graph (1/0)"),
    Override("MOERAY_FUSED_MOE", "stage.fused_moe", _flag, "routing and experts inside the trunk graph (1/0)"),
    Override("MOERAY_STAGE_GRAPH", "stage.stage_graph", _flag, "a decode step's layers as one graph (1/0)"),
    Override("MOERAY_TILED_GEMM", "stage.tiled_gemm", _flag, "llama.cpp's tiled K/IQ-quant GEMM at 8+ rows (1/0)"),
    Override("MOERAY_SGEMM_ROWS", "stage.sgemm_rows", _count,
             "llamafile's sgemm for Q8_0/Q4_0 products of at least this many rows (0: never)"),
    Override("MOERAY_FA_TILED_ROWS", "stage.fa_tiled_rows", _rows,
             "the fewest query rows that take ggml's tiled flash attention (64: ggml's own)"),
    Override("MOERAY_TRITON", "stage.triton", _triton, "the card's Triton kernels: auto | on (1) | off (0)"),
    Override("MOERAY_CACHE_TYPE_K", "stage.cache_type_k", _word, "KV cache K rows: auto | f32 | f16 | q8_0 | q4_0"),
    Override("MOERAY_CACHE_TYPE_V", "stage.cache_type_v", _word, "KV cache V rows: auto | f32 | f16 | q8_0 | q4_0"),
    Override("MOERAY_SPLIT_COVER_B", "launch.cover_b", _positive, "b of the planner's mass curve H(f)"),
)


def overrides(group: str) -> dict[str, tuple[str, str, object]]:
    """{field: (variable, its text, value)} for the overrides of `group` ("stage", "launch") set in
    this process. A value that does not parse is one line naming the variable."""
    out = {}
    for o in OVERRIDES:
        prefix, _, name = o.field.partition(".")
        raw = os.environ.get(o.name, "").strip()
        if prefix != group or not raw:
            continue
        try:
            value = o.parse(raw)
        except ValueError as exc:
            raise ConfigError(o.name, raw, f"{exc} ({o.doc}); unset it or fix it") from None
        out[name] = (o.name, raw, value)
    return out


def fold(options, group: str):
    """(`options` with this process's `group` overrides applied, a line per override). `options`
    is a frozen dataclass whose __post_init__ checks its fields (ConfigError): a value it refuses
    is reported under the variable's name."""
    found = overrides(group)
    if not found:
        return options, []
    try:
        out = dataclasses.replace(options, **{name: value for name, (_, _, value) in found.items()})
    except ConfigError as exc:
        var, raw, _ = found.get(exc.setting, (exc.setting, exc.value, None))
        raise ConfigError(var, raw, exc.why) from None
    lines = [f"moeray: debugging override {var}={raw} -> {group}.{name} = {getattr(out, name)!r} "
             f"(default {getattr(options, name)!r})" for name, (var, raw, _) in found.items()]
    return out, lines


# ---------------------------------------------------------------- inputs that are not knobs


def cache_dir() -> str | None:
    """MOERAY_CACHE_DIR: where the embedded default model and its profile are built (None: ~/.cache/moeray)."""
    return os.environ.get("MOERAY_CACHE_DIR") or None


def api_key() -> str | None:
    """MOERAY_API_KEY: the server's key when --api-key is not given."""
    return os.environ.get("MOERAY_API_KEY") or None


def ray_address() -> str | None:
    """RAY_ADDRESS: the Ray cluster to join when --address is not given."""
    return os.environ.get("RAY_ADDRESS") or None


def library_path() -> str:
    """LD_LIBRARY_PATH: where a foreign libggml could be loaded from (stages/kernels/ggml_lib.py)."""
    return os.environ.get("LD_LIBRARY_PATH", "")


def triton_interpreted() -> bool:
    """TRITON_INTERPRET=1: Triton runs kernels in its interpreter (on the CPU; the tests' way)."""
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def ggml_tiled_switch() -> str | None:
    """GGML_CPU_TILED_MM: ggml's own switch for llama.cpp's tiled GEMM (None: unset, on), reported by
    stages/kernels/ggml_lib.py tiled_gemm; ggml reads it itself."""
    return os.environ.get("GGML_CPU_TILED_MM")


def cmake_args(default: str) -> str:
    """CMAKE_ARGS: the flags ggml-python is built with (stages/kernels/ggml_build.py; the Makefile's)."""
    return os.environ.get("CMAKE_ARGS", default)


def llama_cpp_tool(name: str) -> str | None:
    """LLAMA_CPP_BIN, else PATH: llama.cpp's tool `name` (llama-server, llama-bench, llama-batched-bench,
    llama-gguf-split ...) for the benches and tests that run it beside moeray. LLAMA_CPP_BIN names the
    folder of a llama.cpp build's tools (build/bin); unset, the first `name` on PATH. None: not found."""
    folder = os.environ.get("LLAMA_CPP_BIN")
    if folder:
        path = os.path.join(folder, name)
        return path if os.path.isfile(path) and os.access(path, os.X_OK) else None
    return shutil.which(name)


def with_variable(name: str, value: str) -> dict[str, str]:
    """This process's environment with `name` set, for a process it starts (pip building ggml)."""
    return {**os.environ, name: value}


def set_default(name: str, value: str) -> None:
    """Set `name` for the processes this one starts (Ray's daemons and workers), unless set already."""
    os.environ.setdefault(name, value)
