"""The docs' figure tables, rendered from the results files the benches write (docs/results/NAME.json).

    .venv/bin/python bench/render_docs.py             # rewrite every table between its markers
    .venv/bin/python bench/render_docs.py --check     # exit 1 naming each page that differs from its results
    .venv/bin/python bench/render_docs.py --list      # every results file, its command, and whether it exists
    .venv/bin/python bench/render_docs.py --missing   # only the commands whose results file is not written yet

A figure is measured once, by the command of its `Source` below, which writes its results file with
the command, commit and date beside the figures (bench/results.py). A page holds a table as

    <!-- results: NAME -->
    ...what this script renders...
    <!-- /results: NAME -->

and this script owns everything between the two markers: a figure is never typed there. A row whose
results file is not there yet is left out, and the table's footer names the command that makes it.
To update a figure, run its command on a quiet machine, then this script. tests/test_docs_results.py
fails when a page and its results files disagree, naming both.
"""
from __future__ import annotations

import argparse
import re
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

from results import read_results  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path("docs/results")
PY = ".venv/bin/python"
SHAPE = {name: f'"$({PY} bench/shapes.py {name})"' for name in ("qwen3-30b-a3b", "qwen3.6-35b-a3b")}


@dataclass(frozen=True)
class Source:
    """One results file and the one command that writes it (run from the repository root)."""
    name: str  # docs/results/<name>.json
    args: str  # the bench and its flags, without the interpreter and --json

    @property
    def path(self) -> Path:
        return RESULTS / f"{self.name}.json"

    @property
    def bench(self) -> str:
        return self.args.split()[0]

    @property
    def command(self) -> str:
        return f"{PY} {self.args} --json {self.path}"


FAMILIES = {  # bench/shapes.py name -> the family and the cut its file holds
    "qwen3.6-35b-a3b": "Qwen3.6-35B-A3B (whole)",
    "qwen3-next-80b-a3b": "Qwen3-Next-80B-A3B (12 of 48 layers)",
    "gpt-oss-20b": "gpt-oss-20b (whole)",
    "deepseek-v2-lite": "DeepSeek-V2-Lite (whole)",
    "deepseek-v3": "DeepSeek-V3 (4 of 61 layers)",
    "kimi-k2": "Kimi-K2 (4 of 61 layers)",
    "glm-4.5-air": "GLM-4.5-Air (10 of 46 layers)",
}

SOURCES = [Source(*s) for s in [
    ("decode-default", "bench/decode.py --profile --batch 1 16 --caches 0,all --decode-tokens 128 --repeat 3"),
    ("decode-qwen3-30b-a3b", "bench/decode.py --shape qwen3-30b-a3b --batch 1 4 --decode-tokens 16 --caches 0 "
                             "--profile --forced-tokens --repeat 2"),
    ("decode-small-deepseek2", "bench/decode.py --model ~/.cache/moeray/shape-small-deepseek2-q4_k-random.gguf "
                               "--batch 1 16 --caches 0"),
    ("decode-layouts-qwen3-30b-a3b", "bench/decode.py --shape qwen3-30b-a3b --batch 16 --decode-tokens 16 "
                                     "--layouts on:auto,fast:auto --no-llama-cpp"),
    ("graph-families", "bench/graph_families.py"),
    ("hugepages", "bench/hugepages.py"),
    ("serve-default-local", 'bench/serve_sweep.py --llama-server --clients 16 1 --variant "moeray serve --local="'),
    ("serve-default-ray", 'bench/serve_sweep.py --clients 16 1 --repeat 2 --variant "moeray serve --local=" '
                          '--variant "moeray serve --local --no-metrics= -- --no-metrics"'),
    ("serve-default-stages4", 'bench/serve_sweep.py --llama-server --clients 16 1 '
                              '--variant "moeray serve --stages 4= -- --stages 4"'),
    ("stream-default-stages4", "bench/stream_timeline.py --llama-server --servers llama,local,stages --requests 5 "
                               "--warmup 1 --repeat 2"),
    ("serve-qwen3-30b-a3b", f'bench/serve_sweep.py --model {SHAPE["qwen3-30b-a3b"]} --llama-server --clients 4 1 '
                            '--max-tokens 16 --duration 60 --warmup 20 --forced-tokens --repeat 2 '
                            '--variant "moeray serve --local="'),
    ("serve-threads-qwen3-30b-a3b", f'bench/serve_sweep.py --model {SHAPE["qwen3-30b-a3b"]} --clients 4 '
                                    '--max-tokens 16 --duration 45 --warmup 20 '
                                    '--variant "threads adapting, poll 1=MOERAY_GGML_ADAPT=1 MOERAY_GGML_POLL=1" '
                                    '--variant "threads fixed, poll 100=MOERAY_GGML_ADAPT=0 MOERAY_GGML_POLL=100"'),
    ("serve-prefix-reuse", 'bench/serve_sweep.py --clients 16 --system-prompt-tokens 300 --duration 60 '
                           '--max-tokens 16 --variant "prefix reuse on=" '
                           '--variant "prefix reuse off= -- --no-prefix-reuse"'),
    ("plan", "bench/plan.py"),
    ("cache-half", "bench/cache.py --layout per-layer --sizes 30,60,120,180 --profile-from half"),
    ("cache-code", "bench/cache.py --layout per-layer --sizes 60,120 --profile-from code"),
    ("cache-none", "bench/cache.py --layout per-layer --sizes 60,120 --profile-from none"),
    ("serve-hits", "bench/serve_hits.py --clients 16 --warmup 30 --duration 40"),
    ("chaos-stages", "bench/chaos.py --minutes 5"),
    ("chaos-nodes", "bench/chaos.py --nodes 3 --minutes 4"),
    *((f"families-{n}", f"bench/families.py {n} --rows decode,prefill,batch16,serve --repeat 2") for n in FAMILIES),
    ("prefill-kernels-qwen3.6-4l", f'bench/prefill_profile.py --model "$({PY} bench/shapes.py qwen3.6-35b-a3b '
                                   '--layers 4)" --tokens 512 --kernels'),
    ("mla-ggml-16", "bench/mla_ggml.py --heads 16 --contexts 512,2048 --reps 100"),
    ("mla-ggml-128", "bench/mla_ggml.py --heads 128 --contexts 512,2048 --reps 20"),
    ("long-prompt-default", "bench/long_prompt.py --tokens 8192 --chunks 512 2048"),
    ("long-prompt-qwen3.6", f'bench/long_prompt.py --model {SHAPE["qwen3.6-35b-a3b"]} --tokens 8192 --chunks 512'),
    ("multi-turn-qwen3.6", f'bench/multi_turn.py --model {SHAPE["qwen3.6-35b-a3b"]} --prompt-tokens 512 '
                           '--answer-tokens 16 --new-tokens 64'),
    ("turn-decode-default", "bench/turn_decode.py --prompt-tokens 3000 --decode-tokens 64 --repeat 2"),
    ("turn-decode-qwen3-30b-a3b", "bench/turn_decode.py --shape qwen3-30b-a3b --prompt-tokens 2048 "
                                  "--decode-tokens 32"),
    ("kv-types-default-4096", "bench/kv_types.py --types f16,q8_0 --depths 4096 --threads 2 --decode-tokens 32"),
    ("decode-depth-qwen3.6", f'bench/hybrid_decode.py --model {SHAPE["qwen3.6-35b-a3b"]} --depth 64 4096 --threads 2'),
    ("deltanet", "bench/deltanet.py"),
    ("mla", "bench/mla.py --contexts 256,1024,4096 --reps 5"),
    ("sampling", "bench/sampling.py --rows 16"),
    ("huge-prompt", "bench/huge_prompt.py --llama-server --mb 20"),
    ("spec-default", "bench/spec.py --clients 1 16 --kinds code chat --max-tokens 64 --reps 2"),
    ("spec-ngram-mod", "bench/spec.py --llama-server --modes off auto --llama-modes none ngram-mod --clients 1"),
    ("spec-qwen3-30b-a3b", "bench/spec.py --shape qwen3-30b-a3b --llama-server --llama-modes none ngram-mod "
                           "--modes off auto --clients 1 --kinds code chat --max-tokens 48"),
    ("spec-price", "bench/spec_price.py --clients 1 16 --kinds code chat --max-tokens 64"),
    ("spec-steps", "bench/spec_steps.py --threads 1 --max-tokens 64"),
]]
BY_NAME = {s.name: s for s in SOURCES}


