"""llama.cpp's tiled K/IQ-quant GEMM and llamafile's sgemm in the ggml that `make venv` builds
(stages/kernels/ggml_build.py, docs/kernels.md#tiled-gemm): the patch's hooks and its fallback, how
a process tells which build it has, the stage options that switch each path at run time, and what
the paths do to a row's bits: ~1e-7 of the largest output between a row computed tiled (8+ rows, or
8+ rows routed to one expert) and the same row alone; the same
bits at every batch with the tiled path off (tiled_gemm=False or GGML_CPU_TILED_MM=0); the sgemm
keeps a row's bits (quantised matrices only)."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from moeray.stages.kernels import ggml_build
from moeray.stages.kernels.ggml_lib import TILED_ABSENT, TILED_OFF, TILED_ON, TILED_SYMBOL, tiled_gemm

from quant_blocks import random_blocks

# The types the tiled path takes (IQ1_S / IQ1_M left out of the vendored copy).
# The types moeray lets llamafile's sgemm take (its float and IQ4_NL kernels, which sum a row in
# another order than ggml's, are never given a matrix).
SGEMM_TYPES = ("Q8_0", "Q4_0", "Q5_0")
TILED_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S")


# ---------------------------------------------------------------- the patch and the fallback

def _fake_sdist(root: Path) -> Path:
    """The anchors the hooks need, each once, in an sdist-shaped folder."""
    cpu = root / "vendor" / "ggml" / "src" / "ggml-cpu"
    cpu.mkdir(parents=True)
    (cpu / "CMakeLists.txt").write_text("set(SRCS\n" + ggml_build.CMAKE_HOOK[0] + ")\n")
    (cpu / "ggml-cpu.c").write_text("\n/* between */\n".join(old for old, _ in ggml_build.HOOKS))
    (cpu / "ops.cpp").write_text("\n/* between */\n".join(old for old, _ in ggml_build.OPS_HOOKS))
    return root


def test_the_patch_hooks_every_anchor_once_and_copies_the_vendored_files(tmp_path):
    sdist = _fake_sdist(tmp_path)
    ggml_build.patch(sdist)
    cpu = sdist / "vendor" / "ggml" / "src" / "ggml-cpu"
    src = (cpu / "ggml-cpu.c").read_text()
    assert all(new in src for _, new in ggml_build.HOOKS)
    assert src.count("ggml_compute_forward_mul_mat_id_tiled(") == 1 and src.count("ggml_tiled_wdata_size(") == 3
    # the run-time switches: both tiled calls behind the stage's option, both sgemm calls behind its width
    assert src.count("moeray_tiled_on && ggml_compute_forward_mul_mat") == 2
    assert src.count("MOERAY_SGEMM(src0, ne11)") == 2 and "void moeray_ggml_set_gemm_paths(" in src
    assert "ggml-cpu/tiled/tiled.cpp" in (cpu / "CMakeLists.txt").read_text()
    # flash attention over q8_0 / q4_0 rows splits a one-token step's keys among the threads too
    ops = (cpu / "ops.cpp").read_text()
    assert "kv_split_type && (k->type == v->type)" in ops
    # its q8_0 / q4_0 value rows widened in ggml-cpu, and the tiled kernel's row count set in-process
    assert "moeray_q8_0_to_f32(v_data, V32, DV)" in ops and "moeray_q4_0_to_f32(v_data, V32, DV)" in ops
    assert "void moeray_ggml_set_fa_tiled_rows(" in ops and "getenv" not in ops
    for f in ggml_build.FILES:
        assert (cpu / "tiled" / f).read_bytes() == (ggml_build.TILED / f).read_bytes()


def test_an_sdist_the_hooks_do_not_fit_is_refused_before_anything_is_written(tmp_path):
    sdist = _fake_sdist(tmp_path)
    c = sdist / "vendor" / "ggml" / "src" / "ggml-cpu" / "ggml-cpu.c"
    c.write_text(c.read_text().replace("ggml_compute_forward_fwht", "something_else"))
    before = c.read_text()
    with pytest.raises(ggml_build.PatchError, match="another ggml-python version"):
        ggml_build.patch(sdist)
    assert c.read_text() == before and not (c.parent / "tiled").exists()


def test_the_vendored_copy_has_no_iq1_and_says_where_it_comes_from():
    for f in ggml_build.FILES:
        text = (ggml_build.TILED / f).read_text()
        assert text.startswith("// From llama.cpp (commit ") and "MIT License" in text.splitlines()[0]
    cpp = (ggml_build.TILED / "tiled.cpp").read_text()
    assert "block_iq1" not in cpp and "GGML_TYPE_IQ1" not in cpp and "iq1s_grid" not in cpp
    assert (ggml_build.TILED / "LICENSE").read_text().startswith("MIT License")


@pytest.mark.parametrize("failure", ["download", "patch", "compile"])
def test_any_failure_installs_the_plain_sdist_and_says_prefill_is_slower(monkeypatch, capsys, tmp_path, failure):
    installed = []

    def fetch(python, version, work):
        if failure == "download":
            raise subprocess.CalledProcessError(1, ["pip", "download"])
        return _fake_sdist(work / "sdist") if failure == "compile" else (work / "nothing")

    def pip_install(python, what, cmake_args, target, quiet):
        if failure == "compile" and what.endswith("sdist"):
            raise subprocess.CalledProcessError(1, ["pip", "install", what])
        installed.append((what, cmake_args))

    monkeypatch.setattr(ggml_build, "fetch_sdist", fetch)
    monkeypatch.setattr(ggml_build, "pip_install", pip_install)
    assert ggml_build.install(cmake_args="-DGGML_NATIVE=OFF") is False
    assert installed == [("ggml-python>=0.0.45", "-DGGML_NATIVE=OFF")]
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "WITHOUT llama.cpp's tiled" in err[0] and "prefill will be slower" in err[0]


def test_a_side_build_gets_the_makefiles_flags():
    text = (Path(__file__).resolve().parents[2] / "Makefile").read_text().replace("\\\n", " ")
    makefile = next(ln for ln in text.splitlines() if ln.startswith("GGML_CMAKE_ARGS ?="))
    assert makefile.split("?=", 1)[1].split() == ggml_build.DEFAULT_CMAKE_ARGS.split()
    assert "ggml_build.py install" in text


def test_native_builds_are_refused():
    with pytest.raises(SystemExit, match="never -march=native"):
        ggml_build.install(cmake_args="-DGGML_NATIVE=ON")


# ---------------------------------------------------------------- which build this process has

@pytest.mark.parametrize("value,state", [(None, TILED_ON), ("1", TILED_ON), ("0", TILED_OFF), ("", TILED_OFF),
                                         ("00", TILED_OFF), ("2", TILED_ON), ("off", TILED_OFF)])
def test_the_state_follows_ggmls_own_reading_of_the_variable(value, state):
    G = SimpleNamespace(lib=SimpleNamespace(**{TILED_SYMBOL: object()}))
    env = {} if value is None else {"GGML_CPU_TILED_MM": value}
    assert tiled_gemm(G, env) == state  # ggml: getenv == NULL || atoi(value) != 0
    assert tiled_gemm(SimpleNamespace(lib=SimpleNamespace()), env) == TILED_ABSENT
    assert tiled_gemm(G, env, enabled=False) == TILED_OFF  # the stage's option turns it off whatever ggml's is


def test_the_switches_are_stage_options_with_debugging_overrides(monkeypatch):
    from moeray.errors import ConfigError
    from moeray.stages.kernels.settings import StageOptions
    from moeray import environment

    assert StageOptions().tiled_gemm is True and StageOptions().sgemm_rows == 2
    with pytest.raises(ConfigError, match="sgemm_rows"):
        StageOptions(sgemm_rows=-1)
    monkeypatch.setenv("MOERAY_SGEMM_ROWS", "0")
    monkeypatch.setenv("MOERAY_TILED_GEMM", "0")
    opts, lines = environment.fold(StageOptions(), "stage")
    assert (opts.sgemm_rows, opts.tiled_gemm) == (0, False) and len(lines) == 2


# ---------------------------------------------------------------- numerics

def _batch_vs_alone(types=TILED_TYPES) -> dict:
    """Per type: (max |batched - alone| / max |alone|, same for the error against float32 alone and
    batched), for a 16-row mul_mat and a mul_mat_id with 16 rows routed to each of two experts."""
    import torch

    from moeray.stages.blocks import expert_graph
    from moeray.stages.blocks.expert_graph import Part, Stack
    from moeray.stages.kernels import repack
    from moeray.stages.kernels.qmatmul import SILU, QMatrix, row_bytes

    repack.set_mode("off")  # the plain layout: a repacked matrix keeps ggml's repacked kernels
    rng = np.random.default_rng(0)
    out = {}
    for name in types:
        t = QT[name]
        n, k, m = 256, 512, 16
        w = QMatrix.from_raw(random_blocks(t, n * k // 256, rng, scale=0.01).reshape(-1), t, (n, k), "ggml")
        x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
        batched, alone = w(x), torch.cat([w(x[i:i + 1]) for i in range(m)])
        ref = x @ w.dequantize().T
        top = alone.abs().max().item()
        mm = [(batched - alone).abs().max().item() / top, (alone - ref).abs().max().item() / top,
              (batched - ref).abs().max().item() / top]

        H, F, E = 256, 256, 4  # every token picks experts 1 and 2: 16 rows each, the tiled path's
        sizes = [F * row_bytes(t, H), F * row_bytes(t, H), H * row_bytes(t, F)]
        buf = torch.from_numpy(random_blocks(t, E * sum(sizes) // row_bytes(t, 256), rng, scale=0.01).reshape(-1))
        base, parts = buf.data_ptr(), []
        for size, (rows, cols) in zip(sizes, [(F, H), (F, H), (H, F)]):
            parts.append(Part(base, t, rows, cols, size))
            base += E * size
        stack = Stack(tuple(parts), E, owner=buf)
        xs = torch.from_numpy(rng.standard_normal((m, H)).astype(np.float32))
        ids = torch.tensor([[1, 2]] * m)
        wts = torch.full((m, 2), 0.5)
        b = expert_graph.run(stack, SILU, xs, ids, wts)
        a = torch.cat([expert_graph.run(stack, SILU, xs[i:i + 1], ids[i:i + 1], wts[i:i + 1]) for i in range(m)])
        mmid = (b - a).abs().max().item() / a.abs().max().item()
        out[name] = {"mul_mat": mm, "mul_mat_id": mmid}
    return out


def _needs_tiled():
    from moeray.stages.kernels.backend import ggml_available
    if not ggml_available():
        pytest.skip("ggml-python is not installed")
    if tiled_gemm() == TILED_ABSENT:
        pytest.skip("this ggml-python has no tiled GEMM (`make venv` builds it: docs/kernels.md#tiled-gemm)")


def test_a_row_computed_tiled_is_within_the_last_bit_of_the_row_alone():
    _needs_tiled()
    if tiled_gemm() != TILED_ON:
        pytest.skip("GGML_CPU_TILED_MM=0 in this process")
    got = _batch_vs_alone()
    for name, r in got.items():
        batch, err_alone, err_batched = r["mul_mat"]
        assert batch <= 1e-6 and r["mul_mat_id"] <= 1e-6, (name, r)  # measured <= 1.9e-7 (mul_mat), 2.6e-7 (an expert's FFN)
        assert abs(err_batched - err_alone) <= 1e-6, (name, r)  # no less exact than the row-by-row kernel
    # the path is taken: its sums differ from vec_dot's in the last bit somewhere in every type
    assert all(r["mul_mat"][0] > 0 and r["mul_mat_id"] > 0 for r in got.values()), got


def test_with_the_stage_option_off_every_row_keeps_its_bits_at_every_batch():
    """StageOptions.tiled_gemm=False: switched in this process, between graphs."""
    _needs_tiled()
    from moeray.stages.kernels import settings

    saved = settings.snapshot()
    try:
        settings.update(tiled_gemm=False)
        got = _batch_vs_alone(("Q4_K", "IQ3_S", "Q6_K"))
        assert all(v["mul_mat"][0] == 0 and v["mul_mat_id"] == 0 for v in got.values()), got
        settings.update(tiled_gemm=True)
        if tiled_gemm() == TILED_ON:  # and back on: the path is taken again
            got = _batch_vs_alone(("Q4_K", "IQ3_S", "Q6_K"))
            assert all(v["mul_mat"][0] > 0 for v in got.values()), got
    finally:
        settings.restore(saved)


def _ggml_f32_mul_mat(w, x):
    """w [N, K] @ x [M, K].T as one ggml mul_mat of two float32 tensors (a QMatrix of float32
    weights multiplies in torch, so this graph is built by hand)."""
    import torch

    from moeray.stages.kernels.ggml_lib import load_once
    from moeray.stages.kernels.graphs import ggml_graph

    G, (N, K), M = load_once()[0], w.shape, x.shape[0]

    def build(ctx):
        wt = G.ggml_new_tensor_2d(ctx, G.GGML_TYPE_F32, K, N)
        xt = G.ggml_new_tensor_2d(ctx, G.GGML_TYPE_F32, K, M)
        return [wt, xt], G.ggml_mul_mat(ctx, wt, xt), None

    out = torch.empty(M, N)
    ggml_graph(("test-f32-mul-mat", N, K, M), build)([w.data_ptr(), x.data_ptr()], out.data_ptr())
    return out


def _sgemm_vs_alone(m: int, rows: int) -> dict:
    """Per type: (max |batched - alone| / max |alone| over m rows, the batched result's error against
    float32 over the alone one's, the products llamafile's sgemm computed for the batched call) with
    sgemm_rows=rows, in the plain layout."""
    import torch

    from moeray.stages.kernels import repack, settings
    from moeray.stages.kernels.ggml_lib import sgemm_products
    from moeray.stages.kernels.qmatmul import QMatrix

    saved, out = settings.snapshot(), {}
    repack.set_mode("off")
    try:
        settings.update(sgemm_rows=rows)
        rng = np.random.default_rng(1)
        for name in SGEMM_TYPES + ("IQ4_NL", "F32"):
            n, k = 256, 512
            x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
            if name == "F32":
                wf = torch.from_numpy(rng.standard_normal((n, k)).astype(np.float32))
                w, ref = (lambda v, wf=wf: _ggml_f32_mul_mat(wf, v)), x @ wf.T
            else:
                raw = random_blocks(QT[name], n * k // 32, rng, scale=0.01).reshape(-1)
                w = QMatrix.from_raw(raw, QT[name], (n, k), "ggml")
                ref = x @ w.dequantize().T
            before = sgemm_products()
            batched = w(x)
            taken = sgemm_products() - before
            alone = torch.cat([w(x[i:i + 1]) for i in range(m)])
            top = alone.abs().max().item()
            err_alone = (alone - ref).abs().max().item()
            out[name] = ((batched - alone).abs().max().item() / top,
                         (batched - ref).abs().max().item() / max(err_alone, 1e-6 * top), taken)
    finally:
        settings.restore(saved)
    return out


def _needs_sgemm():
    _needs_tiled()
    from moeray.stages.kernels.ggml_lib import SWITCH_SYMBOL, load_once, sgemm_built
    G = load_once()[0]
    if not sgemm_built(G) or not hasattr(G.lib, SWITCH_SYMBOL):
        pytest.skip("this ggml-python has no llamafile sgemm behind moeray's switch (`make venv` builds it)")


def test_llamafile_sgemm_takes_quantised_matrices_at_prefill_widths_with_their_bits():
    """At 40 rows with sgemm_rows=32 the sgemm computes the Q8_0, Q4_0 and Q5_0 products; on this AVX2
    build its kernels sum a row's blocks in ggml's own order, so every row keeps the bits it has
    alone (which lets the default take it from 2 rows: 1.2-1.4x faster at 2-16 rows, 1.3-1.8x at
    256). A float32 (a router) or IQ4_NL matrix never takes it: those kernels sum in another order
    (1.6e-7 of the largest output measured on IQ4_NL), and a router's last bit flips expert choices."""
    _needs_sgemm()
    got = _sgemm_vs_alone(m=40, rows=32)
    assert all(got[name][2] == 1 for name in SGEMM_TYPES) and got["IQ4_NL"][2] == got["F32"][2] == 0, got
    for name, (batch, err_ratio, _) in got.items():
        assert batch == 0 and err_ratio <= 1.0 + 1e-6, (name, got)


def test_below_sgemm_rows_or_with_it_off_ggmls_dot_products_run():
    """Fewer rows than sgemm_rows (16 < 32), or sgemm_rows=0 at any width: ggml's own kernels."""
    _needs_sgemm()
    for m, rows in ((16, 32), (40, 0)):
        got = _sgemm_vs_alone(m=m, rows=rows)
        assert all(taken == 0 and batch == 0 for batch, _, taken in got.values()), (m, rows, got)


if __name__ == "__main__":
    print(json.dumps(_batch_vs_alone()))
