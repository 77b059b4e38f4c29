"""The engine: layer-range loading, stage chaining, batched decode, chunked prefill, KV limits.

Uses the real SmolLM2 GGUF (dense llama, Q4_1) and tiny random MoE GGUFs written in
test_gguf_file.py (Mixtral-style llama, qwen2moe, qwen3moe; Q8_0). Correctness against
transformers is tests/stages/test_parity_transformers.py's job; here each behaviour is checked against
the engine's own simplest path (one sequence, one shot, one stage).
"""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from moeray.errors import MoerayError
from moeray.stages.gguf.reader import GGUFFile
from moeray.stages.runtime.model import StageModel, load_model, memory_report
from test_gguf_file import smollm2_path, tiny_config, write_synthetic_gguf

ARCHS = ["llama", "qwen2moe", "qwen3moe"]


@pytest.fixture(autouse=True, scope="module")
def exact_backend():
    """These tests compare packings, chunkings and stage splits of the same math to 1e-5, so they
    run the exact backend: ggml rounds activations to 8 bits, which turns the 1e-7 differences of two
    attention kernels (masked vs causal) into 1e-3. The quantised backends have their own tests
    (test_parity_transformers.py, test_quantised_route.py)."""
    from moeray.stages.kernels import backend

    old = backend.current_backend()
    backend.set_backend("exact")
    yield
    backend.set_backend(old)


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("engine")
    return {a: write_synthetic_gguf(d / f"{a}.gguf", tiny_config(a), seed=11) for a in ARCHS}


@pytest.fixture(scope="module")
def smollm2():
    return load_model(smollm2_path())


def allowed_tensors(g: GGUFFile, first: int, end: int) -> set[str]:
    names = {n for n in g.tensors if n.startswith("blk.") and first <= int(n.split(".")[1]) < end}
    if first == 0:
        names.add("token_embd.weight")
    if end == g.config.n_layers:
        names |= {"output_norm.weight", "output.weight" if "output.weight" in g.tensors else "token_embd.weight"}
    return names


def run_stage(model: StageModel, tokens: list[int], hidden: torch.Tensor | None = None):
    kv = model.new_kv_cache(1, 64)
    meta = model.batch_meta([len(tokens)], [0], kv)
    x = model.embed([tokens]) if model.has_embedding else hidden
    x = model.run_layers(x, meta, kv)
    return model.head(x) if model.has_head else x


@pytest.mark.parametrize("first,end", [(0, 1), (1, 2), (2, 3), (0, 3)])
def test_layer_range_touches_only_its_tensors(tiny_files, first, end):
    g = GGUFFile(tiny_files["llama"])
    model = StageModel.from_gguf(g, (first, end))
    hidden = None if first == 0 else torch.randn(9, g.config.hidden)
    run_stage(model, list(range(9)), hidden)  # routed experts are read when used, not at load
    allowed = allowed_tensors(g, first, end)
    assert g.touched <= allowed, f"read outside [{first}, {end}): {sorted(g.touched - allowed)}"
    assert g.touched == allowed  # and everything it needs (9 tokens route to every expert file)
    assert model.has_embedding == (first == 0) and model.has_head == (end == 3)


def test_out_of_range_bytes_are_never_read(tiny_files, tmp_path):
    """Stronger than bookkeeping: wreck every tensor outside layers [1, 2) on disk; the stage still
    computes exactly what it computes on the intact file."""
    src = tiny_files["qwen2moe"]
    g = GGUFFile(src)
    data = bytearray(src.read_bytes())
    keep = allowed_tensors(g, 1, 2)
    for name, t in g.tensors.items():
        if name not in keep:
            data[t.offset:t.offset + t.n_bytes] = b"\xff" * t.n_bytes  # NaN scales and weights
    broken = tmp_path / "wrecked-outside-layer-1.gguf"
    broken.write_bytes(bytes(data))
    hidden = torch.randn(7, g.config.hidden, generator=torch.Generator().manual_seed(0))
    ok = run_stage(StageModel.from_gguf(src, (1, 2)), list(range(7)), hidden)
    out = run_stage(StageModel.from_gguf(broken, (1, 2)), list(range(7)), hidden)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ok, rtol=0, atol=0)
    with pytest.raises(AssertionError):  # the wreck is real: the full model does read those bytes
        assert torch.isfinite(run_stage(StageModel.from_gguf(broken), list(range(7)))).all()