# ---------------------------------------------------------------- formatting

def f(x, d: int = 1) -> str:
    return "" if x is None else f"{x:,.{d}f}"


def x_(r) -> str:
    return "" if r is None else f"{r:.2f}×"


def pct(p) -> str:
    return "" if p is None else f"{100 * p:.1f}%"


def ms(s) -> str:
    """Seconds as ms (a figure under 10 ms keeps a decimal)."""
    return "" if s is None else f"{s * 1e3:,.1f} ms" if s < 0.01 else f"{s * 1e3:,.0f} ms"


def span(values, fmt=x_) -> str:
    v = [x for x in values if x is not None]
    if not v:
        return ""
    lo, hi = min(v), max(v)
    return fmt(lo) if fmt(lo) == fmt(hi) else f"{fmt(lo).rstrip('×')}–{fmt(hi)}"


def code(text: str) -> str:
    return f"`{text}`"


# ---------------------------------------------------------------- reading results

Results = dict[str, dict]  # source name -> its results file, only those written


def load_all(root: Path = ROOT) -> Results:
    out = {}
    for s in SOURCES:
        p = root / s.path
        if p.is_file():
            out[s.name] = read_results(p)
    return out


def decode_rows(data: dict) -> list[dict]:
    return data.get("rows", [])


def moeray_row(data: dict, cache: str, batch: int) -> dict | None:
    return next((r for r in decode_rows(data) if r["engine"] == "moeray" and str(r["cache"]) == cache
                 and r["batch"] == batch), None)


def sweep_ratio_base(rows: list[dict]) -> dict[int, dict]:
    """serve_sweep's yardstick: the best llama-server row per client count."""
    base: dict[int, dict] = {}
    for r in rows:
        if r["label"].startswith("llama-server") and r["tok_s"] > base.get(r["clients"], {}).get("tok_s", 0):
            base[r["clients"]] = r
    return base


def sweep_rows(data: dict) -> list[tuple[dict, float | None, float | None]]:
    """(row, out tok/s ratio to llama-server, TTFT p50 ratio) for every row of a serve_sweep file."""
    base = sweep_ratio_base(data["rows"])
    out = []
    for r in data["rows"]:
        b = base.get(r["clients"])
        mine = b is not None and b is not r and not r["label"].startswith("llama-server")
        out.append((r, r["tok_s"] / b["tok_s"] if mine else None,
                    r["ttft_p50"] / b["ttft_p50"] if mine and b.get("ttft_p50") else None))
    return out


def sweep_row(data: dict, clients: int, label_start: str = "moeray") -> tuple[dict, float | None, float | None] | None:
    return next((t for t in sweep_rows(data) if t[0]["clients"] == clients and t[0]["label"].startswith(label_start)),
                None)


def families_row(data: dict, row: str) -> dict | None:
    return next((r for r in data.get("rows", []) if r["row"] == row), None)


# ---------------------------------------------------------------- the tables

@dataclass(frozen=True)
class Table:
    name: str
    page: str
    header: list[str]
    sources: list[str]
    rows: Callable[[Results], list[list[str]]]
    footer: bool = True  # name each source's command under the table (the README's rows carry their own)


