"""A hybrid step as one ggml graph (stages/runtime/trunk_graph.py: the Gated DeltaNet's projection,
short conv, gated delta rule, gated norm and output projection, and the gated full attention, as
graph nodes; the recurrent state read and written in place by slot) against the torch rule it
replaces on the same backend (stages/blocks/deltanet.py, attention.GatedAttention: the reference),
on tiny random Qwen3-Next and Qwen3.5-MoE files (Q8_0).

Both sides run the same ggml matmuls (activations rounded to 8 bits before each) and
ggml_gated_delta_net for the rule; q/k's L2 norm, the conv and flash attention against SDPA differ
in the last bits, which now and then moves one rounding step that the recurrent state then carries
forward. The bound is the ggml backend's own, 1e-1 of the largest logit (tests/stages/test_trunk_graph.py);
measured: 0 to 2.8e-2 (equal bit for bit up to a first flipped rounding, e.g. position 67 of 150).
A conv state left unwritten, a pad row that writes the state, or a padded sequence's conv state
cut at the step's widest count is off by 1.2-1.4 of the largest logit (each tried)."""
from __future__ import annotations

import pytest
import torch

from moeray.stages.gguf.writer import write_gguf
from moeray.stages.kernels.backend import ggml_available
from moeray.stages.runtime.model import StageModel, load_model
from tiny_hybrid import HYBRID_BUILDERS
from tiny_models import token_ids

pytestmark = pytest.mark.skipif(not ggml_available(), reason="ggml-python is not installed")

RTOL = 1e-1  # of the largest |logit|


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid-graph")
    return {name: write_gguf(build(), root / f"{name}.gguf", "Q8_0") for name, build in HYBRID_BUILDERS.items()}


class Both:
    """One model run with its stage graphs and without them (the torch rule), graph calls counted."""

    def __init__(self, path):
        self.model = load_model(path, backend="ggml")
        assert self.model.trunk is not None, "a hybrid model on the ggml backend should run as graphs"
        self.graphs = self.model.trunk
        self.calls = {"layer": 0, "stage": 0}
        for name in self.calls:
            real = getattr(self.graphs, name)
            setattr(self.graphs, name, self._counted(name, real))

    def _counted(self, name, real):
        def counted(*a, **kw):
            self.calls[name] += 1
            return real(*a, **kw)
        return counted

    def run(self, graph: bool, fn):
        self.model.trunk = self.graphs if graph else None
        try:
            with torch.inference_mode():
                return fn(self.model)
        finally:
            self.model.trunk = self.graphs

    def close(self, fn, what: str) -> None:
        before = dict(self.calls)
        got = self.run(True, fn)
        assert self.calls != before, f"{what}: the graphs did not run"
        ref = self.run(False, fn)
        err = ((got - ref).abs().max() / ref.abs().max()).item()
        assert err <= RTOL, f"{what}: {err:.2e} of max |logit|"


@pytest.fixture(scope="module", params=list(HYBRID_BUILDERS))
def both(request, files):
    return Both(files[request.param])


def _chunks_then_decode(ids, cuts):
    """Logits of a prompt fed in chunks (the state carried between them), then one token a step."""
    def fn(model):
        kv = model.new_kv_cache(1, len(ids) + 4)
        bounds = list(cuts) + list(range(cuts[-1] + 1, len(ids) + 1))
        return torch.cat([model.step([ids[a:b]], [0], kv) for a, b in zip(bounds, bounds[1:])])
    return fn


def test_prefill_logits(both):
    """150 tokens in one step: past two of the rule's 64-token chunks, every position's logits."""
    both.close(lambda m: m.logits_all(token_ids(150)), "prefill")


def test_chunks_then_decode_one_graph_a_step(both):
    """Prefill in three chunks of unequal length, then 10 decode steps: the states carried across
    chunks and steps; every decode step is one stage graph (the layers' trunks, routing and experts
    in one call), and so is a chunk of up to STAGE_TOKENS tokens; a longer one is a graph a layer."""
    ids = token_ids(80, seed=3)
    fn = _chunks_then_decode(ids, (0, 37, 45, 70))
    both.close(fn, "chunks + decode")
    before = dict(both.calls)
    both.run(True, fn)
    n_layers = both.model.config.n_layers
    assert both.calls["stage"] - before["stage"] == 10 + 2  # the decode steps, the 8- and 25-token chunks
    assert both.calls["layer"] - before["layer"] == n_layers  # the 37-token chunk: over STAGE_TOKENS


