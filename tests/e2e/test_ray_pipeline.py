"""The default model on four simulated stages as Ray actors on one machine: probe, plan, load,
wire, greedy parity with the one-process model, and a stage killed mid-generation.

One Ray instance and one launched pipeline for the whole module: starting it is the slow part.
"""
from __future__ import annotations

import time

import pytest

ray = pytest.importorskip("ray")

from moeray.cluster.config import EngineConfig, LaunchOptions  # noqa: E402
from moeray.cluster.driver import launch  # noqa: E402
from moeray.stages.blocks.kv_cache import kv_layer_bytes  # noqa: E402
from moeray.cluster.engine import Engine  # noqa: E402
from moeray.cluster.remote import StageFailedError  # noqa: E402
from moeray.cluster.scheduler import RequestStatus  # noqa: E402
from moeray.stages.text.sampling import SamplingParams  # noqa: E402

MiB = 1 << 20
# "12GiB,12GiB,8GiB,8GiB" scaled to the default model (Q8_0 embedding and head ~29 MiB each, Q4_1
# experts ~380 MiB): the caches hold about half of the 240 experts, so each stage chooses what to hold
BUDGETS = [72 * MiB, 72 * MiB, 64 * MiB, 64 * MiB]
MAX_SEQS, MAX_LEN = 4, 64
# Different lengths, so prefill chunks, decodes and padding all mix in one micro-batch.
PROMPTS = [[504, 3575, 282, 4649, 314], [1] + list(range(20, 39)), [1, 9]]  # [0]: 'The capital of France is'
N_NEW = 5


@pytest.fixture(scope="module")
def launched(default_model_path):
    lines = []
    opts = LaunchOptions(4, simulate=BUDGETS, torch_threads=1, timeout_s=180)
    out = launch(str(default_model_path), opts, EngineConfig(max_seqs=MAX_SEQS, max_len=MAX_LEN), log=lines.append)
    yield out
    out.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def reference(default_model_path):
    """Greedy tokens from the whole model in this process, one prompt at a time (no engine)."""
    from greedy import one_process_greedy
    from moeray.stages.runtime.model import load_model

    return one_process_greedy(load_model(str(default_model_path)), PROMPTS, N_NEW, MAX_LEN)


def _engine(launched, **cfg) -> Engine:
    return Engine(launched.pipeline(), EngineConfig(max_seqs=MAX_SEQS, max_len=MAX_LEN, token_budget=12,
                                                    prefill_chunk=8, micro_batches=2, step_timeout_s=60, **cfg))


def test_stages_report_their_own_budgets_and_the_plan_uses_them(launched):
    reports, plan = launched.reports, launched.plan
    assert [r.device.free_bytes for r in reports] == BUDGETS
    assert len({r.pid for r in reports}) == 4
    for r in reports:
        assert r.device.kind == "simulated" and r.layer_ms > 0 and r.miss_ms > 0
        assert r.device.node_id == ray.get_runtime_context().get_node_id()
    # The KV pool: the plan's blocks (at least one MAX_LEN sequence), the same on every stage.
    assert launched.kv.blocks >= MAX_LEN // 16 and launched.engine.kv_blocks == launched.kv.blocks
    # each stage's cache types as the plan chose them (--cache-type-k / -v auto), one line saying so
    kv_layers = [kv_layer_bytes(_config(launched), launched.kv.blocks, t) for t in launched.kv.types]
    assert len(kv_layers) == 4 and any(l.startswith("[kv] cache types") for l in launched.lines)
    assert [tuple(x) for x in plan.split] == launched.ranges
    assert launched.ranges[0][0] == 0 and launched.ranges[-1][1] == 30
    for r, s, kv_layer in zip(reports, plan.stages, kv_layers):
        # The planner saw what the actor reported; the KV cache of the layers it got is charged with its trunk.
        assert s.free_bytes == r.device.free_bytes - r.device.reserve_bytes
        assert s.n_layers * kv_layer < s.trunk_bytes <= s.free_bytes
    assert launched.lines[-1].startswith("loaded stage") or any(l.startswith("loaded stage") for l in launched.lines)
    # Each stage holds what the plan priced: its trunk plus its layers' KV cache, the rest is expert
    # cache, kept by the launch's cache policy.
    for st, s, kv_layer, t in zip(launched.stage_stats(), plan.stages, kv_layers, launched.kv.types):
        placed = st.placed
        kv = next(v for k, v in placed.items() if k.startswith("KV pool"))
        trunk = next(v for k, v in placed.items() if k.startswith("trunk"))
        assert kv == s.n_layers * kv_layer and kv + trunk == s.trunk_bytes
        assert (st.kv["cache_type_k"], st.kv["cache_type_v"]) == (t.k, t.v)
        assert st.cache["budget_bytes"] == s.expert_room
        assert st.cache["policy"] == LaunchOptions.cache_policy
    assert any(l.startswith("layer split auto: K=") for l in launched.lines)


