"""Multi-turn chat on a hybrid model: checkpoints of the recurrent state at block boundaries
(cluster/state_checkpoints.py) let a conversation's next turn prefill only what is new.

The tiny random Qwen3-Next of tests/tiny_hybrid.py: exact backend (F32) for the logits, to 1e-4 of the
largest; the ggml backend's stage graphs (Q8_0) within its own bound. A second turn resumed from a
checkpoint gives the logits and greedy tokens of a full re-prefill; a prompt that differs from the
conversation before a checkpoint's boundary never resumes from it; preempted sequences keep their
greedy tokens; the checkpoint slots never collide with the sequences' slots."""
from __future__ import annotations

import random

import pytest
import torch

from moeray.cluster.config import EngineConfig
from moeray.cluster.engine import Engine
from moeray.cluster.local_pipeline import LocalPipeline
from moeray.cluster.state_checkpoints import CheckpointLedger
from moeray.stages.blocks.kv_cache import BLOCK_SIZE
from moeray.stages.gguf.writer import write_gguf
from moeray.stages.kernels.backend import ggml_available
from moeray.stages.runtime.model import StageModel
from moeray.stages.text.sampling import SamplingParams
from tiny_hybrid import tiny_qwen3next

MAX_SEQS, CHECKPOINTS = 4, 8
RTOL = 1e-4  # of the largest |logit|, exact backend


@pytest.fixture(scope="module")
def hf():
    return tiny_qwen3next(max_pos=4096)


@pytest.fixture(scope="module")
def exact(hf, tmp_path_factory):
    return StageModel.from_gguf(str(write_gguf(hf, tmp_path_factory.mktemp("ck") / "f32.gguf", "F32")), backend="exact")


def _tokens(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(1, 290) for _ in range(n)]


def _engine(model, checkpoints=CHECKPOINTS, kv_blocks=200, host=0, **kw):
    """`checkpoints` slots on the device, then `host` in host memory (the ledger holds them all)."""
    cfg = EngineConfig(**{"max_seqs": MAX_SEQS, "max_len": 1024, "micro_batches": 1, "token_budget": 64,
                          "prefill_chunk": 24, "kv_blocks": kv_blocks, "state_checkpoints": checkpoints + host, **kw})
    return Engine(LocalPipeline.from_model(model, kv_blocks, MAX_SEQS, state_checkpoints=checkpoints,
                                           host_checkpoints=host), cfg)


def _turn(eng, prompt, n):
    req = eng.add(prompt, SamplingParams(max_tokens=n, ignore_eos=True, logprobs=5))
    eng.run([req])
    return req


def _second_turn(model, prompt, answer, new, out):
    """Turn 1: a prompt of `prompt` = (length, seed) random tokens and `answer` tokens of answer;
    turn 2: that prompt + the answer + `new` = (length, seed) more, `out` tokens asked. Returns
    turn 2 as run with checkpoints after turn 1 and as an engine without any prefills it whole."""
    eng, ref = _engine(model), _engine(model, checkpoints=0)
    a = _tokens(*prompt)
    second = a + _turn(eng, a, answer).output + _tokens(*new)
    return _turn(eng, second, out), _turn(ref, second, out)


def _same(got, ref, what, rtol=RTOL):
    """Two requests: the same greedy tokens, each step's log-probabilities (the sampled token's and
    the top 5) within rtol of the largest |logprob|."""
    assert got.output == ref.output, what
    a = torch.tensor([[lp.logprob] + [p for _, p in lp.top] for lp in got.logprobs])
    b = torch.tensor([[lp.logprob] + [p for _, p in lp.top] for lp in ref.logprobs])
    assert [[t for t, _ in lp.top] for lp in got.logprobs] == [[t for t, _ in lp.top] for lp in ref.logprobs]
    assert (a - b).abs().max() <= rtol * b.abs().max(), f"{what}: {(a - b).abs().max():.3g}"


def test_restored_checkpoint_gives_the_logits_of_a_full_prefill(exact):
    """The primitive under the engine: a prefix's state copied into a checkpoint slot after the
    step that ends at its block boundary, the sequence's own slot then moving on; later a new
    sequence shares the prefix's KV blocks, gets the checkpoint copied into its slot before its
    first step and prefills only the rest: every position's logits are the full prefill's."""
    m = exact
    prefix, rest = _tokens(48, 1), _tokens(30, 2)
    kv = m.new_kv_pool(40, 3)  # sequence slots 0 and 1, checkpoint slot 2
    t0, t1 = list(range(0, 8)), list(range(0, 3)) + list(range(20, 25))
    with torch.inference_mode():
        meta = m.table_meta([48], [0], [t0], kv, [0], state_after=[(0, 2)])
        m.run_layers(m.embed([prefix]), meta, kv)
        more = _tokens(20, 3)  # the first sequence goes on: its slot's state moves past the boundary
        m.run_layers(m.embed([more]), m.table_meta([20], [48], [t0], kv, [0]), kv)
        meta = m.table_meta([30], [48], [t1], kv, [1], state_before=[(2, 1)])
        got = m.head(m.run_layers(m.embed([rest]), meta, kv))
        ref = m.logits_all(prefix + rest)[48:]
        # without the restore the same step starts from slot 1's zeros: far off
        kv.state.clear([1])
        wrong = m.head(m.run_layers(m.embed([rest]), m.table_meta([30], [48], [t1], kv, [1]), kv))
    scale = ref.abs().max()
    assert (got - ref).abs().max() <= RTOL * scale
    assert (wrong - ref).abs().max() > 0.1 * scale


