"""Models in parts (llama.cpp's gguf-split layout): found from any part, checked before anything
loads, read as the whole file is read.

Parts come from the project's own splitter (stages/gguf/writer.split_gguf, gguf-split's format) in
every run, and from llama.cpp's own `llama-gguf-split` where it is built (skipped, saying why,
where it is not). The reference is always the same model in one file: the same logits bit for
bit, the same greedy text, the same `moeray plan`. Every bad layout is one line from the CLI,
naming the file and the fix, never a traceback.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moeray.stages.gguf.reader import GGUFFile, read_gguf_header, write_header_only
from moeray.stages.gguf.writer import split_gguf

TOKENS = "1 504 3575 282 4649 314 28 33 9 2"


def moeray(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "moeray.cluster.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout)


def one_line_error(r, *needles: str) -> str:
    """The CLI failed with one line (no traceback) holding every needle."""
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def default_parts(default_model_path, tmp_path_factory) -> list[Path]:
    """The default model cut into 6 parts in layer order (as published models are laid out)."""
    d = tmp_path_factory.mktemp("default-parts")
    return split_gguf(default_model_path, d / "smollm2-moe", max_tensors=60, layer_order=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Mixtral in one file and in 4 parts (the bad cases break copies of these)."""
    from tiny_models import tiny_mixtral

    from moeray.stages.gguf.writer import write_gguf

    d = tmp_path_factory.mktemp("tiny")
    whole = write_gguf(tiny_mixtral(), d / "mixtral.gguf", "Q8_0")
    parts = split_gguf(whole, d / "parts" / "mixtral", max_tensors=9)
    return whole, parts


# ---------------------------------------------------------------- the format


def test_parts_carry_gguf_splits_keys_and_the_models_metadata_only_in_the_first(default_parts, tiny):
    import gguf

    assert [p.name for p in default_parts] == [f"smollm2-moe-{i:05d}-of-00006.gguf" for i in range(1, 7)]
    whole, parts = tiny
    total = len(read_gguf_header(whole).tensors)
    for i, p in enumerate(parts):
        r = gguf.GGUFReader(p)  # the gguf package's own reader (llama.cpp's gguf-py)
        keys = {f.name: f.contents() for f in r.fields.values() if not f.name.startswith("GGUF.")}
        assert (keys["split.no"], keys["split.count"], keys["split.tensors.count"]) == (i, 4, total)
        assert ("general.architecture" in keys) == (i == 0)  # the model's metadata: the first part only
        assert 0 < len(r.tensors) <= 9
        for t in r.tensors:  # each tensor's bytes, read by gguf-py, are the whole file's
            assert bytes(t.data.tobytes()) == bytes(GGUFFile(whole).raw(t.name))


@pytest.mark.parametrize("which", [0, 3, 5])
def test_any_part_reads_as_the_whole_file(default_model_path, default_parts, which):
    whole, h = read_gguf_header(default_model_path), read_gguf_header(default_parts[which])
    assert h.path == str(default_parts[0]) and h.config == whole.config and h.metadata.keys() >= whole.metadata.keys()
    assert {n: (t.shape, t.ggml_type, t.n_bytes) for n, t in h.tensors.items()} == \
           {n: (t.shape, t.ggml_type, t.n_bytes) for n, t in whole.tensors.items()}
    assert [p.index for p in h.parts] == list(range(6)) and sum(p.n_tensors for p in h.parts) == len(whole.tensors)
    # Pricing reads the directory: the same bytes for the planner as one file.
    assert h.trunk_bytes() == whole.trunk_bytes() and h.token_bytes() == whole.token_bytes()
    assert [h.expert_bytes(l) for l in range(30)] == [whole.expert_bytes(l) for l in range(30)]