def readme_rows(R: Results) -> list[list[str]]:
    out = []

    def cmd(name: str) -> str:
        run = R[name]["run"]
        return code(run["command"]) + (f" at `{run['commit']}`" if run.get("commit") else "")

    def against(rs: list[dict], key: str, who: str = "llama.cpp") -> str:
        """'1.01× / 0.94× llama.cpp', or nothing where the run had no llama.cpp beside it."""
        ratios = [r.get(key) for r in rs]
        return " / ".join(x_(v) for v in ratios) + f" {who}" if all(v is not None for v in ratios) else ""

    if "decode-default" in R:
        d = R["decode-default"]
        for cache, what in (("all", "every expert resident"), ("0", "host path")):
            rs = [moeray_row(d, cache, b) for b in (1, 16)]
            if all(rs):
                out.append([f"decode, default model, {what}, 1 / 16 sequences",
                            " / ".join(f(r["decode_tok_s"]) for r in rs) + " tok/s",
                            against(rs, "decode_vs_llama_cpp"), cmd("decode-default")])
        rs = [moeray_row(d, "all", b) for b in (1, 16)]
        if all(rs):
            out.append(["prefill, default model, every expert resident, 1 / 16 prompts of 64 tokens",
                        " / ".join(f(r["prefill_tok_s"]) for r in rs) + " tok/s",
                        against(rs, "prefill_vs_llama_cpp"), "same run"])
    if "decode-qwen3-30b-a3b" in R:
        rs = [r for b in (1, 4, 16) if (r := moeray_row(R["decode-qwen3-30b-a3b"], "0", b))]
        out.append([f"decode, Qwen3-30B-A3B shape, host path, {' / '.join(str(r['batch']) for r in rs)} sequences",
                    " / ".join(f(r["decode_tok_s"]) for r in rs) + " tok/s",
                    against(rs, "decode_vs_llama_cpp"), cmd("decode-qwen3-30b-a3b")])
    for name, what in (("serve-default-local", "served, default model, `serve --local`"),
                       ("serve-default-stages4", "served, default model, 4 Ray stages"),
                       ("serve-qwen3-30b-a3b", "served, Qwen3-30B-A3B shape, `serve --local`")):
        if name not in R:
            continue
        mine = [t for t in sweep_rows(R[name]) if not t[0]["label"].startswith("llama-server")]
        clients = " / ".join(str(t[0]["clients"]) for t in mine)
        out.append([f"{what}, {clients} clients",
                    " / ".join(f(t[0]["tok_s"]) for t in mine) + " tok/s, TTFT p50 "
                    + " / ".join(ms(t[0]["ttft_p50"]) for t in mine),
                    (" / ".join(x_(t[1]) for t in mine) + " llama-server, TTFT "
                     + " / ".join(x_(t[2]) for t in mine)) if any(t[1] for t in mine) else "", cmd(name)])
    fams = {n: R[f"families-{n}"] for n in FAMILIES if f"families-{n}" in R}
    if fams:
        def rng(row: str, key: str = "ratio") -> str:
            return span(families_row(d, row)[key] for d in fams.values() if families_row(d, row))
        out.append([f"every family at its real widths ({len(fams)} of {len(FAMILIES)} files measured: "
                    + ", ".join(FAMILIES[n].split(" (")[0] for n in fams) + ")",
                    "[per family](docs/performance-families.md#results)",
                    f"decode 1 / 16 sequences {rng('decode')} / {rng('batch16')}, prefill of 512 tokens "
                    f"{rng('prefill')} llama.cpp; served to 4 clients {rng('serve')} llama-server",
                    code(f"{PY} bench/families.py NAME --rows decode,prefill,batch16,serve --repeat 2 "
                         f"--json docs/results/families-NAME.json")])
    if "long-prompt-qwen3.6" in R:
        rows = R["long-prompt-qwen3.6"]["rows"]
        mine = next((r for r in rows if r["engine"] == "moeray"), None)
        ref = next((r for r in rows if r["engine"] == "llama.cpp"), None)
        if mine:
            out.append([f"prefill of a {mine['tokens']:,}-token prompt, Qwen3.6-35B-A3B file (hybrid)",
                        f"{f(mine['prefill_tok_s'])} tok/s",
                        f"{x_(mine['prefill_tok_s'] / ref['prefill_tok_s'])} llama-bench" if ref else "",
                        cmd("long-prompt-qwen3.6")])
    if "multi-turn-qwen3.6" in R:
        rows = R["multi-turn-qwen3.6"]["rows"]
        mine = next((r for r in rows if r["engine"] == "moeray" and r.get("checkpoints")), None)
        ref = next((r for r in rows if r["engine"] == "llama-server"), None)
        if mine:
            out.append(["a conversation's second turn, Qwen3.6-35B-A3B file, state checkpoints",
                        f"TTFT {mine['turn2_ttft_s']:.2f} s ({mine['turn2_prefilled']} of {mine['turn2_prompt']} "
                        "tokens prefilled)",
                        f"{x_(ref['turn2_ttft_s'] / mine['turn2_ttft_s'])} llama-server" if ref else "",
                        cmd("multi-turn-qwen3.6")])
    if "turn-decode-qwen3-30b-a3b" in R:
        rows = R["turn-decode-qwen3-30b-a3b"]["rows"]
        mine = next((r for r in rows if r["engine"] == "moeray"), None)
        ref = next((r for r in rows if r["engine"] == "llama-server"), None)
        if mine:
            out.append([f"decode of a conversation's second turn at {mine['turn2_prompt']:,} tokens of context, "
                        "Qwen3-30B-A3B shape",
                        f"{f(mine['turn2_ms'])} ms a token",
                        f"{x_(ref['turn2_ms'] / mine['turn2_ms'])} llama-server" if ref else "",
                        cmd("turn-decode-qwen3-30b-a3b")])
    if "plan" in R:
        d = R["plan"]
        r = d["rows"][0]
        out.append([f"placement search, {r['stages']} stages, {r['layers']} layers × {r['experts']} experts",
                    f"{r['median_ms']:.2f} ms", f"Strata's C++ search: {d['strata_ms']:g} ms", cmd("plan")])
    if "serve-hits" in R:
        d = R["serve-hits"]
        pred = [s["predicted"] for s in d["stages"] if s.get("predicted") is not None]
        out.append([f"served expert-cache hit rate, {len(d['stages'])} stages, {d['clients']} clients",
                    f"{pct(d['aggregate']['measured'])} (predicted {span(pred, pct)} per stage)",
                    f"Belady's optimum: {pct(d['aggregate']['belady'])}", cmd("serve-hits")])
    if "chaos-stages" in R:
        s = R["chaos-stages"]["summary"]
        d = R["chaos-stages"]
        out.append([f"a stage SIGKILLed every {d['kill_every']:g} s, {d['clients']} streaming clients, "
                    f"{s['minutes']:g} min",
                    f"{s['failed_bad']} hangs; serving again after {f(s['recovery_s_median'])} s (median)", "",
                    cmd("chaos-stages")])
    return out


def decode_table(R: Results) -> list[list[str]]:
    out = []
    for name, model in (("decode-default", "default"), ("decode-qwen3-30b-a3b", "Qwen3-30B-A3B shape"),
                        ("decode-small-deepseek2", "small DeepSeek-V3-shaped (MLA)")):
        if name not in R:
            continue
        rows = decode_rows(R[name])
        for r in rows:
            if r["engine"] != "moeray":
                continue
            where = {"0": "host path", "all": "every expert resident"}.get(str(r["cache"]), f"cache {r['cache']}")
            out.append([model, where, str(r["batch"]), f(r["prefill_tok_s"]), f(r["decode_tok_s"]),
                        x_(r.get("prefill_vs_llama_cpp")), x_(r.get("decode_vs_llama_cpp")),
                        f(r.get("bandwidth_bound_tok_s"))])
        ref = [r for r in rows if r["engine"] == "llama.cpp"]
        if ref:
            out.append([f"{model}, llama.cpp", "—", " / ".join(str(r["batch"]) for r in ref),
                        " / ".join(f(r["prefill_tok_s"]) for r in ref), " / ".join(f(r["decode_tok_s"]) for r in ref),
                        "", "", ""])
    return out