def _config(launched):
    from moeray.stages.gguf.reader import read_gguf_header

    return read_gguf_header(launched.path).config


def test_four_stages_give_the_one_process_greedy_tokens(launched, reference):
    eng = _engine(launched)
    reqs = eng.generate(PROMPTS, SamplingParams(max_tokens=N_NEW, ignore_eos=True), timeout_s=300)
    assert [r.output for r in reqs] == reference
    assert eng.stats.failures == 0


def test_four_stages_verify_drafts_and_give_the_same_greedy_tokens(launched, reference):
    """Speculative decoding across four stages, two micro-batches in flight: verify rows (drafts
    right most of the time, wrong often) run down the pipeline like prompt chunks, the last stage
    keeps what the target agrees with, and the tokens are the one-process greedy ones."""
    from test_speculative import NoisyOracle, check_ledger

    eng = _engine(launched, speculative="auto")
    refs = {tuple(p): r for p, r in zip(PROMPTS, reference)}
    eng.speculation.new_drafter = lambda toks: NoisyOracle(refs, toks, wrong=0.3, vocab=49152)
    eng.speculation.PROBE = 1.0
    reqs = [eng.add(p, SamplingParams(max_tokens=N_NEW, ignore_eos=True)) for p in PROMPTS]
    while not all(r.done for r in reqs):
        eng.step()
        check_ledger(eng)
    assert [r.output for r in reqs] == reference
    s = eng.speculation.stats
    assert s.verify_rows > 0 and 0 < s.accepted_tokens < s.drafted_tokens


def test_each_stage_measures_the_hit_rate_its_plan_predicted(launched):
    # Served-style traffic the recorded profile never saw, through the real stages (default
    # profile fill, adaptive caches): every stage's counted hit rate lands within 10 points of the
    # rate the plan printed for it. Counted as the difference of the stages' counters over this run.
    from moeray.stages.text.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(launched.path)
    prompts = [tok.encode(t) for t in ("Which planets have rings, and why do some not?",
                                       "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists.\"\"\"\n",
                                       "The lighthouse keeper had not seen a ship in eleven days when",
                                       "Give me three tips for keeping a sourdough starter alive.")]
    before = {s.stage: s.cache for s in launched.stage_stats()}
    _engine(launched).generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True), timeout_s=300)
    after = launched.stage_stats()
    for s in after:
        lookups = s.cache["lookups"] - before[s.stage]["lookups"]
        measured = (s.cache["hits"] - before[s.stage]["hits"]) / lookups
        assert lookups > 500 and s.predicted_hit_rate is not None, (launched.lines, s)
        assert abs(measured - s.predicted_hit_rate) <= 0.10, (s.stage, measured, s.predicted_hit_rate)
    # The plan is not trivially "everything fits": some stage must choose what to hold.
    assert min(s.predicted_hit_rate for s in after) < 0.99


def test_each_stage_keeps_its_own_host_tier(launched):
    """A prompt's blocks pushed out of the stages' pools by other traffic are saved by every stage
    into its own host memory (its own process: the engine's ledger only names the slots) and copied
    back by every stage when the prompt returns: the same tokens, none but its last prefilled (its
    three full blocks and the tail the first turn left in a fourth come back from the tier)."""
    host_blocks = launched.kv.host_blocks
    assert host_blocks > 0 and any(l.startswith("[kv] host tier") for l in launched.lines)
    eng = _engine(launched)
    params = SamplingParams(max_tokens=N_NEW, ignore_eos=True)
    prompt = list(range(100, 150))  # three full blocks and two tokens
    first = eng.generate([prompt], params, timeout_s=300)[0]
    before = {s.stage: s.kv["host"] for s in launched.stage_stats()}
    for k in range(2):  # four sequences at a time take every block of the pool
        eng.generate([list(range(200 + 60 * (4 * k + i), 250 + 60 * (4 * k + i))) for i in range(4)], params,
                     timeout_s=300)
    assert eng.scheduler.blocks.match_prefix(prompt)[0] == []  # gone from the pools
    again = eng.generate([prompt], params, timeout_s=300)[0]
    assert again.output == first.output and again.cached_tokens == len(prompt) - 1  # the last one gives logits
    stats = launched.stage_stats()
    assert len({s.pid for s in stats}) == 4
    for s in stats:  # every stage moved its own layers' rows: saved on eviction, loaded on the hit
        host = s.kv["host"]
        assert host["blocks"] == host_blocks and host["loaded_blocks"] - before[s.stage]["loaded_blocks"] == 4
        assert host["saved_blocks"] - before[s.stage]["saved_blocks"] >= 3
    rows = [s.kv["host"]["loaded_bytes"] - before[s.stage]["loaded_bytes"] for s in stats]
    assert len(set(rows)) > 1 or len({s.layers[1] - s.layers[0] for s in stats}) == 1  # each its own layers' bytes


