"""The block-allocated KV cache: the engine's ledger tracks the tokens in use (no max_seqs x max_len
reservation), prefix reuse skips the prefill of a shared prompt prefix, and sequences that run out
of blocks mid-decode are preempted and finish anyway: 32 requests with long outputs on a small
KV budget complete with 0 errors and the tokens of a plain greedy loop. A tiny random model
(3 layers, written as a GGUF) keeps it fast: dense, because a random router flips experts on
the last-bit differences between a re-prefill and a decode, which the upcycled default model's
router cannot (its experts are copies); the 6,000-token parity on the default model is
tests/e2e/test_long_context.py."""
from __future__ import annotations

import random

import pytest
import torch

from moeray.cluster.config import EngineConfig
from moeray.cluster.engine import Engine
from moeray.cluster.local_pipeline import LocalPipeline
from moeray.cluster.scheduler import RequestStatus
from moeray.cluster.kv_blocks import BlockManager
from moeray.errors import MoerayError
from moeray.stages.blocks.kv_cache import BLOCK_SIZE, blocks_for, kv_block_bytes
from moeray.stages.text.sampling import SamplingParams
from test_gguf_file import tiny_config, write_synthetic_gguf


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from moeray.stages.runtime.model import load_model

    path = write_synthetic_gguf(tmp_path_factory.mktemp("kv") / "dense.gguf", tiny_config("llama", n_experts=0), seed=5)
    return load_model(str(path))


def _engine(model, n_blocks: int, **cfg) -> Engine:
    config = EngineConfig(**{"max_seqs": 16, "max_len": model.config.context_length, "micro_batches": 2,
                             "token_budget": 64, "prefill_chunk": 16, "kv_blocks": n_blocks, **cfg})
    return Engine(LocalPipeline.from_model(model, n_blocks), config)


def _prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 160) for _ in range(length + i % 7)] for i in range(n)]


def _held(eng: Engine) -> int:
    """Blocks the running sequences hold, each counted once (shared prefix blocks are one block)."""
    return len({b for r in eng.running for b in r.table})


def test_the_ledger_tracks_tokens_in_use_not_max_seqs_times_max_len(tiny_model):
    cfg = tiny_model.config
    eng = _engine(tiny_model, 40, prefix_reuse=False)
    pool = eng.pipeline.stage.kv
    # The pool is the budget: 40 blocks, whatever max_seqs (16) x max_len (256) would have reserved.
    assert pool.nbytes() == 40 * kv_block_bytes(cfg, cfg.n_layers) < 16 * 256 * kv_block_bytes(cfg, cfg.n_layers) // 16
    bm = eng.scheduler.blocks
    assert (bm.n_used, bm.n_available) == (0, 40)
    reqs = [eng.add(p, SamplingParams(max_tokens=12, ignore_eos=True)) for p in _prompts(6, 20)]
    peak = 0
    while not all(r.done for r in reqs):
        eng.step()
        # Every block in use belongs to a running sequence, and each holds what its tokens need:
        # at most one partly filled block per sequence beyond its tokens in KV (+1: the next token).
        assert bm.n_used == _held(eng)
        for r in eng.running:
            assert blocks_for(r.kv_len) <= len(r.table) <= blocks_for(r.kv_len + 1) + 1
        peak = max(peak, bm.n_used)
    assert 0 < peak <= 40
    # All done: every block is back, nothing held.
    assert (bm.n_used, bm.n_available, len(bm.free)) == (0, 40, 40)


def test_prefix_reuse_shares_full_blocks_and_evicts_least_recently_used():
    bm = BlockManager(8)
    prompt = list(range(1, 3 * BLOCK_SIZE + 5))  # 3 full blocks + 4 tokens
    assert bm.match_prefix(prompt) == ([], False)
    a = bm.allocate(4)
    bm.register(a, prompt, 3, pending=True)
    # Named at admission, but nothing is written yet: a second request waits instead of computing it twice.
    assert bm.match_prefix(prompt) == ([], True)
    bm.written(a, 0, 3)
    shared, wait = bm.match_prefix(prompt)
    assert shared == a[:3] and not wait
    # At least one token is always left to compute: a prompt of exactly 3 blocks reuses 2.
    assert bm.match_prefix(prompt[:3 * BLOCK_SIZE])[0] == a[:2]
    bm.take_shared(shared)
    assert [bm.ref[b] for b in a] == [2, 2, 2, 1]
    bm.release(a)
    bm.release(shared)
    assert bm.n_used == 0 and bm.n_cached == 3 and len(bm.free) == 5  # the partial block is plain free
    # Cached blocks are handed out when the free list is empty, least recently used first: the
    # prefix's tail goes before its head.
    got = bm.allocate(6)
    assert got is not None and a[2] in got and a[0] not in got
    assert bm.match_prefix(prompt)[0] == a[:2]
    assert bm.allocate(3) is None and bm.n_available == 2  # nothing taken when it cannot all be given
    # A block named but never written (its request aborted mid-prompt) is forgotten on release.
    bm.forget_all()
    b = bm.allocate(4)
    bm.register(b, prompt, 3, pending=True)
    bm.release(b)
    assert bm.match_prefix(prompt) == ([], False) and bm.n_cached == 0


