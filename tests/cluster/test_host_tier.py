"""The host tier: KV blocks a stage's pool evicts wait in host memory, named by their prefix hash in
the engine's ledger (cluster/kv_blocks.py HostTier), and are copied back on a prefix hit instead
of prefilled (stages/blocks/host_kv.py moves the bytes, every stage its own).

A block comes back bit for bit (float32 and q8_0 rows); a tier over its bound gives its least
recently used slot to the next save and never grows; a returning conversation whose prefix other
traffic pushed out of the pool is loaded back and answers with the tokens a full re-prefill gives;
a size larger than the node's memory is one line naming the value and the fix."""
from __future__ import annotations

import random

import pytest
import torch

from moeray.cluster.config import EngineConfig, LaunchOptions
from moeray.cluster.engine import Engine
from moeray.cluster.kv_blocks import BlockManager, HostTier
from moeray.cluster.local_pipeline import LocalPipeline
from moeray.errors import MoerayError
from moeray.planner.kv import KVTypes, host_tier_room
from moeray.stages.blocks.host_kv import HostBlocks
from moeray.stages.blocks.kv_cache import BLOCK_SIZE, KVPool
from moeray.stages.text.sampling import SamplingParams
from test_gguf_file import tiny_config, write_synthetic_gguf


@pytest.mark.parametrize("max_runs", [0, 8])  # gathered and scattered, or copied run by run
@pytest.mark.parametrize("cache_type", ["f32", "q8_0"])
def test_blocks_come_back_bit_equal(cache_type, max_runs, monkeypatch):
    from moeray.stages.blocks import host_kv

    monkeypatch.setattr(host_kv, "MAX_RUNS", max_runs)
    pool = KVPool(0, 3, 8, 2, 32, types=KVTypes.same(cache_type), host_blocks=4)
    gen = torch.Generator().manual_seed(0)
    for t in pool.k + pool.v:  # any bytes: the tier copies rows, whatever they hold
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8, generator=gen))
    before = [t.clone() for t in pool.k + pool.v]
    pool.host.save([(5, 0), (2, 3)])
    for t in pool.k + pool.v:  # the pool gives blocks 5 and 2 to other prefixes
        t[:, 2 * BLOCK_SIZE:3 * BLOCK_SIZE] = 0
        t[:, 5 * BLOCK_SIZE:6 * BLOCK_SIZE] = 0
    pool.host.load([(0, 7), (3, 1)])  # and a prompt takes them back into blocks 7 and 1
    for now, old in zip(pool.k + pool.v, before):  # compared as bytes (random bytes hold NaNs as floats)
        now, old = now.view(torch.uint8), old.view(torch.uint8)
        assert torch.equal(now[:, 7 * BLOCK_SIZE:8 * BLOCK_SIZE], old[:, 5 * BLOCK_SIZE:6 * BLOCK_SIZE])
        assert torch.equal(now[:, 1 * BLOCK_SIZE:2 * BLOCK_SIZE], old[:, 2 * BLOCK_SIZE:3 * BLOCK_SIZE])
    s = pool.host.stats
    assert (s.saved, s.loaded) == (2, 2) and s.saved_bytes == 2 * pool.block_bytes()
    with pytest.raises(MoerayError, match="outside the pool"):
        pool.host.load([(4, 0)])

    # a run of consecutive blocks into consecutive slots and back (copied as one slice each way)
    assert HostBlocks.runs([(3, 1), (4, 2), (6, 3), (7, 0)]) == [(3, 1, 2), (6, 3, 1), (7, 0, 1)]
    before = [t.clone() for t in pool.k + pool.v]
    pool.host.save([(3, 1), (4, 2)])
    for t in pool.k + pool.v:
        t[:, 3 * BLOCK_SIZE:5 * BLOCK_SIZE] = 0
    pool.host.load([(1, 6), (2, 7)])
    for now, old in zip(pool.k + pool.v, before):
        now, old = now.view(torch.uint8), old.view(torch.uint8)
        assert torch.equal(now[:, 6 * BLOCK_SIZE:8 * BLOCK_SIZE], old[:, 3 * BLOCK_SIZE:5 * BLOCK_SIZE])