def _sixteen(model):
    """The engine's steps on a block pool with state slots: sequences 0-3 continue a shared
    16-token prefix (its KV block read by all four, its state copied into their slots: the
    checkpoint primitive), 4-15 start fresh; all 16 decode together (keys gathered by block); then
    mixed steps (one, then two sequences add two tokens, the others one: queries padded inside
    the graph, a pad row leaving its state alone)."""
    prefix = token_ids(16, seed=11)
    prompts = [token_ids(3 + i % 5, seed=20 + i) for i in range(16)]
    tables = [[0] + [1 + 3 * i + j for j in range(3)] if i < 4 else [100 + 4 * i + j for j in range(4)]
              for i in range(16)]
    kv = model.new_kv_pool(200, 17)  # slot 16: the prefix's own state
    out, lens = [], []
    slot_of = [(5 * i) % 16 for i in range(16)]  # not consecutive: the step's states gathered by slot

    def run(n_new, starts, toks, idx, slots=None):
        slots = [slot_of[i] for i in idx] if slots is None else slots
        meta = model.table_meta(n_new, starts, [tables[i] for i in idx], kv, slots)
        x = model.run_layers(model.embed(toks), meta, kv)
        return model.head(x[meta.last_index])

    run([16], [0], [prefix], [0], slots=[16])
    kv.state.copy([(16, slot_of[i]) for i in range(4)])
    for i in range(16):
        start = 16 if i < 4 else 0
        toks = prompts[i] if i < 4 else prefix + prompts[i]
        out.append(run([len(toks)], [start], [toks], [i]))
        lens.append(start + len(toks))
    feed = token_ids(16 * 6, seed=9)
    nxt = [[t] for t in feed[:16]]
    for step in range(1, 5):
        out.append(run([1] * 16, lens, nxt, range(16)))
        lens = [n + 1 for n in lens]
        nxt = [[t] for t in feed[16 * step:16 * step + 16]]
    for mixed in ([2] + [1] * 15, [2, 2] + [1] * 14, [1] * 16):
        toks = [nxt[i] * k for i, k in enumerate(mixed)]
        out.append(run(mixed, lens, toks, range(16)))
        lens = [n + k for n, k in zip(lens, mixed)]
        nxt = [[t] for t in feed[80:96]]
    return torch.cat(out)


def test_sixteen_sequences_and_mixed_steps(both):
    both.close(_sixteen, "16 sequences")
    keys = [k[0] for k in list(both.graphs._graphs) + list(both.graphs._stages)]
    assert any(k[3] for k in keys)  # a mixed step ran padded
    assert {"view", "gather"} <= {k[4] for k in keys}
    assert {True, False} <= {k[-2] if k[3] else k[-1] for k in keys}  # states read in place and gathered


def test_a_token_alone_equals_it_batched(both):
    """A sequence's decode logits are the same bits whether it runs alone or beside 15 others
    (its state read and written by slot, its keys gathered or viewed, its matmul rows alone)."""
    m = both.model
    prompts = [token_ids(5 + 3 * i, seed=30 + i) for i in range(16)]
    feed = token_ids(16 * 4, seed=9)
    tables = [[10 * i + j for j in range(4)] for i in range(16)]

    def run(which):
        kv = m.new_kv_pool(200, 16)
        lens = []
        for i in which:
            m.run_layers(m.embed([prompts[i]]), m.table_meta([len(prompts[i])], [0], [tables[i]], kv, [i]), kv)
            lens.append(len(prompts[i]))
        out = []
        for s in range(4):
            meta = m.table_meta([1] * len(which), lens, [tables[i] for i in which], kv, list(which))
            out.append(m.head(m.run_layers(m.embed([[feed[16 * s + i]] for i in which]), meta, kv)))
            lens = [n + 1 for n in lens]
        return torch.stack(out)

    with torch.inference_mode():
        together = run(list(range(16)))
        for j in (0, 9, 15):
            assert torch.equal(run([j])[:, 0], together[:, j]), f"sequence {j}"


def test_stages_of_deltanet_layers_only(files):
    """A pipeline cut inside the 3:1 pattern: a stage of DeltaNet layers alone (no KV pool rows
    to read) and one holding the attention layer, each as its own graphs, give the whole model's
    logits (the same graphs, the same bits)."""
    path = files["qwen35moe"]
    whole = load_model(path, backend="ggml")
    parts = [StageModel.from_gguf(path, (0, 2), backend="ggml"), StageModel.from_gguf(path, (2, 4), backend="ggml")]
    assert all(p.trunk is not None for p in parts) and not parts[0].kv_layers()
    ids = token_ids(40, seed=5)
    with torch.inference_mode():
        ref = whole.logits_all(ids)
        kvs = [p.new_kv_cache(1, 48) for p in parts]
        x = parts[0].embed([ids])
        for p, kv in zip(parts, kvs):
            x = p.run_layers(x, p.batch_meta([len(ids)], [0], kv), kv)
        got = parts[1].head(x)
    assert torch.equal(got, ref)