def test_a_shared_prefix_is_computed_once_and_the_logits_do_not_change(tiny_model):
    system = list(range(1, 5 * BLOCK_SIZE + 3))  # a "system prompt" of 5 full blocks and a bit
    prompts = [system + [100 + i, 101 + i, 102 + i] for i in range(8)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    runs = {}
    for reuse in (False, True):
        eng = _engine(tiny_model, 64, prefix_reuse=reuse)
        reqs = eng.generate(prompts, params)
        runs[reuse] = ([r.output for r in reqs], [r.cached_tokens for r in reqs], eng.stats.prefill_tokens,
                       eng.scheduler.blocks.hit_rate)
    (out_off, cached_off, prefill_off, _), (out_on, cached_on, prefill_on, hit_rate) = runs[False], runs[True]
    assert out_on == out_off  # the reused KV is the KV the sequence would have computed
    assert cached_off == [0] * 8
    # The first request computes the prefix; the others wait for it and reuse its 5 blocks.
    assert cached_on == [0] + [5 * BLOCK_SIZE] * 7
    assert prefill_on == prefill_off - 7 * 5 * BLOCK_SIZE
    assert hit_rate == pytest.approx(7 * 5 * BLOCK_SIZE / sum(map(len, prompts)))


def _greedy(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Tokens of a plain greedy loop (one sequence, contiguous cache), and each step's top-2 logit gap."""
    kv, feed, out, gaps = model.new_kv_cache(1, len(prompt) + n), prompt, [], []
    for _ in range(n):
        logits = model.step([feed], [0], kv)[0]
        top = torch.topk(logits, 2).values
        out.append(int(logits.argmax()))
        gaps.append(float(top[0] - top[1]))
        feed = [out[-1]]
    return out, gaps


def test_32_requests_on_a_small_kv_budget_are_preempted_and_all_finish(tiny_model):
    prompts = _prompts(32, 12, seed=3)
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    # 12 blocks (192 tokens) for 32 sequences that each grow to ~64: most must give way mid-decode.
    small = _engine(tiny_model, 12)
    reqs = small.generate(prompts, params, timeout_s=600)
    assert [r.status for r in reqs] == [RequestStatus.FINISHED] * 32 and all(r.error is None for r in reqs)
    assert [r.finish_reason for r in reqs] == ["length"] * 32
    assert small.stats.preemptions > 0 and small.scheduler.blocks.stats.preemptions == small.stats.preemptions
    assert small.scheduler.blocks.n_used == 0
    # Re-prefilled after a preemption, a sequence goes on where it was: the greedy loop's tokens,
    # up to a near-tie (a re-prefill's attention runs another kernel than a decode's: last bits).
    for r, prompt in zip(reqs, prompts):
        want, gaps = _greedy(tiny_model, prompt, 48)
        j = next((j for j, (a, b) in enumerate(zip(r.output, want)) if a != b), None)
        assert j is None or gaps[j] < 1e-4, (r.id, r.preemptions, j, gaps[j] if j is not None else None)


def test_a_prompt_longer_than_the_kv_pool_is_refused_clearly(tiny_model):
    eng = _engine(tiny_model, 2)  # 32 tokens of KV
    with pytest.raises(MoerayError, match="KV cache of 32 tokens .*--kv-blocks"):
        eng.add(list(range(1, 40)))
    r = eng.add(list(range(1, 20)), SamplingParams(max_tokens=100, ignore_eos=True))
    assert r.max_new == 32 - 19  # capped by what one sequence can hold


def test_a_prompt_that_goes_on_into_a_written_block_copies_its_rows_and_computes_the_rest(tiny_model):
    """A repeated question, a conversation's next turn and a prompt that leaves a shared prefix in
    the middle of a block: each reuses every token another sequence wrote (copied into a block of
    its own), computes only what is new (one token at least), and gets the tokens it gets without
    any reuse."""
    system = list(range(1, 2 * BLOCK_SIZE + 7))  # 2 full blocks and 6 tokens into the third
    question = system + [120, 121, 122]
    params = SamplingParams(max_tokens=9, ignore_eos=True)
    first_answer = _engine(tiny_model, 64, prefix_reuse=False).generate([question], params)[0].output
    turn2 = question + first_answer + [130, 131]
    other = system + [140, 141]  # leaves the first question's block after 6 tokens
    asked = [question, question, turn2, other]

    plain = _engine(tiny_model, 64, prefix_reuse=False)
    want = [plain.generate([p], params)[0].output for p in asked]
    eng = _engine(tiny_model, 64)
    got, cached, computed = [], [], []
    for p in asked:  # one after the other, as one client sends them
        before = eng.stats.prefill_tokens
        r = eng.generate([p], params)[0]
        got.append(r.output)
        cached.append(r.cached_tokens)
        computed.append(eng.stats.prefill_tokens - before)
    assert got == want  # the copied rows are the KV the sequence would have computed
    # The same question again: all of it but its last token (whose logits give the answer's first).
    assert cached[1] == len(question) - 1 and computed[1] == 1
    # The next turn: the question and the answer so far (its last token was sampled, never fed).
    assert cached[2] == len(question) + len(first_answer) - 1 and computed[2] == len(turn2) - cached[2]
    assert cached[3] == len(system) and computed[3] == 2
    assert eng.scheduler.blocks.n_used == 0  # the sources held for the copies went back


def test_tails_are_found_by_the_prefix_they_follow_and_the_copy_source_is_held_until_handed_out():
    bm = BlockManager(6)
    prompt = list(range(1, BLOCK_SIZE + 10))  # 1 full block and 9 tokens
    a = bm.allocate(2)
    bm.register_written(a, prompt, len(prompt))
    bm.release(a)
    assert bm.n_cached == 2 and bm.n_available == 6  # the full block and the tail, both cached
    assert bm.match_prefix(prompt) == ([a[0]], False)
    # A prompt with the same 1 + 9 tokens and more: the tail's 9 rows; the same prompt: 8 (one is left).
    assert bm.match_tail(prompt + [99], 1) == (a[1], 9)
    assert bm.match_tail(prompt, 1) == (a[1], 8)
    assert bm.match_tail(prompt[:BLOCK_SIZE] + [7, 7], 1) == (None, 0)  # nothing begins with these
    bm.take_shared([a[1]])  # held as a copy source: not handed out again
    assert bm.allocate(6) is None and bm.n_available == 5
    bm.release([a[1]])
    got = bm.allocate(6)  # evicted at last: found no more
    assert got is not None and bm.match_tail(prompt + [99], 1) == (None, 0) and not bm.follows


def _consecutive(table: list[int]) -> bool:
    return all(b == table[0] + i for i, b in enumerate(table))


def _one_after_another(eng: Engine, asked: list[list[int]], params) -> tuple[list, list, list]:
    """Each prompt run to its end before the next is sent, as one client sends them: its tokens,
    its cached prompt tokens, and whether every step read its KV from one consecutive run."""
    got, cached, joined = [], [], []
    for p in asked:
        req = eng.add(p, params)
        runs = set()
        while not req.done:
            eng.step()
            if req.table:
                runs.add(_consecutive(req.table))
        got.append(req.output)
        cached.append(req.cached_tokens)
        joined.append(runs == {True})
    return got, cached, joined


def test_a_conversations_turns_keep_their_kv_in_one_run_and_their_tokens(tiny_model):
    """Attention reads a sequence's keys in place only where its blocks follow one another (any
    other table is gathered, every layer, every step). A short probe that shares the prompt's
    start, then a conversation's turn 1 and turn 2 (its prompt, answer and more), then a prompt
    that leaves turn 2's text mid-way: every one decodes from one consecutive run of blocks,
    reuses what was written, and gets the tokens it gets without any reuse."""
    prompt = [(7 * i) % 150 + 1 for i in range(6 * BLOCK_SIZE + 5)]
    params = SamplingParams(max_tokens=2 * BLOCK_SIZE + 3, ignore_eos=True)
    probe = prompt[:2 * BLOCK_SIZE]
    turn1 = prompt
    first_answer = _engine(tiny_model, 64, prefix_reuse=False).generate([turn1], params)[0].output
    turn2 = turn1 + first_answer + [131, 132, 133]
    branch = turn2[:4 * BLOCK_SIZE + 2] + [141, 142]
    asked = [probe, turn1, turn2, branch]
    plain = _engine(tiny_model, 64, prefix_reuse=False)
    want = [plain.generate([p], params)[0].output for p in asked]

    eng = _engine(tiny_model, 64, max_seqs=1, micro_batches=1)
    got, cached, joined = _one_after_another(eng, asked, params)
    assert got == want
    assert joined == [True] * 4
    assert cached[1] == len(probe) and cached[2] == len(turn1) + len(first_answer) - 1
    assert cached[3] == len(branch) - 2  # up to where it leaves turn 2
    assert eng.scheduler.blocks.n_used == 0  # every source held for a copy went back


def test_questions_sent_in_turn_keep_each_others_blocks(tiny_model):
    """One client cycling through questions that share a chat template's start, which ends inside
    a block (bench/load.py's traffic): a question sent again finds all of itself, though another
    question took the rows after the shared start in between (that block is named: copied from,
    never written over), decodes from one consecutive run, and gets the tokens it gets without
    any reuse."""
    template = [(5 * i) % 150 + 1 for i in range(BLOCK_SIZE + 8)]  # ends 8 tokens into block 2
    questions = [template + [(11 * q + 3 * i) % 150 + 1 for i in range(BLOCK_SIZE - 4)] for q in range(3)]
    params = SamplingParams(max_tokens=BLOCK_SIZE + 3, ignore_eos=True)
    asked = questions + questions
    plain = _engine(tiny_model, 64, prefix_reuse=False)
    want = [plain.generate([p], params)[0].output for p in asked]

    eng = _engine(tiny_model, 64, max_seqs=1, micro_batches=1)
    got, cached, joined = _one_after_another(eng, asked, params)
    assert got == want
    assert joined == [True] * len(asked)
    assert cached[1:3] == [len(template)] * 2  # the shared start, up to where the questions part
    assert cached[3:] == [len(q) - 1 for q in questions]  # asked again: all of it but the last token
    assert eng.scheduler.blocks.n_used == 0


def test_blocks_are_handed_out_consecutively_and_a_moved_prefix_takes_its_names_along():
    bm = BlockManager(12)
    a = bm.allocate(3)
    assert a == [0, 1, 2]
    b = bm.allocate(2)
    assert b == [3, 4]
    assert bm.allocate(1, after=a[-1]) == [5]  # 3 is taken: the lowest free one
    bm.release(b)
    assert bm.allocate(1, after=2) == [3]  # the one after the sequence's last, now free
    assert bm.free_run(3, room=4) == [6, 7, 8]  # 4, 6-11 free: the first stretch with room
    assert bm.free_run(7, room=7) is None
    # A written prefix of 2 blocks, moved into a stretch: its names go along, pending until copied.
    prompt = list(range(1, 2 * BLOCK_SIZE + 1))
    bm.register_written([0, 1], prompt, len(prompt))
    run = bm.free_run(2, room=2)
    bm.take(run)
    assert bm.rename([(0, run[0], BLOCK_SIZE), (1, run[1], BLOCK_SIZE)]) == 2
    assert bm.match_prefix(prompt + [9]) == ([], True)  # there, but wait for its copy
    bm.written(run, 0, 2)
    assert bm.match_prefix(prompt + [9]) == (run, False)
    bm.release([0, 1])  # the old blocks, unnamed now: free, not cached
    assert {0, 1} <= bm.free and bm.n_cached == 0


def test_a_tail_block_taken_in_place_frees_what_followed_it():
    bm = BlockManager(8)
    prompt = list(range(1, 3 * BLOCK_SIZE + 4))  # 3 full blocks and 3 tokens
    t = bm.allocate(4)
    bm.register_written(t, prompt, len(prompt))
    bm.release(t)
    assert bm.n_cached == 4
    shared, _ = bm.match_prefix(prompt[:BLOCK_SIZE + 5] + [99])
    assert shared == [t[0]]
    src, n = bm.match_tail(prompt[:BLOCK_SIZE + 5] + [99], 1)
    assert (src, n) == (t[1], 5)
    bm.take_shared(shared)
    assert bm.steal(src)  # its 5 rows stay where they are; the blocks after it cannot be found any more
    assert bm.ref[t[1]] == 1 and {t[2], t[3]} <= bm.free and bm.n_cached == 0
    assert bm.allocate(2, after=t[1]) == [t[2], t[3]]
    assert not bm.steal(t[0])  # held by a sequence: not taken