def test_a_stage_maps_only_the_parts_holding_its_layers(default_model_path, default_parts):
    import torch

    from moeray.stages.runtime.model import StageModel

    h = read_gguf_header(default_parts[0])
    # part 1: the embedding and layers 0-5, 2: layers 5-11, 3: 11-17, 4: 17-23, 5: 23-29, 6: 29 and the head
    assert h.stage_parts(0, 5) == [0] and h.stage_parts(0, 6) == [0, 1]
    assert h.stage_parts(6, 14) == [1, 2]
    assert h.stage_parts(24, 30) == [0, 4, 5]  # the tied head reads the embedding matrix
    whole = GGUFFile(default_model_path)
    g = GGUFFile(default_parts[0], parts=h.stage_parts(6, 14))
    model = StageModel(g, 6, 14)
    assert g.opened == [1, 2]
    assert g.touched and all(h.tensors[n].part in (1, 2) for n in g.touched)
    for name in g.touched:  # the bytes are the file's
        assert np.array_equal(g.raw(name), whole.raw(name))
    x = torch.randn(3, h.config.hidden, generator=torch.Generator().manual_seed(0))
    ref = StageModel(whole, 6, 14)
    kv_a, kv_b = model.new_kv_cache(1, 8), ref.new_kv_cache(1, 8)
    meta_a, meta_b = model.batch_meta([3], [0], kv_a), ref.batch_meta([3], [0], kv_b)
    assert torch.equal(model.run_layers(x, meta_a, kv_a), ref.run_layers(x, meta_b, kv_b))


# ---------------------------------------------------------------- the commands, as the whole file


def test_logits_are_the_whole_files_bit_for_bit(default_model_path, default_parts, tmp_path):
    a, b = tmp_path / "whole.npy", tmp_path / "parts.npy"
    for model, out in ((default_model_path, a), (default_parts[2], b)):
        r = moeray("logits", model, "--tokens", TOKENS, "-o", out)
        assert r.returncode == 0, r.stderr
    assert np.load(a).tobytes() == np.load(b).tobytes()


@pytest.mark.slow
def test_generate_gives_the_whole_files_text(default_model_path, default_parts):
    args = ["--prompt", "The capital of France is", "--max-tokens", "8", "--temperature", "0"]
    whole, parts = moeray("generate", default_model_path, *args), moeray("generate", default_parts[0], *args)
    assert whole.returncode == 0 and parts.returncode == 0, (whole.stderr, parts.stderr)
    assert parts.stdout == whole.stdout and parts.stdout.strip()


def test_plan_is_the_whole_files_plus_the_parts_each_stage_reads(default_model_path, default_parts, tmp_path):
    from moeray.stages.runtime.default_profile import default_profile_for

    profile = default_profile_for(default_model_path)
    args = ["--devices", "72MiB,72MiB,64MiB,64MiB", "--profile", profile]
    whole = moeray("plan", default_model_path, *args)
    # header-only copies of the parts, as an operator copies them to the machine that plans
    heads = tmp_path / "heads"
    heads.mkdir()
    for p in default_parts:
        write_header_only(p, heads / p.name)
    for model in (default_parts[1], heads / default_parts[0].name):
        r = moeray("plan", model, *args)
        assert r.returncode == 0, r.stderr
        lines = r.stdout.splitlines()
        parts = [l for l in lines if l.startswith("[parts]")]
        assert [l for l in lines if not l.startswith("[parts]")] == whole.stdout.splitlines()
        h = read_gguf_header(default_parts[0])
        split = [tuple(map(int, l.split("(layers ")[1].split(")")[0].split("-"))) for l in parts]
        assert len(parts) == 4 and split[0][0] == 0 and split[-1][1] == 29
        for line, (a, b) in zip(parts, split):
            assert line.endswith(", ".join(h.parts[j].name for j in h.stage_parts(a, b + 1)))


# ---------------------------------------------------------------- every bad layout: one line


def _copy(parts: list[Path], dst: Path) -> list[Path]:
    dst.mkdir()
    return [Path(shutil.copy(p, dst / p.name)) for p in parts]


