"""KV cache types (llama.cpp's -ctk / -ctv): a pool's K and V rows in f32, f16, q8_0 or q4_0.

The torch path writes the very bytes ggml_set_rows writes (so either path reads what the other
wrote); the trunk graph attends over quantised rows as stored (ggml_flash_attn_ext) and the torch
path over the same rows dequantised, within the ggml backend's tolerance, for GQA with gathered and
padded steps, MLA's latent (DeepSeek) and a hybrid's attention layers; a pool takes exactly the
bytes its types say. A type the model's attention cannot use is one line naming it and the fix.
The default model's runs: tests/e2e/test_kv_types_default_model.py."""
from __future__ import annotations

import ctypes
import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from moeray.errors import ConfigError, MoerayError
from moeray.planner.kv import KVTypes, row_bytes
from moeray.stages.blocks import kv_quant
from moeray.stages.blocks.kv_cache import BLOCK_SIZE, KVPool, kv_block_bytes
from moeray.stages.kernels import settings
from moeray.stages.kernels.backend import ggml_available
from moeray.stages.runtime.model import load_model

needs_ggml = pytest.mark.skipif(not ggml_available(), reason="ggml-python is not installed")
QUANTISED = ("f16", "q8_0", "q4_0")


def _ggml_rows(x: torch.Tensor, cache_type: str) -> torch.Tensor:
    """x [n, width] written by ggml_set_rows into a tensor of `cache_type`: its bytes [n, row bytes]."""
    from moeray.stages.kernels.backend import ggml_lib

    G = ggml_lib()
    n, width = x.shape
    ctx = G.ggml_init(G.ggml_init_params(mem_size=64 << 20, mem_buffer=None, no_alloc=False))
    try:
        dst = G.ggml_new_tensor_2d(ctx, getattr(G, f"GGML_TYPE_{cache_type.upper()}"), width, n)
        src = G.ggml_new_tensor_2d(ctx, G.GGML_TYPE_F32, width, n)
        rows = G.ggml_new_tensor_1d(ctx, G.GGML_TYPE_I64, n)
        x, idx = x.contiguous(), torch.arange(n)
        ctypes.memmove(G.ggml_get_data(src), x.data_ptr(), x.numel() * 4)
        ctypes.memmove(G.ggml_get_data(rows), idx.data_ptr(), n * 8)
        gf = G.ggml_new_graph(ctx)
        G.ggml_build_forward_expand(gf, G.ggml_set_rows(ctx, dst, src, rows))
        G.ggml_graph_compute_with_ctx(ctx, gf, 1)
        size = n * (2 * width if cache_type == "f16" else row_bytes(cache_type, width))
        return torch.frombuffer(bytearray(ctypes.string_at(G.ggml_get_data(dst), size)), dtype=torch.uint8).view(n, -1)
    finally:
        G.ggml_free(ctx)


@needs_ggml
@pytest.mark.parametrize("cache_type", QUANTISED)
def test_the_torch_path_writes_the_bytes_ggml_writes_and_reads_them_back(cache_type):
    torch.manual_seed(0)
    x = torch.randn(512, 128) * torch.rand(512, 1) * 8
    x[0] = 0  # an all-zero block: scale 0
    x[1, :32] = torch.tensor([3.0, -3.0] * 16)  # the same magnitude both signs: the first one sets q4_0's scale
    x[2, :32] = torch.arange(32) / 2 - 8  # codes at exact halves: ties round as ggml's CPU rounds them
    mine = kv_quant.quantize(x, cache_type)
    assert torch.equal(mine.view(torch.uint8).view(512, -1), _ggml_rows(x, cache_type))
    back = kv_quant.dequantize_rows(mine, cache_type, 128)
    blocks, err = x.view(-1, 32), (back - x).abs().view(-1, 32)
    amax = blocks.abs().amax(1, keepdim=True)
    # f16: half an ulp; q8_0: half a step of amax / 127; q4_0: one step of amax / 8 (the far side
    # clamps at 15); each quantised step moved by its float16 scale's rounding (up to 127 / 8 codes x 2^-11)
    bound = {"f16": amax * 2 ** -11, "q8_0": amax / 127 * 0.57, "q4_0": amax / 8 * 1.01}[cache_type]
    assert (err <= bound + 1e-6).all()