def test_a_lone_stream_chains_its_decode_steps_and_gives_the_same_tokens(launched, reference):
    """One request alone: each decode step is issued before the one it continues came back, its
    token sent from the last stage to the first (cluster/engine.py _may_chain); then a request with
    a logit bias, its params sent once: the bias holds for every token."""
    eng = _engine(launched)
    got = eng.generate([PROMPTS[1]], SamplingParams(max_tokens=12, ignore_eos=True), timeout_s=300)[0]
    assert eng.stats.chained_steps >= 5 and got.output[:N_NEW] == reference[1]
    biased = eng.generate([PROMPTS[0]], SamplingParams(max_tokens=8, ignore_eos=True, logit_bias={42: 100.0}),
                          timeout_s=300)[0]
    assert biased.output == [42] * 8
    assert not eng.in_flight and eng.n_free_slots == MAX_SEQS


def test_killing_a_stage_fails_requests_clearly_and_the_next_one_succeeds(launched, reference):
    eng = _engine(launched)
    doomed = eng.add(PROMPTS[1], SamplingParams(max_tokens=40, ignore_eos=True))
    for _ in range(3):
        eng.step()
    ray.kill(launched.group.actors[2], no_restart=True)
    t = time.monotonic()
    with pytest.raises(StageFailedError, match="stage 2 .* died"):
        eng.run([doomed], timeout_s=120)
    failed_after = time.monotonic() - t
    assert doomed.status is RequestStatus.FAILED and "stage 2" in doomed.error
    # The error came from the dead stage, not from a timeout (the steps' timeout is 60 s); this
    # includes the restart and reload of stage 2, which run before the error is raised.
    assert failed_after < 60
    again = eng.generate([PROMPTS[0]], SamplingParams(max_tokens=N_NEW, ignore_eos=True), timeout_s=300)
    assert again[0].output == reference[0]
    # The restarted stages hold no sequence's params: each brings its own when it is admitted.
    biased = eng.generate([PROMPTS[2]], SamplingParams(max_tokens=4, ignore_eos=True, logit_bias={77: 100.0}),
                          timeout_s=300)[0]
    assert biased.output == [77] * 4


def test_moeray_run_prints_plan_text_speed_and_stages(launched, reference, default_model_path, capsys):
    from moeray.cluster.cli import main
    from moeray.stages.text.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(default_model_path)
    assert tok.encode("The capital of France is") == PROMPTS[0]
    rc = main(["run", str(default_model_path), "--stages", "2", "--simulate-devices", "288MiB,288MiB",
               "--prompt", "The capital of France is", "--max-tokens", "3", "--max-seqs", "2", "--max-len", "32"])
    out, err = capsys.readouterr()
    assert rc == 0
    assert out.strip() == tok.decode(reference[0][:3]).strip()
    assert "layer split auto: K=" in err
    assert "tok/s" in err
    assert "stage 1 (simulated device 1 (288.00 MiB on CPU)" in err


def test_a_step_past_its_deadline_is_reported_and_the_stage_restarted(launched, reference):
    # A deadline no step can meet stands in for a stage that hangs: the engine must not wait on
    # it, must name the stage it is stuck on, stop it, and serve again after the restart.
    eng = Engine(launched.pipeline(), EngineConfig(max_seqs=MAX_SEQS, max_len=MAX_LEN, token_budget=12,
                                                   prefill_chunk=8, micro_batches=1, step_timeout_s=0.001))
    req = eng.add(PROMPTS[0], SamplingParams(max_tokens=N_NEW, ignore_eos=True))
    with pytest.raises(StageFailedError, match=r"stage \d .* did not finish a step within"):
        eng.run([req], timeout_s=120)
    assert req.status is RequestStatus.FAILED
    again = _engine(launched).generate([PROMPTS[0]], SamplingParams(max_tokens=N_NEW, ignore_eos=True),
                                       timeout_s=300)
    assert again[0].output == reference[0]