def test_a_missing_part_is_named(tiny, tmp_path):
    parts = _copy(tiny[1], tmp_path / "m")
    parts[2].unlink()
    one_line_error(moeray("plan", parts[0], "--devices", "1GiB"), str(parts[2]), "missing", "fetch")
    one_line_error(moeray("logits", parts[3], "--tokens", "1 2", "-o", tmp_path / "x.npy"), str(parts[2]), "missing")


def test_a_part_of_another_model_is_named(tiny, tmp_path):
    from tiny_models import tiny_qwen3moe

    from moeray.stages.gguf.writer import write_gguf

    other = write_gguf(tiny_qwen3moe(), tmp_path / "qwen.gguf", "Q8_0")
    theirs = split_gguf(other, tmp_path / "qwen", max_tensors=-(-len(read_gguf_header(other).tensors) // 4))
    assert len(theirs) == len(tiny[1]) == 4
    parts = _copy(tiny[1], tmp_path / "m")
    shutil.copy(theirs[1], parts[1])
    one_line_error(moeray("plan", parts[0], "--devices", "1GiB"), str(parts[1]), "another model", "fetch part 2")


def test_a_part_from_another_split_of_the_same_model_is_named(tiny, tmp_path):
    n = len(read_gguf_header(tiny[0]).tensors)
    other = split_gguf(tiny[0], tmp_path / "other", max_tensors=10)  # 4 parts too, cut elsewhere
    assert len(other) == 4 and 30 < n <= 36
    parts = _copy(tiny[1], tmp_path / "m")
    shutil.copy(other[1], parts[1])
    one_line_error(moeray("plan", parts[0], "--devices", "1GiB"), parts[1].name, "is also in", "same release")


def test_a_duplicated_part_is_named(tiny, tmp_path):
    parts = _copy(tiny[1], tmp_path / "m")
    shutil.copy(parts[1], parts[2])  # part 2 also saved as part 3
    one_line_error(moeray("plan", parts[0], "--devices", "1GiB"), str(parts[2]), "a copy of another part",
                   "fetch part 3 again")


def test_a_truncated_part_is_named(tiny, tmp_path):
    parts = _copy(tiny[1], tmp_path / "m")
    with open(parts[3], "r+b") as f:
        f.truncate(os.path.getsize(parts[3]) - 100)
    one_line_error(moeray("logits", parts[0], "--tokens", "1 2", "-o", tmp_path / "x.npy"), str(parts[3]),
                   "truncated", "fetch it again")


def test_a_wrong_count_and_an_unnamed_part_are_named(tiny, tmp_path):
    d = tmp_path / "m"
    parts = _copy(tiny[1], d)
    wrong = d / "mixtral-00001-of-00005.gguf"  # renamed with the wrong count
    shutil.copy(parts[0], wrong)
    one_line_error(moeray("plan", wrong, "--devices", "1GiB"), str(wrong), "split.count says 4",
                   "mixtral-00001-of-00004.gguf")
    plain = d / "mixtral.gguf"  # the first part under a plain name: the others cannot be found
    shutil.copy(parts[0], plain)
    one_line_error(moeray("plan", plain, "--devices", "1GiB"), str(plain), "not named as gguf-split names parts")


# ---------------------------------------------------------------- llama.cpp's own splitter


def _llama_gguf_split() -> Path:
    from moeray.environment import llama_cpp_tool

    exe = llama_cpp_tool("llama-gguf-split")
    if exe is None:
        pytest.skip("llama.cpp's llama-gguf-split is not in LLAMA_CPP_BIN's folder or on PATH (build llama.cpp's "
                    "llama-gguf-split target and set LLAMA_CPP_BIN to its build/bin)")
    return Path(exe)


@pytest.mark.parametrize("how, ours", [
    (["--split-max-tensors", "60"], {"max_tensors": 60}),
    (["--split-max-size", "100M"], {"max_bytes": 100 * 1000 * 1000}),
    (["--split-max-tensors", "100", "--no-tensor-first-split"], {"max_tensors": 100, "first_without_tensors": True}),
])
def test_parts_cut_by_llama_cpps_gguf_split_read_as_the_whole_file(default_model_path, tmp_path, how, ours):
    exe = _llama_gguf_split()
    r = subprocess.run([exe, "--split", *how, default_model_path, tmp_path / "m"], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    parts = sorted(tmp_path.glob("m-*-of-*.gguf"))
    assert len(parts) > 2
    ours = split_gguf(default_model_path, tmp_path / "ours" / "m", **ours)
    theirs_h, ours_h = read_gguf_header(parts[-1]), read_gguf_header(ours[0])
    # the same cut: each part the same tensors at the same offsets
    assert [(p.n_tensors, p.data_offset, p.data_end) for p in theirs_h.parts] == \
           [(p.n_tensors, p.data_offset, p.data_end) for p in ours_h.parts]
    a, b = tmp_path / "whole.npy", tmp_path / "parts.npy"
    for model, out in ((default_model_path, a), (parts[1], b)):
        r = moeray("logits", model, "--tokens", TOKENS, "-o", out)
        assert r.returncode == 0, r.stderr
    assert np.load(a).tobytes() == np.load(b).tobytes()


def test_llama_cpp_loads_our_parts_as_the_whole_file(default_model_path, default_parts):
    llama_cpp = pytest.importorskip("llama_cpp")

    def logits(path) -> np.ndarray:
        m = llama_cpp.Llama(model_path=str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=2)
        m.eval([int(t) for t in TOKENS.split()])
        out = np.array(m.scores[:len(TOKENS.split())], np.float32)
        m.close()
        return out

    assert np.array_equal(logits(default_parts[0]), logits(default_model_path))


# ---------------------------------------------------------------- every family, in parts


def _family(name: str):
    import tiny_hybrid
    import tiny_models

    return {"mixtral": tiny_models.tiny_mixtral, "qwen2moe": tiny_models.tiny_qwen2moe,
            "qwen3moe": tiny_models.tiny_qwen3moe, "deepseek2": tiny_models.tiny_deepseek3,
            "gpt-oss": tiny_models.tiny_gpt_oss, "glm4moe": tiny_models.tiny_glm4moe,
            "qwen3next": tiny_hybrid.tiny_qwen3next, "qwen35moe": tiny_hybrid.tiny_qwen35moe}[name]()


@pytest.mark.parametrize("family", ["mixtral", "qwen2moe", "qwen3moe", "deepseek2", "gpt-oss", "glm4moe",
                                    "qwen3next", "qwen35moe"])
def test_every_family_in_parts_gives_the_whole_files_logits(tmp_path, family):
    """Each architecture's tiny model, Q8_0, cut into parts of 7 tensors (the first holding only the
    metadata, as gguf-split --no-tensor-first-split writes it): the same logits bit for bit, and a
    stage over the last layer maps only the parts holding it and the head."""
    import torch

    from tiny_models import token_ids

    from moeray.stages.gguf.writer import write_gguf
    from moeray.stages.runtime.model import StageModel, load_model

    whole = write_gguf(_family(family), tmp_path / f"{family}.gguf", "Q8_0")
    parts = split_gguf(whole, tmp_path / "parts" / family, max_tensors=7, first_without_tensors=True,
                       layer_order=True)
    h = read_gguf_header(parts[-1])
    assert len(parts) > 3 and h.parts[0].n_tensors == 0
    ids = token_ids(12)
    assert torch.equal(load_model(str(parts[1])).logits_all(ids), load_model(str(whole)).logits_all(ids))
    last = h.config.n_layers - 1
    g = GGUFFile(parts[0], parts=h.stage_parts(last, last + 1))
    StageModel(g, last, last + 1)
    assert g.opened == h.stage_parts(last, last + 1) and len(g.opened) < len(parts) - 1