def profile_table(R: Results) -> list[list[str]]:
    profs = [(n, R[n]["profile"]) for n in ("decode-default", "decode-qwen3-30b-a3b") if n in R and R[n].get("profile")]
    if not profs:
        return []
    parts: dict[str, list[str]] = {}
    order = sorted({p for _, prof in profs for p in prof["parts"]},
                   key=lambda p: -max(prof["parts"].get(p, 0.0) for _, prof in profs))
    for p in order:
        if max(prof["parts"].get(p, 0.0) for _, prof in profs) >= 0.01:
            parts[p] = [f(prof["parts"][p], 2) + " ms" if p in prof["parts"] else "" for _, prof in profs]
    cols = {"decode-default": 0, "decode-qwen3-30b-a3b": 1}
    rows = []
    for p, cells in parts.items():
        row = ["", ""]
        for (n, _), c in zip(profs, cells):
            row[cols[n]] = c
        rows.append([p, *row])
    total = ["", ""]
    for n, prof in profs:
        total[cols[n]] = f"**{f(prof['ms_per_token'], 2)} ms**"
    rows.append(["**total**", *total])
    return rows


def graph_modes_table(R: Results) -> list[list[str]]:
    if "graph-families" not in R:
        return []
    groups = defaultdict(dict)
    for r in R["graph-families"]["rows"]:
        groups[(r["family"], r["where"])][r["batch"]] = r["median_ms"]
    out = []
    for (family, where), by_batch in groups.items():
        cells = []
        for b in (1, 16):
            m = by_batch.get(b)
            cells.append(" / ".join(f(m[k], 2) for k in ("torch", "off", "layer", "stage")) if m else "")
        out.append([f"{family}, {'every expert resident' if where == 'resident' else where + ' path' if where == 'host' else where}",
                    *cells])
    return out


def layouts_table(R: Results) -> list[list[str]]:
    out = []
    if "decode-layouts-qwen3-30b-a3b" in R:
        for r in decode_rows(R["decode-layouts-qwen3-30b-a3b"]):
            out.append([f"Qwen3-30B-A3B shape, 16 sequences, layout `{r.get('layout')}`",
                        f"{f(r['decode_tok_s'])} tok/s decode, {f(r['prefill_tok_s'])} prefill"])
    if "hugepages" in R:
        for label, v in R["hugepages"]["ms"].items():
            out.append([f"default model, 1 sequence, {label}",
                        f"{statistics.median(v):.1f} ms CPU a token (median of {len(v)} rounds)"])
    return out


def serve_table(name: str) -> Callable[[Results], list[list[str]]]:
    def rows(R: Results) -> list[list[str]]:
        if name not in R:
            return []
        return [[t[0]["label"], str(t[0]["clients"]), f(t[0]["tok_s"]), ms(t[0]["ttft_p50"]), ms(t[0]["itl_p50"]),
                 ms(t[0]["itl_p99"]), str(len(t[0]["errors"])), x_(t[1]), f(t[0].get("cores"), 2)]
                for t in sweep_rows(R[name])]
    return rows


def stream_table(R: Results) -> list[list[str]]:
    """bench/stream_timeline.py's rows: one streamed client on each server, in the order they ran, with
    its tok/s against llama-server's (its better run), its ITL p50 against `--local`'s in the same
    round, and on Ray stages the pipeline's per-hop times (GET /v1/stages)."""
    if "stream-default-stages4" not in R:
        return []
    rows = [r for r in R["stream-default-stages4"]["rows"] if "itl_p50_ms" in r]
    llama = max((r["tok_s"] for r in rows if r["label"].startswith("llama-server")), default=None)
    out, local = [], None
    for r in rows:
        if r["label"].endswith("--local"):
            local = r
        hops = (r.get("pipeline") or {}).get("hops_ms")
        moeray = r["label"].startswith("moeray")
        at = {k: None if r.get(k) is None else r[k] / 1e3 for k in ("ttft_p50_ms", "itl_p50_ms", "itl_p99_ms")}
        out.append([r["label"], f(r["tok_s"]), ms(at["ttft_p50_ms"]), ms(at["itl_p50_ms"]),
                    ms(at["itl_p99_ms"]), x_(r["tok_s"] / llama) if llama and moeray else "",
                    x_(r["itl_p50_ms"] / local["itl_p50_ms"]) if local and r is not local and moeray else "",
                    " / ".join(f(h, 2) for h in hops) + " ms" if hops else ""])
    return out


def prefix_table(R: Results) -> list[list[str]]:
    if "serve-prefix-reuse" not in R:
        return []
    out = []
    for r in R["serve-prefix-reuse"]["rows"]:
        n = max(r["requests"], 1)
        out.append([r["label"], str(r["requests"]), f(r["prompt_tokens"], 0),
                    f"{f(r['cached_tokens'], 0)} ({pct(r['cached_tokens'] / max(r['prompt_tokens'], 1))})",
                    f((r["prompt_tokens"] - r["cached_tokens"]) / n, 0), ms(r["ttft_p50"]), ms(r.get("ttft_p99")),
                    str(len(r["errors"]))])
    return out


def turn_decode_table(R: Results) -> list[list[str]]:
    """bench/turn_decode.py's rounds: each engine's decode ms a token in turn 1 and turn 2 of one
    conversation, and moeray's turn 2 against llama-server's in the same round."""
    out = []
    for name, model in (("turn-decode-default", "default model"), ("turn-decode-qwen3-30b-a3b", "Qwen3-30B-A3B shape")):
        if name not in R:
            continue
        rows, i = R[name]["rows"], 0
        while i < len(rows):  # a round: moeray, then llama-server where it ran
            pair = rows[i:i + 2] if i + 1 < len(rows) and rows[i + 1]["engine"] != rows[i]["engine"] else rows[i:i + 1]
            i += len(pair)
            ref = next((r for r in pair if r["engine"] == "llama-server"), None)
            for r in sorted(pair, key=lambda r: r["engine"] != "llama-server"):
                joined = {True: "yes", False: "no"}.get(r.get("turn2_consecutive"), "")
                vs = x_(ref["turn2_ms"] / r["turn2_ms"]) if ref is not None and r is not ref else ""
                out.append([model, r["engine"], f(r["turn1_ms"], 2), f(r["turn2_ms"], 2),
                            f(r["turn2_ms"] / r["turn1_ms"], 2), f"{r['turn2_reused']:,} of {r['turn2_prompt']:,}",
                            joined, vs])
    return out


def plan_table(R: Results) -> list[list[str]]:
    if "plan" not in R:
        return []
    out = []
    for r in R["plan"]["rows"]:
        n = r["placements"]
        out.append([r["search"].replace("x", " × "), r["trunk"], f"{n:,}" if n < 10 ** 7 else f"{n:.1e}",
                    f(r["median_ms"], 2), f(r["cpu_median_ms"], 2), "K=" + ",".join(map(str, r["split"]))])
    return out


def cache_table(R: Results) -> list[list[str]]:
    out = []
    for name in ("cache-half", "cache-code", "cache-none"):
        if name not in R:
            continue
        for r in R[name]["rows"]:
            out.append([name.split("-")[1], f"{r['slots']} ({pct(r['held_fraction'])})", pct(r["predicted_counts"]),
                        pct(r["predicted_curve"]), pct(r["static"]), pct(r["adaptive"]), pct(r["lru"]),
                        pct(r["lru_inf"]), pct(r["belady"])])
    return out


