"""ggml's repacked weight layout (CPU_REPACK, stages/kernels/repack.py): the same products as the plain
layout on real GGUF blocks, a row's bits independent of its batch, the trunk repacked on load with
the embedding left readable, expert slots filled repacked, and the setting's errors."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from moeray.errors import MoerayError
from moeray.stages.kernels import backend, graphs, repack, settings
from moeray.stages.kernels.backend import ggml_available
from moeray.stages.kernels.qmatmul import QMatrix, swiglu

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from quant_blocks import random_blocks  # noqa: E402

pytestmark = pytest.mark.skipif(not ggml_available() or repack.handle() is None,
                                reason="ggml-python with its CPU_REPACK buffer type is not installed")

# What this build repacks (AVX2): ggml picks the kernels; these four have them.
REPACKED_TYPES = (T.Q4_0, T.Q4_K, T.IQ4_NL, T.MXFP4)
# Measured: 1.6e-7 .. 2.7e-7 of the largest output (the same 8-bit activations; only the order
# of the float sums differs).
TOLERANCE = 1e-5


@pytest.fixture(autouse=True)
def default_mode():
    repack.set_mode(None)
    yield
    repack.set_mode(None)


def matrix(qtype: T, rows: int, cols: int, seed: int = 0) -> QMatrix:
    blocks = random_blocks(qtype, rows * cols // GGML_QUANT_SIZES[qtype][0], np.random.default_rng(seed), 0.01)
    return QMatrix.from_raw(blocks.reshape(-1), qtype, (rows, cols), "ggml")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("qtype", REPACKED_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("mode", ["on", "fast"])
def test_a_repacked_matrix_multiplies_as_the_plain_one(qtype, mode):
    repack.set_mode(mode)
    plain, packed = matrix(qtype, 64, 512), matrix(qtype, 64, 512)
    assert packed.repack() and packed.layout == "repacked" and packed.nbytes == plain.nbytes
    assert packed.graph_key != plain.graph_key  # a graph built for one layout never serves the other
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(1))
    for rows in (x[:1], x):
        assert rel(packed(rows), plain(rows)) < TOLERANCE


@pytest.mark.parametrize("qtype", REPACKED_TYPES, ids=lambda t: t.name)
def test_a_repacked_rows_bits_do_not_depend_on_its_batch(qtype):
    """MOERAY_REPACK=on keeps the plain layout's promise: a row alone or among 8 others gives
    the same bits (Q4_K runs each row through the GEMV; its GEMM would round differently)."""
    repack.set_mode("on")
    w = matrix(qtype, 64, 512)
    assert w.repack()
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(2))
    assert torch.equal(w(x), torch.cat([w(x[i:i + 1]) for i in range(9)]))
    g, u, d = matrix(qtype, 256, 512, 1), matrix(qtype, 256, 512, 2), matrix(qtype, 512, 256, 3)
    for m in (g, u, d):
        m.repack()
    assert torch.equal(swiglu(x, g, u, d), torch.cat([swiglu(x[i:i + 1], g, u, d) for i in range(9)]))


def test_off_and_unsupported_types_stay_plain():
    repack.set_mode("off")
    assert not matrix(T.Q4_K, 64, 512).repack()
    repack.set_mode("on")
    assert not matrix(T.Q4_1, 64, 512).repack()  # ggml has no repacked Q4_1
    assert not matrix(T.Q4_0, 60, 512).repack()  # rows not a multiple of 8


def test_a_repacked_matrix_refuses_to_be_read_as_rows():
    w = matrix(T.Q4_0, 64, 512)
    w.repack()
    with pytest.raises(MoerayError, match="repacked"):
        w.rows(torch.tensor([1]))


def test_the_default_takes_ggmls_gemm_and_on_keeps_rows_batch_invariant(monkeypatch):
    """The default is llama.cpp's choice (throughput: Q4_K's GEMM for every 4 rows); the backend line
    says what that means and names the batch-invariant setting."""
    monkeypatch.delenv("MOERAY_REPACK", raising=False)
    repack.set_mode(None)
    assert repack.mode() == "fast" and not repack.rows_alone(T.Q4_K)
    assert "MOERAY_REPACK=on keeps them batch-invariant" in repack.layout_line()
    monkeypatch.setenv("MOERAY_REPACK", "on")
    repack.set_mode(None)
    assert repack.rows_alone(T.Q4_K) and not repack.rows_alone(T.Q4_0)
    assert "rows batch-invariant" in repack.layout_line()


def test_the_setting_names_its_choices(monkeypatch):
    monkeypatch.setenv("MOERAY_REPACK", "yes")
    with pytest.raises(MoerayError, match=r"MOERAY_REPACK='yes': choose one of on, fast, off"):
        repack.set_mode(None)  # the debugging override read again
        repack.mode()


@pytest.fixture(scope="module")
def q4k_model(tmp_path_factory):
    """A tiny qwen3moe with every matrix Q4_K (bench/shapes.py's random valid blocks)."""
    from shapes import Shape, write_shape

    s = Shape("qwen3moe", layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64, experts=4, used=2,
              expert_ff=256, vocab=4096)
    return write_shape("tiny", shape=s, path=tmp_path_factory.mktemp("repack") / "tiny.gguf", pool_blocks=1024)


def test_the_trunk_is_repacked_on_load_and_computes_the_same(q4k_model):
    from moeray.stages.gguf.reader import GGUFFile
    from moeray.stages.runtime.model import load_model

    g = GGUFFile(q4k_model)
    repack.set_mode("off")
    plain = load_model(g, backend="ggml")
    repack.set_mode("on")
    packed = load_model(g, backend="ggml")
    assert plain.repacked == 0
    # every matrix but the embedding (read as rows): fused qkv, attention output, the head
    assert packed.repacked == len(packed.matrices()) - 1 and packed.tok_embd.layout == "plain"
    assert packed.trunk_bytes() == plain.trunk_bytes()
    ids = [1, 5, 9, 200, 7, 3]
    assert rel(packed.logits_all(ids), plain.logits_all(ids)) < TOLERANCE


def routed(n: int, n_experts: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(n_experts, generator=g)[:k] for _ in range(n)])
    w = torch.rand(n, k, generator=g)
    return ids, w / w.sum(1, keepdim=True)