def test_smollm2_middle_stage_reads_only_its_layers():
    g = GGUFFile(smollm2_path())
    StageModel.from_gguf(g, (10, 20))
    layers = {int(m.group(1)) for n in g.touched if (m := re.match(r"blk\.(\d+)\.", n))}
    assert layers == set(range(10, 20))
    assert "token_embd.weight" not in g.touched and "output_norm.weight" not in g.touched


@pytest.mark.parametrize("arch", ARCHS)
def test_chained_stages_equal_the_full_model(tiny_files, arch):
    tokens = [5, 17, 99, 3, 150, 42, 8, 77, 21, 64, 130]
    full = load_model(tiny_files[arch]).logits_all(tokens)
    g = GGUFFile(tiny_files[arch])
    h = run_stage(StageModel.from_gguf(g, (0, 1)), tokens)
    h = run_stage(StageModel.from_gguf(g, (1, 2)), tokens, h)
    logits = run_stage(StageModel.from_gguf(g, (2, 3)), tokens, h)
    torch.testing.assert_close(logits, full, rtol=0, atol=1e-5)


def test_smollm2_two_stages_equal_the_full_model(smollm2):
    tokens = [1, 504, 3458, 282, 4649, 314, 28, 1000]
    g = GGUFFile(smollm2_path())
    h = run_stage(StageModel.from_gguf(g, (0, 13)), tokens)
    logits = run_stage(StageModel.from_gguf(g, (13, 30)), tokens, h)
    torch.testing.assert_close(logits, smollm2.logits_all(tokens), rtol=0, atol=1e-4)


def greedy(model: StageModel, prompts: list[list[int]], slots: list[int], n: int, max_seqs: int = 4):
    """Greedy decode of all prompts together; returns per sequence the tokens and the logits."""
    kv = model.new_kv_cache(max_seqs, 64)
    logits = model.step(prompts, slots, kv)
    toks = [[] for _ in prompts]
    all_logits = [[] for _ in prompts]
    for _ in range(n):
        nxt = logits.argmax(-1).tolist()
        for i, t in enumerate(nxt):
            toks[i].append(t)
            all_logits[i].append(logits[i])
        logits = model.step([[t] for t in nxt], slots, kv)
    return toks, [torch.stack(x) for x in all_logits]


PROMPTS = [[1, 504, 3458, 282, 4649], [1, 28, 1000, 77, 9, 314, 22, 504, 15, 61, 7], [1, 9]]