def hits_table(R: Results) -> list[list[str]]:
    if "serve-hits" not in R:
        return []
    d = R["serve-hits"]
    out = []
    for r in d["stages"]:
        ratio = r["measured"] / r["belady"] if r["belady"] else None
        out.append([str(r["stage"]), f"{r['layers'][0]}–{r['layers'][1] - 1}", str(r["slots"]), pct(r["predicted"]),
                    pct(r["measured"]), pct(r["belady"]), f(ratio, 2), f(r["lookups"], 0)])
    a = d["aggregate"]
    out.append(["all", "", "", "", pct(a["measured"]), pct(a["belady"]), f(a["measured_over_belady"], 2),
                f(sum(r["lookups"] for r in d["stages"]), 0)])
    return out


def chaos_table(R: Results) -> list[list[str]]:
    out = []
    for name in ("chaos-stages", "chaos-nodes"):
        if name not in R:
            continue
        d = R[name]
        s = d["summary"]
        kinds = defaultdict(int)
        for fault in d["faults"]:
            kinds[fault["kind"]] += 1
        rec = [fault["recovered_s"] for fault in d["faults"] if fault["kind"] != "node-add" and fault["recovered_s"]]
        out.append([code(d["run"]["command"].split("bench/chaos.py ")[1].split(" --json")[0]),
                    ", ".join(f"{n} {k}" for k, n in kinds.items()), str(s["requests"]), str(s["succeeded"]),
                    f"{s['failed_openai_shaped']} / {s['failed_bad']}",
                    f"{s['not_in_flight_succeeded']} of {s['not_in_flight']} ({pct(s['not_in_flight_success_rate'])})",
                    f"median {f(s['recovery_s_median'])} s, {span(rec, lambda v: f'{v:.1f} s')}",
                    f"{s['rss_before_mib']} → {s['rss_after_mib']} MiB ({pct(s['rss_growth'])})"])
    return out


def families_table(R: Results) -> list[list[str]]:
    out = []
    for n, label in FAMILIES.items():
        d = R.get(f"families-{n}")
        if d is None:
            continue
        cells = []
        for row in ("decode", "prefill", "batch16"):
            r = families_row(d, row)
            cells.append("" if r is None else
                         f"{f(r['moeray'], 2)} / {f(r['llama_cpp'], 2)} tok/s, **{x_(r['ratio'])}**"
                         + (f" (pairs {span(r['ratios'])})" if len(r["ratios"]) > 1 else ""))
        out.append([label, *cells])
    return out


def families_serve_table(R: Results) -> list[list[str]]:
    out = []
    for n, label in FAMILIES.items():
        d = R.get(f"families-{n}")
        r = families_row(d, "serve") if d else None
        if r is None:
            continue
        out.append([label, f"{f(r['moeray'], 2)} / {f(r['llama_cpp'], 2)} tok/s", f"**{x_(r['ratio'])}**",
                    x_(r.get("ttft_ratio"))])
    return out


def kernels_table(R: Results) -> list[list[str]]:
    if "prefill-kernels-qwen3.6-4l" not in R:
        return []
    k = R["prefill-kernels-qwen3.6-4l"]["kernels"]
    rows = sorted(k.items(), key=lambda kv: -max(kv[1].values()))
    out = [[name, f(v["moeray_cpu_s"], 2), f(v["llama_cpp_cpu_s"], 2)] for name, v in rows
           if max(v.values()) >= 0.005]
    out.append(["total", f(sum(v["moeray_cpu_s"] for v in k.values()), 2),
                f(sum(v["llama_cpp_cpu_s"] for v in k.values()), 2)])
    return out


def mla_table(R: Results) -> list[list[str]]:
    out = []
    for name in ("mla-ggml-16", "mla-ggml-128"):
        for r in R.get(name, {}).get("rows", []):
            out.append([f"{r['heads']}, {r['keys']:,}", f(r["fa f32"], 3), f(r["fa f16"], 3),
                        x_(r["fa f32"] / r["fa f16"]), f(r["mm f32"], 3)])
    return out


def hybrid_table(R: Results) -> list[list[str]]:
    out = []
    for name, model in (("long-prompt-default", "default model"), ("long-prompt-qwen3.6", "Qwen3.6 file")):
        if name not in R:
            continue
        rows = R[name]["rows"]
        ref = next((r for r in rows if r["engine"] == "llama.cpp"), None)
        for r in (r for r in rows if r["engine"] == "moeray"):
            out.append([f"{r['tokens']:,}-token prompt, {model}, {r['chunk']}-token chunks",
                        f"{f(r['prefill_tok_s'])} tok/s, {f(r['cpu_s'])} CPU s",
                        f"{f(ref['prefill_tok_s'])} tok/s, {f(ref['cpu_s'])} CPU s" if ref else "",
                        f"**{x_(r['prefill_tok_s'] / ref['prefill_tok_s'])}**" if ref else "",
                        x_(ref["cpu_s"] / r["cpu_s"]) if ref else ""])
    if "multi-turn-qwen3.6" in R:
        rows = R["multi-turn-qwen3.6"]["rows"]
        ref = next((r for r in rows if r["engine"] == "llama-server"), None)
        for r in (r for r in rows if r["engine"] == "moeray"):
            with_ = "with state checkpoints" if r.get("checkpoints") else "without checkpoints"
            out.append([f"second turn's TTFT, Qwen3.6 file, {with_} ({r['turn2_prefilled']} of {r['turn2_prompt']} "
                        "tokens prefilled)", f"{r['turn2_ttft_s']:.2f} s",
                        f"{ref['turn2_ttft_s']:.2f} s ({ref['turn2_prefilled']} of {ref['turn2_prompt']} prefilled)"
                        if ref else "", x_(ref["turn2_ttft_s"] / r["turn2_ttft_s"]) if ref else "", ""])
    return out


def decode_depth_table(R: Results) -> list[list[str]]:
    """bench/hybrid_decode.py: one sequence's decode token at each depth, moeray beside llama.cpp."""
    if "decode-depth-qwen3.6" not in R:
        return []
    rows = R["decode-depth-qwen3.6"]["rows"]
    ref = {r["depth"]: r for r in rows if r["engine"] == "llama.cpp"}
    out = []
    for r in (r for r in rows if r["engine"] == "moeray"):
        x = ref.get(r["depth"])
        out.append([f"{r['depth']:,}", f"{f(r['wall_ms'])} ms", f"{f(x['wall_ms'])} ms" if x else "",
                    f"**{x_(x['wall_ms'] / r['wall_ms'])}**" if x else "", x_(x["cpu_ms"] / r["cpu_ms"]) if x else ""])
    return out