def split_step(q4k_model):
    """A stage with experts 0 and 3 of layer 1 in slots, and a step whose picks are partly hits."""
    from moeray.stages.runtime.model import load_cached

    model, cache = load_cached(q4k_model, (0, 2), n_slots=2, layout="global")
    for pair in cache.core.resident_pairs():
        cache.core.evict(*pair)
    for e in (0, 3):
        cache.core.admit(1, e)
    x = torch.randn(6, model.config.hidden, generator=torch.Generator().manual_seed(3))
    ids, w = routed(6, model.config.n_experts, 2, seed=3)
    return cache, x, ids, w


def mapped_and_copied(g, monkeypatch):
    """The host experts of layers [0, 2) read in place, and copied (MOERAY_HOST_EXPERTS=repacked)."""
    from moeray.stages.blocks.moe import HostExperts

    out = []
    for layout in ("mapped", "repacked"):
        settings.update(host_experts=layout)
        out.append(HostExperts(g, "ggml"))
        out[-1].prepare(0, 2)
    return out


def test_host_experts_repacked_give_the_mapped_experts_output(q4k_model, monkeypatch):
    from moeray.stages.gguf.reader import GGUFFile

    g = GGUFFile(q4k_model)
    x = torch.randn(5, g.config.hidden, generator=torch.Generator().manual_seed(4))
    ids, w = routed(5, g.config.n_experts, 2, seed=4)
    mapped, packed = mapped_and_copied(g, monkeypatch)
    assert all(p.repacked for p in packed.stack(1).parts) and not any(p.repacked for p in mapped.stack(1).parts)
    out = packed.forward(1, x, ids, w)
    assert rel(out, mapped.forward(1, x, ids, w)) < TOLERANCE
    # mul_mat_id runs the repacked GEMV per row: a token alone gets the same bits as in the batch
    assert torch.equal(out, torch.cat([packed.forward(1, x[i:i + 1], ids[i:i + 1], w[i:i + 1]) for i in range(5)]))