def test_second_turn_resumes_from_the_answers_last_block(exact):
    """Turn 1: a 40-token prompt, 20 tokens of answer (the state checkpointed at each block
    boundary the answer crosses, the last at 48). Turn 2 = turn 1's prompt + answer + 10 new
    tokens: it resumes at 48 (KV blocks and state), prefills 22 tokens, and gives the tokens and
    log-probabilities of an engine that prefills all 70."""
    eng, ref = _engine(exact), _engine(exact, checkpoints=0)
    assert eng.scheduler.blocks.prefix_reuse and not ref.scheduler.blocks.prefix_reuse
    a = _tokens(40, 5)
    first = _turn(eng, a, 20)
    assert first.cached_tokens == 0
    second = a + first.output + _tokens(10, 6)
    got = _turn(eng, second, 8)
    assert got.cached_tokens == 48
    assert eng.scheduler.checkpoints.stats.restored == 1
    assert eng.stats.prefill_tokens == 40 + len(second) - 48
    _same(got, _turn(ref, second, 8), "second turn")
    # the same second turn again (a regenerated answer): from its own prompt's last block
    again = _turn(eng, second, 8)
    assert again.cached_tokens == (len(second) - 1) // BLOCK_SIZE * BLOCK_SIZE == 64
    _same(again, got, "regenerated")


def test_checkpoints_in_host_memory_resume_a_second_turn_as_the_devices_do(exact):
    """Two checkpoint slots on the device and six in host memory (serve --local gives a hybrid
    model's checkpoints host memory where its device has no room): four conversations (two
    checkpoints each: the prompt's last block, the answer's) all kept, and each one's second turn
    resumes at its answer's last block with a full re-prefill's tokens and log-probabilities, the
    first from the device, the others from the host; a step never runs a host slot as a sequence's."""
    eng, ref = _engine(exact, checkpoints=2, host=6), _engine(exact, checkpoints=0)
    state = eng.pipeline.stage.kv.state
    assert (state.n_slots, state.host_slots) == (MAX_SEQS + 2, 6)
    with pytest.raises(ValueError, match="outside the pool"):
        state.check_slots([state.n_slots])  # the first host slot
    firsts = [(a, _turn(eng, a, 20)) for a in (_tokens(40, 20 + i) for i in range(4))]
    assert eng.scheduler.checkpoints.stats.evicted == 0
    for i, (a, first) in enumerate(firsts):
        second = a + first.output + _tokens(10, 30 + i)
        got = _turn(eng, second, 6)
        assert got.cached_tokens == 48, i
        _same(got, _turn(ref, second, 6), f"second turn {i}")
    assert eng.scheduler.checkpoints.stats.restored == 4


def test_a_prompt_ending_on_a_block_boundary_is_checkpointed_there(exact):
    """Turn 1: a 48-token prompt (three whole blocks) and an answer shorter than a block (its 10
    tokens never reach the boundary at 64). Turn 2 = that prompt + answer + 6 new tokens resumes at
    48, the prompt's own end, not at 32 (its last block before its final token), and gives the
    tokens and log-probabilities of an engine that prefills it all."""
    got, want = _second_turn(exact, (48, 11), 10, (6, 12), 6)
    assert got.cached_tokens == 48
    _same(got, want, "second turn after a whole-block prompt")


def test_a_checkpoint_is_never_used_past_a_difference(exact):
    """A turn that rewrites the previous answer at position 45 cannot resume at 48 (the state
    there saw the old token): it resumes at the prompt's own checkpoint, 32, and its tokens are a
    full prefill's; one that differs at position 10 resumes nowhere."""
    eng, ref = _engine(exact), _engine(exact, checkpoints=0)
    a = _tokens(40, 7)
    first = _turn(eng, a, 20)
    answer = list(first.output)
    answer[5] = answer[5] % 280 + 3  # position 45
    edited = a + answer + _tokens(6, 8)
    got = _turn(eng, edited, 6)
    assert got.cached_tokens == 32
    _same(got, _turn(ref, edited, 6), "edited answer")
    early = a[:10] + [a[10] % 280 + 3] + a[11:] + first.output
    got = _turn(eng, early, 6)
    assert got.cached_tokens == 0
    _same(got, _turn(ref, early, 6), "edited prompt")