def kv_depth_table(R: Results) -> list[list[str]]:
    """bench/kv_types.py: a 512-token chunk and decode over `depth` cached tokens per KV cache type, moeray
    beside llama-bench with the same -ctk / -ctv."""
    out = []
    for name in ("kv-types-default-4096",):
        if name not in R:
            continue
        rows = R[name]["rows"]
        ref = {(r["type"], r["depth"]): r for r in rows if r["engine"] == "llama.cpp"}
        for r in (r for r in rows if r["engine"] == "moeray"):
            x = ref.get((r["type"], r["depth"]))
            out.append([f"`{r['type']}`", f"{r['depth']:,}", f(r["prefill_tok_s"]), f(x["prefill_tok_s"]) if x else "",
                        f"**{x_(r['prefill_tok_s'] / x['prefill_tok_s'])}**" if x else "", f(r["decode_tok_s"]),
                        f(x["decode_tok_s"]) if x else "",
                        f"**{x_(r['decode_tok_s'] / x['decode_tok_s'])}**" if x else ""])
    return out


def deltanet_table(R: Results) -> list[list[str]]:
    if "deltanet" not in R:
        return []
    return [[r["kind"], str(r["batch"]), str(r["tokens"]), f(r["ggml_ms"], 2), f(r["torch_ms"], 2),
             x_(r["torch_ms"] / r["ggml_ms"])] for r in R["deltanet"]["rows"]]


def mla_absorbed_table(R: Results) -> list[list[str]]:
    if "mla" not in R:
        return []
    return [[f"{r['tokens']:,}", f(r["absorbed_ms"]), f(r["decompress_ms"]), x_(r["ratio"]), f"{r['max_diff']:.0e}"]
            for r in R["mla"]["rows"]]


def sampling_table(R: Results) -> list[list[str]]:
    if "sampling" not in R:
        return []
    rows = R["sampling"]["rows"]
    out = [[r["mix"], f(r["step_s"] * 1e3, 2) + " ms", f"{r['extra_per_row_s'] * 1e6:+,.0f} µs"] for r in rows]
    if rows:
        out.append(["the model's decode step for the same rows", f(rows[0]["decode_s"] * 1e3, 1) + " ms", ""])
    return out


def huge_prompt_table(R: Results) -> list[list[str]]:
    if "huge-prompt" not in R:
        return []
    return [[r["label"], f"{r['big_status']} after {r['big_s']:.2f} s", f"{r['small_s']:.2f} s", f"{r['alone_s']:.2f} s"]
            for r in R["huge-prompt"]["rows"]]


def spec_table(R: Results) -> list[list[str]]:
    if "spec-default" not in R:
        return []
    rows = R["spec-default"]["rows"]
    out = []
    for kind in dict.fromkeys(r["kind"] for r in rows):
        for n in dict.fromkeys(r["clients"] for r in rows):
            off = next((r for r in rows if r["label"].endswith(" off") and r["kind"] == kind and r["clients"] == n), None)
            auto = next((r for r in rows if r["label"].endswith(" auto") and r["kind"] == kind and r["clients"] == n),
                        None)
            if not (off and auto):
                continue
            s = auto.get("spec") or {}
            out.append([kind, str(n), f(off["tok_s"]), f(auto["tok_s"]), x_(auto["tok_s"] / off["tok_s"]),
                        f"{s.get('accepted', '')} / {s.get('drafted', '')}" if s else ""])
    return out


def spec_ngram_mod_table(R: Results) -> list[list[str]]:
    """One client, each prompt kind: moeray off / auto beside llama-server none / ngram-mod (tok/s)."""
    if "spec-ngram-mod" not in R:
        return []
    rows = R["spec-ngram-mod"]["rows"]
    out = []
    for kind in dict.fromkeys(r["kind"] for r in rows):
        got = {r["label"]: r for r in rows if r["kind"] == kind and r["clients"] == 1}
        off, auto = got.get("moeray --speculative off"), got.get("moeray --speculative auto")
        none, mod = got.get("llama-server --spec-type none"), got.get("llama-server --spec-type ngram-mod")
        if not (off and auto and none and mod):
            continue
        s = auto.get("spec") or {}
        out.append([kind, f(off["tok_s"]), f(auto["tok_s"]), f(none["tok_s"]), f(mod["tok_s"]),
                    f"**{x_(auto['tok_s'] / mod['tok_s'])}**", x_(auto["tok_per_cpu_s"] / mod["tok_per_cpu_s"]),
                    f"{s.get('accepted', '')} / {s.get('drafted', '')}" if s else ""])
    return out


def spec_30b_table(R: Results) -> list[list[str]]:
    if "spec-qwen3-30b-a3b" not in R:
        return []
    rows = R["spec-qwen3-30b-a3b"]["rows"]
    out = []
    for label in dict.fromkeys(r["label"] for r in rows):
        mine = {r["kind"]: r for r in rows if r["label"] == label and r["clients"] == 1}
        acc = ", ".join(f"{r['spec']['accepted']} / {r['spec']['drafted']}" for r in mine.values() if r.get("spec"))
        out.append([label, *(f(mine[k]["tok_s"]) if k in mine else "" for k in ("code", "chat")), acc])
    return out


def spec_price_table(R: Results) -> list[list[str]]:
    if "spec-price" not in R:
        return []
    out = []
    for key, steps in R["spec-price"]["steps"].items():
        groups = defaultdict(list)
        for s in steps:
            if not s["prefill"]:
                groups[(s["decode_rows"], s["drafted"] > 0)].append(s)
        for (rows, drafted), v in sorted(groups.items()):
            ratios = [x["ms"] / x["predicted_ms"] for x in v if x["predicted_ms"]]
            out.append([key.replace("/", ", ") + " client(s)", str(rows), "yes" if drafted else "no", str(len(v)),
                        f(statistics.median(x["ms"] for x in v)),
                        f(statistics.median(ratios), 2) if ratios else ""])
    return out


def spec_steps_table(R: Results) -> list[list[str]]:
    if "spec-steps" not in R:
        return []
    rows = R["spec-steps"]["rows"]
    one = next((r["median_ms"] for r in rows if r["tokens"] == 1), None)
    return [[str(r["tokens"]), str(r["steps"]), f(r["median_ms"]), x_(r["median_ms"] / one) if one else ""]
            for r in rows]


def missing_rows(R: Results) -> list[list[str]]:
    """Every results file a table reads that is not written yet: the command that writes it."""
    where = defaultdict(list)
    for t in TABLES:
        link = t.page.removeprefix("docs/") if t.page.startswith("docs/") else "../" + t.page
        for s in t.sources:
            where[s].append(f"[{Path(t.page).name}]({link})")
    return [[code(BY_NAME[n].command), ", ".join(dict.fromkeys(where[n]))] for n in BY_NAME if n not in R]