def test_batched_decode_matches_each_sequence_alone_smollm2(smollm2):
    # slots out of order and with a gap: the cache is gathered, not sliced
    batched_toks, batched_logits = greedy(smollm2, PROMPTS, [3, 0, 2], 8)
    for i, p in enumerate(PROMPTS):
        alone_toks, alone_logits = greedy(smollm2, [p], [0], 8)
        assert batched_toks[i] == alone_toks[0]
        torch.testing.assert_close(batched_logits[i], alone_logits[0], rtol=0, atol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_decode_matches_each_sequence_alone_moe(tiny_files, arch):
    model = load_model(tiny_files[arch])
    prompts = [[p % 160 for p in q] for q in PROMPTS]
    batched_toks, batched_logits = greedy(model, prompts, [0, 1, 2], 8)  # contiguous: a cache view
    for i, p in enumerate(prompts):
        alone_toks, alone_logits = greedy(model, [p], [0], 8)
        assert batched_toks[i] == alone_toks[0]
        torch.testing.assert_close(batched_logits[i], alone_logits[0], rtol=0, atol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen3moe"])
def test_chunked_prefill_equals_one_shot(tiny_files, arch):
    model = load_model(tiny_files[arch])
    prompt = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43]
    one_shot = model.logits_all(prompt)
    kv = model.new_kv_cache(2, 32)
    kv.lengths[1] = 5  # a neighbour slot holding something must not matter
    got, pos = [], 0
    for n in (5, 1, 7):
        got.append(model.step([prompt[pos:pos + n]], [0], kv))
        pos += n
    torch.testing.assert_close(torch.cat(got), one_shot[[4, 5, 12]], rtol=0, atol=1e-5)
    assert kv.lengths[0] == 13 and kv.lengths[1] == 5


def test_mixed_prefill_and_decode_in_one_step(tiny_files):
    """One step may hold a decoding sequence and another's prefill chunk."""
    model = load_model(tiny_files["qwen2moe"])
    a, b = [1, 2, 3, 4, 5, 6], [7, 8, 9, 10]
    kv = model.new_kv_cache(2, 32)
    model.step([a[:5]], [0], kv)
    mixed = model.step([a[5:], b], [0, 1], kv)
    torch.testing.assert_close(mixed[0], model.logits_all(a)[-1], rtol=0, atol=1e-5)
    torch.testing.assert_close(mixed[1], model.logits_all(b)[-1], rtol=0, atol=1e-5)


def test_kv_cache_overflow_is_a_clear_error(tiny_files):
    model = load_model(tiny_files["llama"])
    kv = model.new_kv_cache(1, 8)
    model.step([[1, 2, 3, 4, 5, 6]], [0], kv)
    with pytest.raises(MoerayError, match="max_len 8"):
        model.step([[1, 2, 3]], [0], kv)
    kv.reset(0)
    assert model.step([[1, 2, 3]], [0], kv).shape == (1, 160)


def test_each_used_expert_is_computed_once_per_step_and_observed(tiny_files):
    from moeray.stages.gguf.reader import GGUFFile
    from moeray.stages.blocks.moe import HostExperts

    seen = []
    gguf = GGUFFile(tiny_files["llama"])
    host = HostExperts(gguf, on_route=lambda layer, ids, w: seen.append((layer, ids.clone(), w.clone())))
    model = load_model(gguf, experts=host)
    kv = model.new_kv_cache(1, 64)
    model.step([list(range(40))], [0], kv)  # 40 tokens x top-2 over 4 experts
    assert host.computed <= 3 * 4  # at most every expert of every layer, once, for all its tokens
    assert [s[0] for s in seen] == [0, 1, 2]
    for layer, ids, w in seen:  # the last layer's FFN runs for the one row the head reads
        n = 40 if layer < 2 else 1
        assert ids.shape == w.shape == (n, 2)
        torch.testing.assert_close(w.sum(-1), torch.ones(n))  # Mixtral renormalises
        assert len(set(ids.flatten().tolist())) == (4 if n == 40 else 2)


def test_memory_report_experts_stay_quantised(tiny_files):
    model = load_model(tiny_files["qwen3moe"])
    rep = memory_report(model)
    g = model.gguf
    experts = sum(t.n_bytes for n, t in g.tensors.items() if n.endswith("_exps.weight"))
    assert rep["experts_quantized_mapped_bytes"] == experts
    # The trunk is held in its stored block form: exactly the file's trunk bytes.
    quantised = memory_report(load_model(tiny_files["qwen3moe"], backend="dequant"))
    assert quantised["trunk_resident_bytes"] == quantised["stored_bytes"] - experts
    exact = memory_report(load_model(tiny_files["qwen3moe"], backend="exact"))
    expert_f32 = sum(4 * int(np.prod(t.shape)) for n, t in g.tensors.items() if n.endswith("_exps.weight"))
    assert exact["trunk_resident_bytes"] == exact["fully_dequantized_bytes"] - expert_f32
    assert rep["process_rss_bytes"] > rep["trunk_resident_bytes"]
