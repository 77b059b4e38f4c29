"""The last layer's FFN only for the rows the head reads (StageModel.run_layers' out_rows, as
llama.cpp's graphs prune to inp_out_ids): every other row of a prefill chunk leaves the stage
unread, so its last-layer experts are never computed. A kept row must carry the bits it has when
every row runs (each FFN row depends on its own row only, and ggml's products give a row the same
bits at any width), every row's keys and recurrent state must still be written, and the experts
must see only the kept rows at the last layer.

Two prompts of 20 and 13 tokens in blocks 0-1 and 2-3 are read as views of the pool whose windows
overlap: before MLA's value read became an input of its own there, ggml aborted the process on
that batch (tiny DeepSeek-V3 here)."""
from __future__ import annotations

import pytest
import torch

from moeray.stages.blocks.moe import HostExperts
from moeray.stages.gguf.reader import GGUFFile
from moeray.stages.gguf.writer import write_gguf
from moeray.stages.kernels.backend import ggml_available
from moeray.stages.runtime.model import load_model
from tiny_hybrid import HYBRID_BUILDERS
from tiny_models import tiny_deepseek3, tiny_qwen3moe, token_ids

pytestmark = pytest.mark.skipif(not ggml_available(), reason="ggml-python is not installed")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("head-rows")
    hybrid = next(iter(HYBRID_BUILDERS.items()))
    return {"qwen3moe": write_gguf(tiny_qwen3moe(), root / "qwen3moe.gguf", "Q8_0"),
            "deepseek3": write_gguf(tiny_deepseek3(), root / "deepseek3.gguf", "Q8_0"),
            hybrid[0]: write_gguf(hybrid[1](), root / f"{hybrid[0]}.gguf", "Q8_0")}


def _load(path, routes: list, backend: str = "ggml"):
    host = HostExperts(GGUFFile(path), backend, on_route=lambda layer, ids, w: routes.append((layer, ids.shape[0])))
    return load_model(path, backend=backend, experts=host)


def _two_steps(model, rows_of, lengths=(20, 13)):
    """Two sequences prefilled together (20 and 13 tokens: padded queries), then a decode step of
    both; each step's run_layers output with out_rows = rows_of(meta) and what the KV pool holds."""
    kv = model.new_kv_pool(64, state_slots=2)
    outs = []
    a, b = lengths
    with torch.inference_mode():
        for n_new, starts, toks in (([a, b], [0, 0], [token_ids(a, seed=1), token_ids(b, seed=2)]),
                                    ([1, 1], [a, b], [[5], [7]])):
            meta = model.table_meta(n_new, starts, [[0, 1], [2, 3]], kv, [0, 1])
            outs.append(model.run_layers(model.embed(toks), meta, kv, rows_of(meta)))
    pools = [p.clone() for p in kv.k + kv.v if p is not None]
    if kv.state is not None:
        pools += [p.clone() for l in model.recurrent_layers() for p in kv.state.layer(l)]
    return outs, pools


@pytest.mark.parametrize("name", ["qwen3moe", "deepseek3", next(iter(HYBRID_BUILDERS))])
@pytest.mark.parametrize("backend", ["ggml", "exact"])
def test_kept_rows_have_the_bits_of_a_full_run(files, name, backend):
    full_routes, kept_routes = [], []
    full, full_pools = _two_steps(_load(files[name], full_routes, backend), lambda meta: None)
    model = _load(files[name], kept_routes, backend)
    if backend == "ggml":
        assert model.trunk is not None, "the graph path is the one under test"
    kept, kept_pools = _two_steps(model, lambda meta: meta.last_index)
    last = [19, 32]  # each sequence's last token of the prefill; the decode step reads both rows
    assert kept[0].shape == (2, full[0].shape[1])
    if backend == "ggml":  # ggml's products give a row the same bits at any width
        assert torch.equal(kept[0], full[0][last]), "a kept row differs from the same row of a full run"
    else:  # torch's float32 GEMM sums in a width-dependent order: the last bits move, no more
        assert torch.allclose(kept[0], full[0][last], rtol=0, atol=1e-5 * full[0].abs().max())
    assert torch.equal(kept[1], full[1])
    # every row's keys (and DeltaNet state) were written all the same: the decode step saw them
    assert all(torch.equal(a, b) for a, b in zip(kept_pools, full_pools))
    # the experts of the last MoE layer saw the kept rows only; every other layer all 33
    L = max(l for l, _ in full_routes)
    rows = lambda routes, l: sum(n for layer, n in routes if layer == l)
    assert rows(full_routes, L) == 33 + 2 and rows(kept_routes, L) == 2 + 2
    assert all(rows(kept_routes, l) == rows(full_routes, l) for l in range(L))


def test_a_small_step_prunes_inside_the_stage_graph(files):
    """A step of at most STAGE_TOKENS rows runs the stage's layers as one graph: the last layer's
    FFN there too runs for the kept rows only, with the same bits, its picks counted apart."""
    full_routes, kept_routes = [], []
    full, _ = _two_steps(_load(files["qwen3moe"], full_routes), lambda meta: None, (10, 7))
    model = _load(files["qwen3moe"], kept_routes)
    stages = []
    real = model.trunk.stage
    model.trunk.stage = lambda *a: stages.append(1) or real(*a)
    kept, _ = _two_steps(model, lambda meta: meta.last_index, (10, 7))
    assert len(stages) == 2, "both steps should have run as one stage graph"
    assert torch.equal(kept[0], full[0][[9, 16]]) and torch.equal(kept[1], full[1])
    rows = lambda routes, l: [n for layer, n in routes if layer == l]
    assert rows(kept_routes, 2) == [2, 2] and rows(full_routes, 2) == [17, 2]
    assert rows(kept_routes, 0) == rows(full_routes, 0) == [17, 2]


def test_step_and_a_middle_chunk(files):
    """StageModel.step reads the last row only (its logits equal a full run's), and out_rows must
    name a row: an empty list is refused with a message, not a graph of no rows."""
    routes = []
    model = _load(files["qwen3moe"], routes)
    ids = token_ids(24, seed=3)
    kv = model.new_kv_cache(1, 32)
    logits = model.step([ids], [0], kv)
    full = model.logits_all(ids)
    assert torch.equal(logits[0], full[-1])
    meta = model.batch_meta([3], [0], model.new_kv_cache(1, 8))
    with pytest.raises(ValueError, match="out_rows is empty"):
        model.run_layers(model.embed([[1, 2, 3]]), meta, model.new_kv_cache(1, 8), [])