TABLES = [
    Table("readme", "README.md", ["measurement", "moeray", "against", "command"],
          ["decode-default", "decode-qwen3-30b-a3b", "serve-default-local", "serve-default-stages4",
           "serve-qwen3-30b-a3b", *(f"families-{n}" for n in FAMILIES), "long-prompt-qwen3.6", "multi-turn-qwen3.6",
           "turn-decode-qwen3-30b-a3b", "plan", "serve-hits", "chaos-stages"], readme_rows, footer=False),
    Table("decode", "docs/performance.md",
          ["model", "experts", "sequences", "prefill tok/s", "decode tok/s", "prefill vs llama.cpp",
           "decode vs llama.cpp", "bandwidth bound tok/s"],
          ["decode-default", "decode-qwen3-30b-a3b", "decode-small-deepseek2"], decode_table),
    Table("decode-profile", "docs/performance.md", ["part", "default model", "Qwen3-30B-A3B shape"],
          ["decode-default", "decode-qwen3-30b-a3b"], profile_table),
    Table("graph-modes", "docs/performance.md",
          ["family, experts", "1 sequence: torch / off / layer / stage (ms)", "16 sequences: torch / off / layer / stage (ms)"],
          ["graph-families"], graph_modes_table),
    Table("layouts", "docs/performance.md", ["variant", "measured"], ["decode-layouts-qwen3-30b-a3b", "hugepages"],
          layouts_table),
    Table("served-local", "docs/performance.md",
          ["server", "clients", "out tok/s", "TTFT p50", "ITL p50", "ITL p99", "errors", "vs llama-server", "cores"],
          ["serve-default-local"], serve_table("serve-default-local")),
    Table("served-ray", "docs/performance.md",
          ["server", "clients", "out tok/s", "TTFT p50", "ITL p50", "ITL p99", "errors", "vs llama-server", "cores"],
          ["serve-default-ray"], serve_table("serve-default-ray")),
    Table("served-stages", "docs/performance.md",
          ["server", "clients", "out tok/s", "TTFT p50", "ITL p50", "ITL p99", "errors", "vs llama-server", "cores"],
          ["serve-default-stages4"], serve_table("serve-default-stages4")),
    Table("stream-stages", "docs/performance.md",
          ["server", "tok/s (whole request)", "TTFT p50", "ITL p50", "ITL p99", "vs llama-server",
           "ITL p50 vs --local", "hops"], ["stream-default-stages4"], stream_table),
    Table("served-30b", "docs/performance.md",
          ["server", "clients", "out tok/s", "TTFT p50", "ITL p50", "ITL p99", "errors", "vs llama-server", "cores"],
          ["serve-qwen3-30b-a3b"], serve_table("serve-qwen3-30b-a3b")),
    Table("served-threads", "docs/performance.md",
          ["server", "clients", "out tok/s", "TTFT p50", "ITL p50", "ITL p99", "errors", "vs llama-server", "cores"],
          ["serve-threads-qwen3-30b-a3b"], serve_table("serve-threads-qwen3-30b-a3b")),
    Table("prefix-reuse", "docs/performance.md",
          ["server", "requests", "prompt tokens", "cached (usage)", "prefill computed per request", "TTFT p50",
           "TTFT p99", "errors"], ["serve-prefix-reuse"], prefix_table),
    Table("plan", "docs/performance.md", ["search", "trunk", "placements", "median ms", "CPU ms", "split"], ["plan"],
          plan_table),
    Table("cache", "docs/performance.md",
          ["profile", "slots (share of pairs)", "predicted (counts)", "predicted (H, fitted b)", "static", "adaptive",
           "lru (1 copy/step)", "lru (unlimited)", "Belady"], ["cache-half", "cache-code", "cache-none"], cache_table),
    Table("serve-hits", "docs/performance.md",
          ["stage", "layers", "slots", "predicted", "measured", "Belady", "measured / Belady", "lookups"],
          ["serve-hits"], hits_table),
    Table("chaos", "docs/performance.md",
          ["run", "faults", "requests", "succeeded", "failed: OpenAI-shaped / hang or reset",
           "not in flight at a fault: succeeded", "serving again after a fault", "server RSS"],
          ["chaos-stages", "chaos-nodes"], chaos_table),
    Table("families", "docs/performance-families.md",
          ["family (file)", "decode, 1 sequence, at depth 512", "prefill, 512 tokens", "decode, 16 sequences"],
          [f"families-{n}" for n in FAMILIES], families_table),
    Table("families-serve", "docs/performance-families.md",
          ["family (file)", "moeray / llama-server", "ratio", "TTFT p50 ratio"],
          [f"families-{n}" for n in FAMILIES], families_serve_table),
    Table("prefill-kernels", "docs/performance-families.md", ["kernel class", "moeray CPU s", "llama.cpp CPU s"],
          ["prefill-kernels-qwen3.6-4l"], kernels_table),
    Table("kv-depth", "docs/performance.md",
          ["K and V", "depth", "moeray prefill tok/s", "llama.cpp prefill tok/s", "ratio", "moeray decode tok/s",
           "llama.cpp decode tok/s", "ratio"], ["kv-types-default-4096"], kv_depth_table),
    Table("decode-depth", "docs/performance-families.md",
          ["depth (tokens cached)", "moeray ms a token", "llama.cpp ms a token", "ratio wall", "ratio CPU"],
          ["decode-depth-qwen3.6"], decode_depth_table),
    Table("mla-ggml", "docs/performance-families.md",
          ["heads, cached rows", "flash attention, float32 rows (ms)", "float16 rows (ms)", "float32 / float16",
           "`mul_mat`, softmax, `mul_mat` (ms)"], ["mla-ggml-16", "mla-ggml-128"], mla_table),
    Table("hybrid-vs-llama", "docs/hybrid.md", ["bench", "moeray", "llama.cpp", "ratio wall", "ratio CPU"],
          ["long-prompt-default", "long-prompt-qwen3.6", "multi-turn-qwen3.6"], hybrid_table),
    Table("turn-decode", "docs/performance.md",
          ["model", "engine", "turn 1 ms a token", "turn 2 ms a token", "turn 2 / turn 1", "turn 2 reused",
           "one run of blocks", "turn 2 vs llama-server"], ["turn-decode-default", "turn-decode-qwen3-30b-a3b"],
          turn_decode_table),
    Table("deltanet", "docs/hybrid.md", ["step", "batch", "tokens", "ggml ms", "torch ms", "torch / ggml"],
          ["deltanet"], deltanet_table),
    Table("mla", "docs/models.md", ["cached tokens", "absorbed ms", "decompressed ms", "decompressed / absorbed",
                                    "max difference"], ["mla"], mla_absorbed_table),
    Table("sampling", "docs/sampling.md", ["parameters", "`sample()` on every row", "extra per row"], ["sampling"],
          sampling_table),
    Table("huge-prompt", "docs/sampling.md",
          ["server", "the huge prompt answered", "the small request beside it", "the small request alone"],
          ["huge-prompt"], huge_prompt_table),
    Table("spec-default", "docs/speculative.md",
          ["prompts", "clients", "`off` tok/s", "`auto` tok/s", "`auto` / `off`", "accepted / drafted"],
          ["spec-default"], spec_table),
    Table("spec-ngram-mod", "docs/speculative.md",
          ["prompts", "moeray `off`", "moeray `auto`", "llama-server plain", "llama-server `ngram-mod`",
           "`auto` / `ngram-mod`", "same, tokens per CPU-second", "accepted / drafted"],
          ["spec-ngram-mod"], spec_ngram_mod_table),
    Table("spec-30b", "docs/speculative.md", ["server", "code tok/s", "chat tok/s", "accepted / drafted"],
          ["spec-qwen3-30b-a3b"], spec_30b_table),
    Table("spec-price", "docs/speculative.md",
          ["requests", "decode rows", "drafted", "steps", "median ms", "measured / predicted"],
          ["spec-price"], spec_price_table),
    Table("spec-steps", "docs/speculative.md", ["tokens in the step", "steps", "median ms", "/ a 1-token step"],
          ["spec-steps"], spec_steps_table),
    Table("missing", "docs/performance.md", ["command", "rows on"], [], missing_rows, footer=False),
]
BY_TABLE = {t.name: t for t in TABLES}