def test_cached_blocks_without_a_checkpoint_are_prefilled_again(exact):
    """A prompt that shares two cached KV blocks (32 tokens) with an earlier one, whose state was
    checkpointed only at 48, cannot resume at 32: attention's past is there, the DeltaNet layers'
    is not. It resumes at 0, and its tokens are a full prefill's (resuming at 32 from a zero state
    gives other tokens)."""
    eng, ref = _engine(exact), _engine(exact, checkpoints=0)
    a = _tokens(56, 11)
    _turn(eng, a, 4)
    other = a[:40] + _tokens(12, 12)
    got = _turn(eng, other, 12)
    assert got.cached_tokens == 0
    _same(got, _turn(ref, other, 12), "shared blocks, no checkpoint")


def _check_slots(eng):
    """Sequence slots below the checkpoint slots, every held checkpoint slot its own."""
    led = eng.scheduler.checkpoints
    seq = [r.slot for r in eng.scheduler.running]
    ck = [s for r in eng.scheduler.running for s in (r.rolling, r.restore) if s is not None]
    assert all(0 <= s < led.base for s in seq)
    assert all(led.base <= s < led.base + led.n for s in ck + list(led.hash_of))
    rolling = [r.rolling for r in eng.scheduler.running if r.rolling is not None]
    assert len(rolling) == len(set(rolling))
    assert len(led.slot_of) == len(led.hash_of)


def test_preempted_sequences_keep_their_tokens_and_the_slots_apart(exact):
    """12 blocks for four sequences of 54-72 tokens: decodes preempt the youngest, whose state
    checkpoints (and blocks) go back to the caches, evicted as the others grow; it comes back with
    the same greedy tokens, every checkpoint slot apart from the sequences' slots after each step."""
    eng, ref = _engine(exact, kv_blocks=12), _engine(exact, checkpoints=0)
    prompts = [_tokens(30 + 6 * i, 10 + i) for i in range(4)]
    reqs = [eng.add(p, SamplingParams(max_tokens=24, ignore_eos=True)) for p in prompts]
    while not all(r.done for r in reqs):
        eng.step()
        _check_slots(eng)
    assert eng.scheduler.stats.preemptions > 0 and eng.scheduler.checkpoints.stats.saved > 0
    want = ref.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    assert [r.output for r in reqs] == [r.output for r in want]


@pytest.mark.skipif(not ggml_available(), reason="ggml-python is not installed")
def test_second_turn_on_the_stage_graphs(hf, tmp_path):
    """The same on the ggml backend, where every step runs as the stage graph reading and writing
    the state slots in place: the restored turn's tokens and log-probabilities are a full
    prefill's within the route's bound (1e-1 of the largest; measured 0: the same bits)."""
    model = StageModel.from_gguf(str(write_gguf(hf, tmp_path / "q8.gguf", "Q8_0")), backend="ggml")
    assert model.trunk is not None
    got, want = _second_turn(model, (40, 9), 20, (10, 10), 8)
    assert got.cached_tokens == 48
    _same(got, want, "second turn, ggml", rtol=1e-1)


def test_ledger_evicts_least_recently_used_and_never_a_held_slot():
    led = CheckpointLedger(3, base=4)
    a = led.save(101)  # a prompt's end: left to the cache
    b = led.save(102)
    own = led.save(103, own=None)
    assert sorted([a, b, own]) == [4, 5, 6] and led.find([100, 101]) == (2, a)
    led.take(a)  # a restore pending: a may not go
    d = led.save(104)  # evicts the least recently used unheld one: b
    assert d == b and led.find([102]) == (0, None) and led.find([101]) == (1, a)
    led.release(a)
    # a rolling slot: held by its sequence, overwritten in place at its next boundary
    r = led.save(105, own=None)
    led.take(r)
    assert led.save(106, own=r) == r and led.find([105]) == (0, None) and led.find([106]) == (1, r)
    led.take(r)  # someone restores from it: the next boundary goes to another slot, r stays
    r2 = led.save(107, own=r)
    assert r2 != r and led.find([106]) == (1, r) and led.ref[r2] == 1
    led.release(r)
    assert led.save(106) is None  # already held (another sequence, same prefix)
    led.forget_all()
    assert led.find([101, 104, 106, 107]) == (0, None) and len(led.free) == 3


def test_ledger_lends_spares_for_verify_rows_free_first_then_the_least_recently_used():
    """Speculation's spare slots (cluster/scheduler.py): a free slot first, else the least recently
    used unheld checkpoint, never one this step checkpoints into (`avoid`: written after the step,
    while the snapshot is taken before it) nor a held one; a spare goes back free, holding no prefix."""
    led = CheckpointLedger(3, base=4)
    spare = led.borrow()
    assert spare == 4 and led.ref[spare] == 1 and led.stats.borrowed == 1
    a, b = led.save(101), led.save(102)  # 5, 6: every slot now named or lent
    assert led.borrow(avoid={a}) == b and led.find([101, 102]) == (1, a)  # b evicted, a kept
    assert led.borrow(avoid={a}) is None  # a is this step's checkpoint, the others are lent
    led.release(spare)
    assert led.free == [spare] and led.find([101]) == (1, a)  # back free, no prefix named
    led.take(a)
    assert led.borrow() == spare and led.borrow() is None  # held slots are never lent