def test_a_pool_takes_the_bytes_its_types_say():
    from test_gguf_file import tiny_config

    cfg = dataclasses.replace(tiny_config("llama", n_experts=0), head_dim=32)
    per_token = {t: 3 * 2 * 2 * (32 * 4 if t == "f32" else 32 * 2 if t == "f16" else row_bytes(t, 32))
                 for t in ("f32", "f16", "q8_0", "q4_0")}  # 3 layers x k and v x 2 heads
    assert per_token["q8_0"] / per_token["f32"] == 34 / 128 and per_token["q4_0"] / per_token["f32"] == 18 / 128
    for t, n in per_token.items():
        types = KVTypes.same(t)
        pool = KVPool(0, 3, 10, 2, 32, types=types)
        assert pool.nbytes() == 10 * kv_block_bytes(cfg, 3, types) == 10 * BLOCK_SIZE * n
        assert pool.block_bytes() == BLOCK_SIZE * n
    mixed = KVPool(0, 3, 10, 2, 32, types=KVTypes("q8_0", "f16"))
    assert mixed.nbytes() == 10 * BLOCK_SIZE * (per_token["q8_0"] + per_token["f16"]) // 2


def test_a_type_the_attention_cannot_use_is_one_line(tmp_path):
    from test_gguf_file import tiny_config, write_synthetic_gguf

    with pytest.raises(ConfigError, match="cache_type_k.*choose one of auto, f32, f16, q8_0, q4_0"):
        settings.StageOptions(cache_type_k="q5_1")
    path = write_synthetic_gguf(tmp_path / "d.gguf", tiny_config("llama", n_experts=0), seed=1)  # head_dim 24
    model = load_model(str(path))
    settings.update(cache_type_k="q8_0", cache_type_v="q8_0")
    with pytest.raises(MoerayError) as exc:
        model.new_kv_pool(4)
    line = str(exc.value)
    assert "\n" not in line and "q8_0 stores a row in blocks of 32 values" in line and "24 values wide" in line
    assert "choose f16 or f32" in line
    settings.update(cache_type_k="f16", cache_type_v="f32")  # K and V apart: fine for GQA
    assert model.new_kv_pool(4).types == KVTypes("f16", "f32")