def test_a_tier_over_its_bound_evicts_and_never_grows():
    tier = HostTier(4)
    slots = [tier.put(h) for h in range(10)]
    assert slots[:4] == [0, 1, 2, 3] and tier.n_held == 4 and tier.stats.evicted == 6
    assert all(s is not None and 0 <= s < 4 for s in slots)
    assert [tier.find(h) for h in range(6)] == [None] * 6  # the least recently used went first
    held = tier.find(6)
    tier.take(held)  # a load handed out to a request: its slot is not given away until it is sent
    for h in range(11, 20):
        assert tier.put(h) != held
    assert tier.find(6) == held and tier.n_held == 4
    tier.release(held)
    assert tier.put(6) is None  # already there: no second save
    # The stage side: its slots are allocated once and never more
    pool = KVPool(0, 2, 8, 2, 32, types=KVTypes.same("q8_0"), host_blocks=3)
    size = pool.host.nbytes()
    assert size == 3 * pool.block_bytes()
    pool.host.save([(0, 0), (1, 1), (2, 2)])
    pool.host.save([(3, 0), (4, 1)])
    assert pool.host.nbytes() == size


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from moeray.stages.runtime.model import load_model

    path = write_synthetic_gguf(tmp_path_factory.mktemp("tier") / "dense.gguf", tiny_config("llama", n_experts=0),
                                seed=5)
    return load_model(str(path))


def _conversation(model, host_blocks: int, n_blocks: int = 12):
    """A 100-token prompt and its answer, three other prompts that push its blocks out of a pool
    of 12 blocks, then the conversation's next turn: (first answer, second turn's request, engine)."""
    config = EngineConfig(max_seqs=4, max_len=256, micro_batches=1, token_budget=64, prefill_chunk=16,
                          kv_blocks=n_blocks)
    eng = Engine(LocalPipeline.from_model(model, n_blocks, max_seqs=4, host_blocks=host_blocks), config)
    rng = random.Random(0)
    turn = [rng.randrange(1, 160) for _ in range(100)]
    others = [[rng.randrange(1, 160) for _ in range(100)] for _ in range(3)]
    p = SamplingParams(max_tokens=8, ignore_eos=True)
    first = eng.generate([turn], p)[0]
    for o in others:
        eng.generate([o], p)
    second = eng.generate([turn + first.output + [5, 6, 7]], p)[0]
    return first, second, eng


def test_a_returning_conversation_is_loaded_back_not_prefilled(tiny_model):
    first, again, plain = _conversation(tiny_model, 0)
    assert again.cached_tokens == 0  # no tier: its blocks were given to the other prompts
    _, back, eng = _conversation(tiny_model, 32)
    assert back.output == again.output  # the loaded blocks hold what a re-prefill computes
    # every token of turn 1 whose KV was written (100 prompt + 8 answered - the last answer token):
    # its six full blocks and its last block's 11 tokens (a tail), copied back; only the 4 new ones computed
    written = 100 + 8 - 1
    assert back.cached_tokens == written == 6 * BLOCK_SIZE + 11
    assert eng.stats.prefill_tokens == plain.stats.prefill_tokens - written
    host, stage = eng.scheduler.blocks.host, eng.pipeline.stage.kv.host
    assert host.stats.hits == 7 and stage.stats.loaded == 7 and stage.stats.saved == host.stats.saved > 7
    assert host.stats.hit_tokens == written
    assert stage.stats.loaded_bytes == 7 * stage.block_bytes()


def test_a_tier_larger_than_the_node_is_one_line():
    with pytest.raises(MoerayError) as exc:
        host_tier_room("64GiB", 20 << 30, 1 << 30, "node 10.0.0.2")
    line = str(exc.value)
    assert "\n" not in line and line.startswith("--kv-host 64GiB: node 10.0.0.2 has 19.00 GiB available")
    assert "give at most that, a share such as 0.25, or auto" in line
    assert host_tier_room("0.25", 20 << 30, 4 << 30) == 4 << 30 and host_tier_room("off", 20 << 30, 0) == 0
    assert host_tier_room("auto", 20 << 30, 4 << 30) == 2 << 30
    with pytest.raises(MoerayError, match="--kv-host 'lots': give auto, off, a share"):
        LaunchOptions(kv_host="lots")
    with pytest.raises(MoerayError, match="a share is between 0 and 1"):
        LaunchOptions(kv_host="1.5")