def test_slots_fill_in_the_host_layout_and_a_split_step_keeps_its_bits(q4k_model, monkeypatch):
    """Host experts repacked: a slot fill repacks the expert into its row, hits and misses read the
    same layout, so a split step equals the all-host step bit for bit; every lookup is counted."""
    from moeray.stages.blocks.moe import HostExperts

    settings.update(host_experts="repacked")
    cache, x, ids, w = split_step(q4k_model)
    store = cache.slot_store
    assert all(p.repacked for p in store.stack(1).parts)
    slot = cache.core.lookup(1, 3)
    raw = np.concatenate([cache.host.gguf.expert_raw(1, kind, 3) for kind in ("gate", "up", "down")])
    row = store.buffer[slot, :len(raw)]
    assert not torch.equal(row, torch.from_numpy(raw))  # interleaved, not the file's order
    assert cache.resident_bytes() == 2 * cache.host.gguf.expert_bytes(1)  # as many bytes
    out = cache.forward(1, x, ids, w)
    assert torch.equal(out, HostExperts(cache.host.gguf, "ggml").forward(1, x, ids, w))
    hits = int(np.isin(ids.numpy(), [0, 3]).sum())
    assert hits and cache.core.hits[1] == hits and cache.core.misses[1] == 2 * len(ids) - hits


def test_fast_mode_repacks_slots_over_a_mapped_host(q4k_model, monkeypatch):
    settings.update(host_experts="mapped")
    repack.set_mode("fast")
    cache, x, ids, w = split_step(q4k_model)
    assert all(p.repacked for p in cache.slot_store.stack(1).parts)
    assert not any(p.repacked for p in cache.host.stack(1).parts)
    from moeray.stages.blocks.moe import HostExperts

    assert rel(cache.forward(1, x, ids, w), HostExperts(cache.host.gguf, "ggml").forward(1, x, ids, w)) < TOLERANCE


def test_repacked_host_experts_that_do_not_fit_fail_clearly(monkeypatch):
    with pytest.raises(MoerayError, match=r"layers \[0, 48\) take 15\.0 GiB as a copy, 8\.0 GiB of memory is "
                                          r"available.*MOERAY_HOST_EXPERTS=mapped"):
        repack.check_fits(15 << 30, "layers [0, 48)", available=8 << 30)
    monkeypatch.setenv("MOERAY_HOST_EXPERTS", "copy")
    with pytest.raises(MoerayError, match="MOERAY_HOST_EXPERTS='copy': choose auto"):
        settings.reset()  # the options of a process given none: the defaults and its overrides
        repack.host_experts()


def test_graph_mul_mat_keeps_a_rows_bits_inside_a_bigger_graph():
    """graphs.graph_mul_mat, what fused graphs multiply a QMatrix with: x made inside the graph
    (here 2x), a Q4_K weight repacked, each row of a batch of 9 equal to that row alone
    (MOERAY_REPACK=on, the batch-invariant setting)."""
    repack.set_mode("on")
    G = backend.ggml_lib()
    w = matrix(T.Q4_K, 64, 512)
    w.repack()
    assert w.rows_alone

    def call(x):
        M = x.shape[0]

        def build(ctx):
            wt, xt = graphs.graph_weight(ctx, w), G.ggml_new_tensor_2d(ctx, G.GGML_TYPE_F32, 512, M)
            y = graphs.graph_mul_mat(ctx, w, wt, G.ggml_scale(ctx, xt, 2.0))
            return [wt, xt], G.ggml_scale(ctx, y, 0.5), None

        out = torch.empty(M, 64)
        graphs.ggml_graph(("test-graph-mul-mat", w.graph_key, M), build)([w.graph_ptr, x.data_ptr()], out.data_ptr())
        return out

    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(6))
    batch = call(x)
    assert torch.equal(batch, torch.cat([call(x[i:i + 1].contiguous()) for i in range(9)]))
    assert rel(batch, w(x)) < TOLERANCE