# ---------------------------------------------------------------- rendering

def cell(text: str) -> str:
    return text.replace("|", "\\|")


def made_by(source: Source, R: Results) -> str:
    data = R.get(source.name)
    if data is None:
        return f"{code(source.command)}: not measured yet"
    run = data["run"]
    at = f" at `{run['commit']}`" + (" with local changes" if run.get("dirty") else "") if run.get("commit") else ""
    return f"{code(run['command'])}{at}"


def render_table(t: Table, R: Results) -> str:
    rows = t.rows(R)
    lines = []
    if rows:
        lines += ["| " + " | ".join(t.header) + " |", "|" + "---|" * len(t.header)]
        lines += ["| " + " | ".join(cell(c) for c in r) + " |" for r in rows]
    elif t.name == "missing":
        lines.append("Every results file is written.")
    if t.footer:
        srcs = [BY_NAME[s] for s in t.sources]
        if lines:
            lines.append("")
        if len(srcs) == 1:
            lines.append(f"Made by {made_by(srcs[0], R)}.")
        else:
            lines += ["Made by:", ""] + [f"- {made_by(s, R)}" for s in srcs]
    return "\n".join(lines)


MARKER = re.compile(r"^(<!-- results: (?P<name>[\w.-]+) -->\n)(?P<body>.*?)(\n?^<!-- /results: (?P=name) -->$)",
                    re.S | re.M)


def render_page(text: str, page: str, R: Results) -> str:
    """`text` with every marked table rendered anew (an unknown name is an error: it would never be filled)."""
    def sub(m: re.Match) -> str:
        t = BY_TABLE.get(m.group("name"))
        if t is None or t.page != page:
            raise ValueError(f"{page}: table '{m.group('name')}' is not one bench/render_docs.py renders for this page")
        return m.group(1) + render_table(t, R) + "\n" + m.group(4).lstrip("\n")
    return MARKER.sub(sub, text)


def pages() -> list[str]:
    return sorted({t.page for t in TABLES})


def check(root: Path = ROOT) -> list[str]:
    """Problems, one line each: a page whose table is not what its results files render (naming both),
    a table missing from its page, a results file that no table reads or that another command wrote."""
    problems = []
    R = load_all(root)
    for name, data in R.items():
        words = data["run"]["command"].split()
        if len(words) < 2 or words[1] != BY_NAME[name].bench:
            problems.append(f"{BY_NAME[name].path}: written by `{data['run']['command']}`, "
                            f"but its rows are {BY_NAME[name].bench}'s (`{BY_NAME[name].command}`)")
    known = {s.path.name for s in SOURCES}
    for p in sorted((root / RESULTS).glob("*.json")):
        if p.name not in known:
            problems.append(f"{RESULTS / p.name}: no table reads it (add its Source and Table in bench/render_docs.py, "
                            "or remove it)")
    for page in pages():
        text = (root / page).read_text()
        found = {m.group("name") for m in MARKER.finditer(text)}
        for t in TABLES:
            if t.page == page and t.name not in found:
                problems.append(f"{page}: no <!-- results: {t.name} --> ... <!-- /results: {t.name} --> block")
        try:
            want = render_page(text, page, R)
        except ValueError as exc:
            problems.append(str(exc))
            continue
        if want == text:
            continue
        have_blocks = {m.group("name"): m.group("body") for m in MARKER.finditer(text)}
        want_blocks = {m.group("name"): m.group("body") for m in MARKER.finditer(want)}
        for name, body in want_blocks.items():
            if have_blocks.get(name) != body:
                old = (have_blocks.get(name) or "").splitlines()
                new = body.splitlines()
                first = next((i for i in range(max(len(old), len(new)))
                              if (old[i] if i < len(old) else None) != (new[i] if i < len(new) else None)), 0)
                files = ", ".join(str(BY_NAME[s].path) for s in BY_TABLE[name].sources) or "every results file"
                problems.append(
                    f"{page}: table '{name}' differs from what {files} render(s): the page has "
                    f"{old[first] if first < len(old) else '(nothing)'!r} where its results give "
                    f"{new[first] if first < len(new) else '(nothing)'!r}; a figure is changed by running "
                    "its bench (--json) and then bench/render_docs.py, never by hand")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 naming every page that differs")
    ap.add_argument("--list", action="store_true", help="every results file with its command")
    ap.add_argument("--missing", action="store_true", help="the commands whose results file is not written yet")
    args = ap.parse_args(argv)
    if args.list or args.missing:
        R = load_all()
        for s in SOURCES:
            if s.name in R and args.missing:
                continue
            state = f"at {R[s.name]['run']['commit']}" if s.name in R else "to be measured"
            print(f"{s.path}  ({state})\n    {s.command}")
        return 0
    if args.check:
        problems = check()
        for p in problems:
            print(p)
        return 1 if problems else 0
    R = load_all()
    for page in pages():
        path = ROOT / page
        text = path.read_text()
        new = render_page(text, page, R)
        if new != text:
            path.write_text(new)
            print(f"{page}: rendered")
    return 0


if __name__ == "__main__":
    sys.exit(main())