@pytest.fixture(scope="module")
def toy_files(tmp_path_factory):
    """bench/shapes.py's toy widths of an MLA family and a hybrid one: rows of 160 (latent 128 + rope
    key 32) and heads of 64, each a whole number of 32-value blocks."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from shapes import SHAPES, shrink, write_shape

    root = tmp_path_factory.mktemp("toys")
    return {name: str(write_shape(name, shape=shrink(SHAPES[name]), path=root / f"{name}.gguf", pool_blocks=1024))
            for name in ("deepseek-v2-lite", "qwen3.6-35b-a3b")}


def test_mla_keeps_one_latent_row_so_its_v_type_follows_k(toy_files):
    model = load_model(toy_files["deepseek-v2-lite"])
    settings.update(cache_type_k="q8_0", cache_type_v="auto")
    pool = model.new_kv_pool(4)
    assert pool.types == KVTypes("q8_0", "q8_0") and pool.v == [None] * len(pool.v)
    assert pool.k[0].shape == (1, 4 * BLOCK_SIZE, row_bytes("q8_0", 160))
    settings.update(cache_type_v="f16")
    with pytest.raises(MoerayError, match="one latent row per token .MLA., which is its key and its value"):
        model.new_kv_pool(4)


@needs_ggml
@pytest.mark.parametrize("name", ["deepseek-v2-lite", "qwen3.6-35b-a3b"])
def test_mla_and_hybrid_attention_over_a_q8_0_pool(toy_files, name):
    """DeepSeek's latent rows and a hybrid's attention layers (its DeltaNet states stay float32) in
    q8_0: the graph against the torch path, chunks (17 rows, and on MLA 65: read as float32 for
    ggml's tiled flash attention, trunk_graph.FLOAT_READ_ROWS; 4 rows: as stored) then decode, both
    reading the same pool. The MLA toy is compared after its first (dense) layer: its random routers
    sit at near-ties, so from the first MoE layer on a last-bit difference picks other experts, in
    float32 as in q8_0 (measured: 0.73 of the largest logit in float32, 0.70 in q8_0, against 0.014
    and 0.012 after layer 0). The hybrid, compared at its logits, keeps to 40 tokens: its routers
    too move its logits by 0.114 of the largest over 92 (the same with the tiled kernel from 64 rows)."""
    from moeray.stages.runtime.model import StageModel

    from test_trunk_graph import RTOL
    from tiny_models import token_ids

    settings.update(cache_type_k="q8_0", cache_type_v="q8_0")
    mla = name == "deepseek-v2-lite"
    model = StageModel.from_gguf(toy_files[name], (0, 1) if mla else None)
    ids = [t % 49152 for t in token_ids(92 if mla else 40, seed=3)]

    def run():
        kv = model.new_kv_cache(1, len(ids) + 8)
        assert kv.types == KVTypes.same("q8_0") and kv.k[0].dtype == torch.uint8
        out, cuts = [], [0, 17, 21, *([86] if mla else []), *range(87 if mla else 22, len(ids) + 1)]
        for a, b in zip(cuts, cuts[1:]):
            h = model.run_layers(model.embed([ids[a:b]]), model.batch_meta([b - a], [0], kv), kv)
            out.append(h if mla else model.head(h))
        return torch.cat(out)

    trunk = model.trunk
    assert trunk is not None
    with torch.inference_mode():
        graph = run()
        model.trunk = None
        ref = run()
        model.trunk = trunk
    err = (graph - ref).abs().max() / ref.abs().max()
    assert err <= RTOL, f"{err:.2e} of the largest value"


def test_a_quantised_row_is_turned_by_llama_cpps_hadamard_rule():
    """llama.cpp turns K and V rows by a Walsh-Hadamard matrix before quantising them (its
    attn_rot_k / attn_rot_v): K in blocks of the largest power of two from 64 dividing the row, V
    in blocks of 64, only for quantised types and rows a multiple of 64 wide. Its matrix (Sylvester's,
    ggml_gen_hadamard's loop) is ours; the torch path stores the row turned, in ggml's bytes, and
    reads it back unturned."""
    from moeray.stages.blocks.kv_rotation import hadamard, rotate, rotation

    assert [rotation("q4_0", w, "k") for w in (64, 128, 256, 576, 96, 160)] == [64, 128, 256, 64, 0, 0]
    assert [rotation("q8_0", w, "v") for w in (64, 128, 256, 96)] == [64, 64, 64, 0]
    assert rotation("f16", 128, "k") == rotation("f32", 128, "v") == 0
    for n in (64, 128, 256):  # ggml_gen_hadamard, line for line
        ref = torch.zeros(n, n)
        ref[0, 0] = 1 / n ** 0.5
        s = 1
        while s < n:
            ref[s:2 * s, :s], ref[:s, s:2 * s], ref[s:2 * s, s:2 * s] = ref[:s, :s], ref[:s, :s], -ref[:s, :s]
            s *= 2
        assert torch.equal(hadamard(n), ref)
    torch.manual_seed(1)
    x = torch.randn(20, 2, 128)
    x[..., 5] *= 30  # an outlier channel, as keys have: what the rotation is for
    pool = KVPool(0, 1, 2, 2, 128, types=KVTypes("q4_0", "q8_0"))
    assert pool.rot == {"k": 128, "v": 64}
    k, v = pool.layer(0)
    rows = torch.arange(20)
    pool.write(k, "k", rows, x)
    pool.write(v, "v", rows, x)
    for cache, t, n in ((k, "q4_0", 128), (v, "q8_0", 64)):
        turned = rotate(x, n)
        assert torch.equal(cache[:, :20].transpose(0, 1), kv_quant.quantize(turned, t))
        back = rotate(kv_quant.dequantize_rows(cache[:, :20].transpose(0, 1), t, 128), n)
        plain = kv_quant.dequantize_rows(kv_quant.quantize(x, t), t, 128)  # what an unturned row keeps
        assert (back - x).norm() < 0.5 * (plain - x).norm()


def _ggml_turned(x: torch.Tensor, n: int) -> torch.Tensor:
    """x [rows, width] turned by ggml's Walsh-Hadamard transform, the trunk graph's own node
    (TrunkGraphs._hadamard: a mul_mat hinted GGML_HINT_SRC0_IS_HADAMARD)."""
    from moeray.stages.kernels.backend import ggml_lib
    from moeray.stages.runtime.trunk_graph import TrunkGraphs

    G = ggml_lib()
    rows, width = x.shape
    ctx = G.ggml_init(G.ggml_init_params(mem_size=64 << 20, mem_buffer=None, no_alloc=False))
    try:
        src = G.ggml_new_tensor_2d(ctx, G.GGML_TYPE_F32, width, rows)
        x = x.contiguous()
        ctypes.memmove(G.ggml_get_data(src), x.data_ptr(), x.numel() * 4)
        out = TrunkGraphs._hadamard(ctx, {"hadamard": {}}, src, n)
        gf = G.ggml_new_graph(ctx)
        G.ggml_build_forward_expand(gf, out)
        G.ggml_graph_compute_with_ctx(ctx, gf, 2)
        return torch.frombuffer(bytearray(ctypes.string_at(G.ggml_get_data(out), x.numel() * 4)),
                                dtype=torch.float32).view(rows, width).clone()
    finally:
        G.ggml_free(ctx)


@needs_ggml
@pytest.mark.parametrize("types", [KVTypes("q4_0", "q4_0"), KVTypes("q8_0", "q4_0"), KVTypes("q4_0", "f16")])
def test_the_graph_stores_the_rows_llama_cpp_stores(tmp_path, types):
    """A prompt through the trunk graph into a quantised pool: layer 0's K and V rows (computed
    before any attention, so the same floats at every type: a float32 pool keeps them as they are)
    are, byte for byte, ggml's quantisation of those floats turned as llama.cpp turns them, and
    ggml's transform is the torch path's rotation. Rows stored unturned (moeray's q4_0 perplexity
    was 19.50 where llama.cpp's is 17.19) or turned by another block fail here."""
    from test_gguf_file import tiny_config, write_synthetic_gguf
    from tiny_models import token_ids

    from moeray.stages.blocks.kv_rotation import rotate, rotation

    cfg = dataclasses.replace(tiny_config("llama", n_experts=0), head_dim=128)
    model = load_model(str(write_synthetic_gguf(tmp_path / "h128.gguf", cfg, seed=2)))
    assert model.trunk is not None
    ids = [t % cfg.vocab_size for t in token_ids(40, seed=4)]

    def pool(t: KVTypes):
        kv = model.new_kv_cache(1, 48, t)
        with torch.inference_mode():
            model.run_layers(model.embed([ids]), model.batch_meta([40], [0], kv), kv)
        return kv

    plain, stored = pool(KVTypes.same("f32")), pool(types)
    for kind, t in (("k", types.k), ("v", types.v)):
        floats = getattr(plain, kind)[0][:, :40].reshape(-1, 128)  # [heads * tokens, 128]
        n = rotation(t, 128, kind)
        turned = _ggml_turned(floats, n) if n else floats
        assert torch.allclose(turned, rotate(floats, n), atol=1e-5)
        rows = getattr(stored, kind)[0][:, :40].reshape(2 * 40, -1)
        assert torch.equal(rows.view(torch.uint8), _ggml_rows(turned, t)), f"{kind} rows in {t}"


def _graph_and_torch(model, run):
    """run() through the stage's trunk graphs, then through the torch path (the trunk set aside)."""
    trunk = model.trunk
    try:
        with torch.inference_mode():
            graph = run()
            model.trunk = None
            return graph, run()
    finally:
        model.trunk = trunk


@pytest.mark.parametrize("cache_type", QUANTISED)
def test_decode_over_512_quantised_keys_and_more_agrees_with_the_torch_path(tmp_path, cache_type):
    """A one-token step over 512 keys or more, where moeray's ggml splits the keys among its threads
    for q8_0 / q4_0 rows as for float ones (stages/kernels/ggml_build.py OPS_HOOKS: each thread
    every head over its share of the keys, the partial softmaxes merged): its logits against the
    torch path reading the same pool, at two threads, token by token across the 512 mark."""
    from test_gguf_file import tiny_config, write_synthetic_gguf
    from test_trunk_graph import RTOL
    from tiny_models import token_ids

    from moeray.stages.kernels.threads import ggml_threads, set_threads

    cfg = dataclasses.replace(tiny_config("llama", n_experts=0), head_dim=64, context_length=1024)
    model = load_model(str(write_synthetic_gguf(tmp_path / "long.gguf", cfg, seed=6)))
    assert model.trunk is not None
    ids = [t % cfg.vocab_size for t in token_ids(700, seed=7)]
    types = KVTypes.same(cache_type)

    def run():
        kv = model.new_kv_cache(1, 720, types)
        for a in range(0, 508, 127):
            model.step([ids[a:a + 127]], [0], kv)
        return torch.stack([model.step([[t]], [0], kv)[0] for t in ids[508:520]])  # keys 509 .. 520

    before = ggml_threads()
    set_threads(2)
    try:
        graph, ref = _graph_and_torch(model, run)
    finally:
        set_threads(before)
    err = (graph - ref).abs().max() / ref.abs().max()
    assert err <= RTOL, f"{err:.2e} of the largest logit"


@pytest.mark.parametrize("cache_type", QUANTISED)
def test_a_prompt_chunk_over_gathered_quantised_blocks_agrees_with_the_torch_path(tmp_path, cache_type):
    """Chunks of 16+ tokens (their keys and values then read as float32 copies for ggml's tiled
    flash attention: trunk_graph.FLOAT_READ_ROWS) on top of blocks that are not consecutive (the
    blocks gathered as stored, then dequantised): their logits against the torch path's. 80 rows
    (a head's 64-row tile and a 16-row one), 20 (the tiled kernel below 64 rows), 65 (a 64-row
    tile and a 1-row one: a returning conversation's new turn)."""
    from test_gguf_file import tiny_config, write_synthetic_gguf
    from test_trunk_graph import RTOL
    from tiny_models import token_ids

    cfg = dataclasses.replace(tiny_config("llama", n_experts=0), head_dim=64)
    model = load_model(str(write_synthetic_gguf(tmp_path / "chunks.gguf", cfg, seed=8)))
    assert model.trunk is not None
    ids = [t % cfg.vocab_size for t in token_ids(265, seed=9)]
    table = [7, 2, 11, 4, 9, 0, 13, 5, 1, 12, 3, 8, 15, 6, 10, 14, 16]  # 272 tokens' blocks, out of order

    def run():
        kv = model.new_kv_pool(17, types=KVTypes.same(cache_type))
        out = []
        for a, b in ((0, 100), (100, 180), (180, 200), (200, 265)):  # 80, 20 and 65 query rows
            meta = model.table_meta([b - a], [a], [table], kv)
            x = model.run_layers(model.embed([ids[a:b]]), meta, kv)
            out.append(model.head(x))
        return torch.cat(out)

    trunk = model.trunk
    graph, ref = _graph_and_torch(model, run)
    steps = [k[0] for k in list(trunk._graphs) + list(trunk._stages)]
    for rows in (80, 20, 65):  # the graph gathered each chunk's blocks
        assert any(k[4] == "gather" and k[1] == rows for k in steps), steps
    err = (graph - ref).abs().max() / ref.abs().max()
    assert err <= RTOL, f"{err:.2e} of the largest logit"


@pytest.mark.parametrize("raw,want", [("", 64), ("32", 32), ("0", "MOERAY_FA_TILED_ROWS='0': give a count"),
                                      ("many", "MOERAY_FA_TILED_ROWS='many': give a count")])
def test_the_tiled_attentions_row_count_is_an_option_the_environment_overrides(monkeypatch, raw, want):
    """StageOptions.fa_tiled_rows (the query rows from which moeray's ggml runs its tiled flash
    attention, and the trunk graph reads quantised rows as float32), MOERAY_FA_TILED_ROWS its
    override: unset is ggml's 64, a count is taken, anything else is one line naming the value; the
    option itself refuses what is not a count of rows."""
    from moeray import environment

    monkeypatch.setenv("MOERAY_FA_TILED_ROWS", raw)
    if isinstance(want, int):
        assert environment.fold(settings.StageOptions(), "stage")[0].fa_tiled_rows == want
    else:
        with pytest.raises(ConfigError, match=want) as exc:
            environment.fold(settings.StageOptions(), "stage")
        assert "\n" not in str(exc.value)
    for bad in (0, -4, 16.0, True):
        with pytest.raises(ConfigError, match="fa_tiled_rows=.*give a count of query rows, 1 or more"):
            settings.StageOptions(fa_tiled_rows=bad)


@needs_ggml
@pytest.mark.parametrize("cache_type", ["f16", "q8_0"])
def test_the_tiled_attentions_row_count_changes_in_process(tmp_path, cache_type):
    """settings.update(fa_tiled_rows=...) reaches this process's ggml at once (ggml_lib.set_fa_tiled_rows):
    a 20-row chunk over 100 keys takes the query-by-query kernel at 64 (the default) and the tiled one
    at 16, whose logits differ in their last bits (the two kernels round differently: the tiled one
    keeps the query float32); set back to 64 the chunk gives the first run's bits again. Over q8_0
    rows the trunk graph reads the keys as float32 from 16 rows too (another graph: its key says so)."""
    from test_gguf_file import tiny_config, write_synthetic_gguf
    from test_trunk_graph import RTOL
    from tiny_models import token_ids

    from moeray.stages.kernels.ggml_lib import fa_rows_settable

    if not fa_rows_settable():
        pytest.skip("this ggml-python was not built by `make venv` (no moeray_ggml_set_fa_tiled_rows)")
    cfg = dataclasses.replace(tiny_config("llama", n_experts=0), head_dim=64)
    model = load_model(str(write_synthetic_gguf(tmp_path / "rows.gguf", cfg, seed=8)))
    assert model.trunk is not None
    ids = [t % cfg.vocab_size for t in token_ids(120, seed=9)]
    table = list(range(8))

    def chunk(rows: int) -> torch.Tensor:
        settings.update(fa_tiled_rows=rows)
        kv = model.new_kv_pool(8, types=KVTypes.same(cache_type))
        with torch.inference_mode():
            for a, b in ((0, 100), (100, 120)):  # 100 rows (tiled at either count), then 20
                meta = model.table_meta([b - a], [a], [table], kv)
                x = model.run_layers(model.embed([ids[a:b]]), meta, kv)
        return model.head(x)

    at64, at16, again = chunk(64), chunk(16), chunk(64)
    assert torch.equal(at64, again)
    assert not torch.equal(at64, at16)
    assert (at64 - at16).abs().max() / at64.abs().max() <= RTOL
    float_reads = {k[0][1]: k[0][-1] for k in model.trunk._graphs} | {k[0][1]: k[0][-1] for k in model.trunk._stages}
    assert float_reads[100] is (cache_type == "q8_0")
    keys = [k[0] for k in list(model.trunk._graphs) + list(model.trunk._stages) if k[0][1] == 20]
    assert {k[-1] for k in keys} == ({False, True} if cache_type == "q8_0" else {False}), keys


@needs_ggml
@pytest.mark.parametrize("cache_type", ["f16", "q8_0"])
def test_with_every_step_tiled_a_prompts_last_token_gets_the_same_logits_alone(tmp_path, cache_type):
    """fa_tiled_rows=1: every step's attention takes ggml's tiled kernel (quantised rows read as
    float32 for it, the one-token step's too), so a 100-token prompt's last token gets the same
    logits, bit for bit, in the prompt's chunk as recomputed alone over the other 99 (what n choices
    sharing a prompt's blocks and one request compute). With the default 64 the chunk runs tiled
    and the token alone query by query, which rounds the query to float16 (or q8_0) and, over f16
    values, sums them in float16: the two differ (docs/kv-cache.md, "Why 64 stays the default")."""
    from test_gguf_file import tiny_config, write_synthetic_gguf
    from tiny_models import token_ids

    from moeray.stages.kernels.ggml_lib import fa_rows_settable

    if not fa_rows_settable():
        pytest.skip("this ggml-python was not built by `make venv` (no moeray_ggml_set_fa_tiled_rows)")
    cfg = dataclasses.replace(tiny_config("llama", n_experts=0), head_dim=64)
    model = load_model(str(write_synthetic_gguf(tmp_path / "alone.gguf", cfg, seed=8)))
    ids = [t % cfg.vocab_size for t in token_ids(100, seed=9)]
    table = list(range(8))
    settings.update(fa_tiled_rows=1)

    def last_logits(chunks) -> torch.Tensor:
        kv = model.new_kv_pool(8, types=KVTypes.same(cache_type))
        with torch.inference_mode():
            for a, b in chunks:
                x = model.run_layers(model.embed([ids[a:b]]), model.table_meta([b - a], [a], [table], kv), kv)
        return model.head(x)[-1]

    assert torch.equal(last_logits([(0, 100)]), last_logits([(0, 99), (99, 100)]))



@needs_ggml
@pytest.mark.parametrize("cache_type", ["q8_0", "q4_0"])
def test_one_token_attention_over_quantised_values_reads_them_as_their_float32_copies(cache_type):
    """ggml's query-by-query flash attention widens q8_0 / q4_0 value rows in moeray's build with its
    own SIMD loop (stages/kernels/ggml_build.py OPS_HOOKS; ggml-base's dequantize is built for SSE2):
    one query per head over 300 keys (under 512: no split among threads) reads those values and
    gets the very bits it gets reading their float32 dequantisation instead (the same K rows)."""
    from moeray.stages.kernels.backend import ggml_lib

    G = ggml_lib()
    torch.manual_seed(3)
    D, keys, kv_heads, heads = 64, 300, 3, 9
    q = torch.randn(heads, 1, D)  # [heads, t, D]: ggml's [D, t, heads, 1]
    k_rows = kv_quant.quantize(torch.randn(kv_heads, keys, D), "q8_0")
    v_rows = kv_quant.quantize(torch.randn(kv_heads, keys, D) * 3, cache_type)
    v_float = kv_quant.dequantize_rows(v_rows, cache_type, D).contiguous()

    def attend(v: torch.Tensor, v_type) -> torch.Tensor:
        ctx = G.ggml_init(G.ggml_init_params(mem_size=16 << 20, mem_buffer=None, no_alloc=True))
        try:
            tq = G.ggml_new_tensor_4d(ctx, G.GGML_TYPE_F32, D, 1, heads, 1)
            tk = G.ggml_new_tensor_4d(ctx, G.GGML_TYPE_Q8_0, D, keys, kv_heads, 1)
            tv = G.ggml_new_tensor_4d(ctx, v_type, D, keys, kv_heads, 1)
            for t, data in ((tq, q), (tk, k_rows), (tv, v)):
                t.contents.data = data.data_ptr()
            o = G.ggml_flash_attn_ext(ctx, tq, tk, tv, None, D ** -0.5, 0.0, 0.0)  # [D, heads, 1, 1]
            G.ggml_flash_attn_ext_set_prec(o, G.GGML_PREC_F32)
            out = torch.empty(heads, D)
            o.contents.data = out.data_ptr()
            gf = G.ggml_new_graph(ctx)
            G.ggml_build_forward_expand(gf, o)
            G.ggml_graph_compute_with_ctx(ctx, gf, 2)
            return out
        finally:
            G.ggml_free(ctx)

    quantised = attend(v_rows, getattr(G, f"GGML_TYPE_{cache_type.upper()}"))
    assert quantised.abs().max() > 0.1
    assert torch.equal(quantised, attend(v_float, G.GGML_TYPE_F32))