def test_auto_copies_host_experts_only_when_memory_stays_free(q4k_model, monkeypatch):
    """The default: the repacked copy when it leaves 4 GiB available, else the mapping in place."""
    from moeray.stages.gguf.reader import GGUFFile
    from moeray.stages.blocks.moe import HostExperts

    g = GGUFFile(q4k_model)
    settings.update(host_experts="auto")
    roomy = HostExperts(g, "ggml")
    roomy.prepare(0, 2)
    assert roomy.layout == "auto" and all(p.repacked for p in roomy.stack(1).parts)
    monkeypatch.setattr(repack, "mem_available", lambda: repack.AUTO_HEADROOM_BYTES)  # no room for a copy
    tight = HostExperts(g, "ggml")
    tight.prepare(0, 2)
    assert not any(p.repacked for p in tight.stack(1).parts)


def test_auto_leaves_room_for_the_slots_of_the_cache(q4k_model, monkeypatch):
    """A cache whose slots would take the memory the copy needs keeps the host experts mapped."""
    from moeray.stages.runtime.model import load_cached

    settings.update(host_experts="auto")
    _, cache = load_cached(q4k_model, (0, 2), n_slots=2, layout="global")
    assert all(p.repacked for p in cache.host.stack(1).parts)
    avail = repack.AUTO_HEADROOM_BYTES + (4 << 20) # room for the copy (~2 MB), not for 1000 slots beside it
    monkeypatch.setattr(repack, "mem_available", lambda: avail)
    _, cache = load_cached(q4k_model, (0, 2), n_slots=1000, layout="global")
    assert not any(p.repacked for p in cache.host.stack(1).parts)


@pytest.fixture(scope="module")
def mixed_model(tmp_path_factory):
    """A tiny qwen3moe whose hidden size (224) is no multiple of 256: gate and up are Q5_0, which
    ggml cannot repack on AVX2, down (256 columns) is Q4_K."""
    from shapes import Shape, write_shape

    s = Shape("qwen3moe", layers=2, hidden=224, heads=4, kv_heads=2, head_dim=64, experts=4, used=2,
              expert_ff=256, vocab=4096)
    return write_shape("tiny-mixed", shape=s, path=tmp_path_factory.mktemp("mixed") / "mixed.gguf", pool_blocks=1024)


def test_the_host_copy_holds_kinds_ggml_cannot_repack_as_the_files_blocks(mixed_model, monkeypatch):
    """MOERAY_HOST_EXPERTS=repacked copies every kind: Q5_0's blocks as they are, Q4_K repacked;
    the output is the mapping's (gate/up bit for bit, down within the repacked tolerance)."""
    import ctypes

    from moeray.stages.gguf.reader import GGUFFile

    g = GGUFFile(mixed_model)
    mapped, copied = mapped_and_copied(g, monkeypatch)
    (gate, up, down), (mgate, _, _) = copied.stack(1).parts, mapped.stack(1).parts
    assert (T(gate.ggml_type), T(down.ggml_type)) == (T.Q5_0, T.Q4_K)
    assert not gate.repacked and not up.repacked and down.repacked
    assert gate.base != mgate.base  # a copy, not the mapping
    n = gate.stride * 4
    assert ctypes.string_at(gate.base, n) == ctypes.string_at(mgate.base, n)  # the file's blocks
    x = torch.randn(5, g.config.hidden, generator=torch.Generator().manual_seed(7))
    ids, w = routed(5, g.config.n_experts, 2, seed=7)
    assert rel(copied.forward(1, x, ids, w), mapped.forward(1, x, ids, w)) < TOLERANCE