def test_the_ledger_saves_a_named_block_before_it_is_written_again():
    bm = BlockManager(4, host_blocks=8)
    prompt = list(range(1, 3 * BLOCK_SIZE + 2))
    a = bm.allocate(4)
    bm.register(a, prompt, 3, pending=True)
    assert bm.allocate(1) is None  # nothing free: nothing evicted, nothing saved
    bm.written(a, 0, 3)
    bm.release(a)  # three named blocks cached, one free
    got = bm.allocate(3)  # one free, then the two least recently used named blocks (the tail first)
    saves = bm.take_saves()
    assert [b for b, _ in saves] == [a[2], a[1]] and bm.take_saves() == []
    shared, _ = bm.match_prefix(prompt)
    assert shared == a[:1]
    assert bm.match_host(prompt, 1) == [s for _, s in reversed(saves)]  # blocks 1 and 2 of the prompt, in order
    assert got is not None


def test_a_hybrid_conversation_resumes_from_host_blocks_and_its_checkpoint(tmp_path):
    """A hybrid model's second turn, its KV blocks pushed to the host tier by other traffic: the
    blocks come back from host memory and its state from its checkpoint at the answer's last block
    boundary (checkpoints and blocks share the host tier's room), with the tokens and
    log-probabilities of an engine that prefills the whole turn (exact backend, 1e-4)."""
    from moeray.stages.gguf.writer import write_gguf
    from moeray.stages.runtime.model import StageModel
    from test_state_checkpoints import MAX_SEQS, _same, _tokens, _turn
    from tiny_hybrid import tiny_qwen3next

    model = StageModel.from_gguf(str(write_gguf(tiny_qwen3next(max_pos=4096), tmp_path / "f32.gguf", "F32")),
                                 backend="exact")

    def engine(host_blocks: int, checkpoints: int = 16, kv_blocks: int = 16):
        cfg = EngineConfig(max_seqs=MAX_SEQS, max_len=256, micro_batches=1, token_budget=64, prefill_chunk=24,
                           kv_blocks=kv_blocks, state_checkpoints=checkpoints)
        return Engine(LocalPipeline.from_model(model, kv_blocks, MAX_SEQS, state_checkpoints=checkpoints,
                                               host_blocks=host_blocks), cfg)

    eng, ref = engine(32), engine(0, checkpoints=0)
    a = _tokens(40, 5)
    first = _turn(eng, a, 20)
    for i in range(4):  # 60-token prompts, one after another: the 16-block pool gives turn 1's blocks away
        _turn(eng, _tokens(60, 40 + i), 4)
    second = a + first.output + _tokens(10, 6)
    assert eng.scheduler.blocks.match_prefix(second)[0] == []
    got = _turn(eng, second, 8)
    assert got.cached_tokens == 48 and eng.scheduler.blocks.host.stats.hits == 3
    assert eng.scheduler.checkpoints.stats.restored == 1
    _same(got, _turn(ref, second, 8), "second turn from the host tier")


def test_a_tail_goes_to_the_host_tier_and_comes_back_for_its_prefix_only():
    bm = BlockManager(3, host_blocks=4)
    tokens = list(range(1, BLOCK_SIZE + 12))  # one full block and 11 tokens of the next
    a = bm.allocate(2)
    bm.register_written(a, tokens, len(tokens))  # block a[0] named, a[1] a tail of 11 tokens
    bm.release(a)
    bm.allocate(3)  # the free one, then both cached: the tail first, then the named block
    assert [b for b, _ in bm.take_saves()] == [a[1], a[0]]
    again = tokens + [99, 98]
    (slot,) = bm.match_host(again, 0)
    tail, n = bm.match_host_tail(again, 1)
    assert tail is not None and tail != slot and n == 11
    assert bm.match_host_tail(tokens[:BLOCK_SIZE + 5] + [7, 7], 1)[1] == 5  # as far as its tokens agree
    assert bm.match_host_tail(tokens, 1)[1] == 10  # the prompt's last token is left to compute
    other = [500] + tokens[1:]  # the same tail tokens after another prefix: not it
    assert bm.match_host_tail(other, 1) == (None, 0)
