"""A hybrid (Gated DeltaNet) model on four simulated stages as Ray actors: the plan charges each
stage its layers' sequence states and state checkpoints beside their KV, every stage allocates
exactly that, and the pipeline gives the one-process greedy tokens; a second turn resumes from a
checkpoint of the state at its last cached block, on every stage (cluster/state_checkpoints.py);
drafts verified over the four stages (two micro-batches in flight) give the same tokens, each stage
restoring its own layers' state after a rejected draft."""
from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from moeray.cluster.config import EngineConfig, LaunchOptions  # noqa: E402
from moeray.cluster.driver import launch  # noqa: E402
from moeray.cluster.placement import state_bytes_by_layer  # noqa: E402
from moeray.cluster.engine import Engine  # noqa: E402
from moeray.stages.text.sampling import SamplingParams  # noqa: E402

MiB = 1 << 20
MAX_SEQS, MAX_LEN = 4, 96
PROMPTS = [list(range(3, 40)), [7, 9, 11], list(range(100, 160, 3))]
N_NEW = 8


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    from moeray.stages.gguf.writer import write_gguf
    from tiny_hybrid import tiny_qwen3next

    path = write_gguf(tiny_qwen3next(), tmp_path_factory.mktemp("rayhy") / "qwen3next.gguf", "F32")
    opts = LaunchOptions(4, simulate=[24 * MiB] * 4, torch_threads=1, timeout_s=180, split="K=1,2,3")
    out = launch(str(path), opts, EngineConfig(max_seqs=MAX_SEQS, max_len=MAX_LEN), log=lambda line: None)
    yield out
    out.shutdown()
    ray.shutdown()


def _greedy(path, prompt, n):
    import torch

    from moeray.stages.runtime.model import load_model

    model = load_model(path)
    kv = model.new_kv_cache(1, len(prompt) + n)
    out, feed = [], prompt
    for _ in range(n):
        out.append(int(torch.argmax(model.step([feed], [0], kv)[0])))
        feed = [out[-1]]
    return out


def test_stages_hold_the_priced_state_and_give_the_one_process_tokens(launched):
    from moeray.stages.gguf.reader import read_gguf_header

    cfg = read_gguf_header(launched.path).config
    checkpoints = launched.kv.checkpoints
    assert checkpoints == 2 * MAX_SEQS  # tiny states: all that were wanted fit
    state = state_bytes_by_layer(cfg, MAX_SEQS + checkpoints)
    assert [tuple(r) for r in launched.ranges] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert any(l.startswith("[state] 3 recurrent layers") for l in launched.lines)
    assert any(l.startswith(f"[state] {checkpoints} checkpoint(s)") for l in launched.lines)
    for st, (a, b) in zip(launched.stage_stats(), launched.ranges):
        held = {k: v for k, v in st.placed.items() if k.startswith("DeltaNet state")}
        assert sum(held.values()) == sum(state[a:b])  # layers 0-2: one state each; layer 3: none
    eng = Engine(launched.pipeline(), EngineConfig(max_seqs=MAX_SEQS, max_len=MAX_LEN, token_budget=16,
                                                   prefill_chunk=8, micro_batches=2, step_timeout_s=60))
    assert eng.pipeline.state_slots == MAX_SEQS and eng.scheduler.blocks.prefix_reuse
    assert eng.scheduler.checkpoints.n == checkpoints
    reqs = eng.generate(PROMPTS, SamplingParams(max_tokens=N_NEW, ignore_eos=True), timeout_s=300)
    assert [r.output for r in reqs] == [_greedy(launched.path, p, N_NEW) for p in PROMPTS]
    turn = PROMPTS[0] + reqs[0].output + [5, 6, 7]  # 37 + 8 + 3: resumes at 32, where the prompt's checkpoint is
    second = eng.generate([turn], SamplingParams(max_tokens=N_NEW, ignore_eos=True), timeout_s=300)[0]
    assert second.cached_tokens == 32 and second.output == _greedy(launched.path, turn, N_NEW)


class _OftenWrong:
    """Drafts the known greedy continuation, its first token wrong every other draft: rejections
    (the state restored on every stage, the kept tokens re-fed) and accepted runs both."""

    def __init__(self, refs: dict, tokens: list[int]):
        self.prompt = next(p for p in refs if tuple(tokens[:len(p)]) == p)
        self.ref, self.n, self.calls = refs[self.prompt], len(tokens), 0

    def extend(self, tokens) -> None:
        self.n += len(list(tokens))

    def draft(self, max_tokens: int):
        from moeray.cluster.ngram import Draft

        at = self.n - len(self.prompt)
        out = list(self.ref[at:at + max_tokens])
        self.calls += 1
        if out and self.calls % 2:
            out[0] = (out[0] + 1) % 300
        return Draft(out, 8 if out else 0)


def test_drafts_verified_over_the_stages_keep_the_greedy_tokens(launched):
    eng = Engine(launched.pipeline(), EngineConfig(max_seqs=MAX_SEQS, max_len=MAX_LEN, token_budget=16,
                                                   prefill_chunk=8, micro_batches=2, step_timeout_s=60))
    refs = {tuple(p): _greedy(launched.path, p, N_NEW) for p in PROMPTS}
    eng.speculation.new_drafter = lambda toks: _OftenWrong(refs, toks)
    eng.speculation.PROBE = 1.0
    reqs = eng.generate(PROMPTS, SamplingParams(max_tokens=N_NEW, ignore_eos=True, speculative=True), timeout_s=300)
    assert [r.output for r in reqs] == [refs[tuple(p)] for p in PROMPTS]
    s = eng.speculation.stats
    assert s.accepted_tokens > 0 and eng.stats.state_restores > 0
    assert not any(r.spare is not None for r in reqs) and eng.scheduler.spares.stats.borrowed > 0


def test_checkpoints_the_cards_have_no_room_for_live_in_host_memory(launched):
    """Cards that hold the trunk, KV and sequence states with too little room left for one checkpoint:
    the plan puts every checkpoint in the nodes' host memory (each stage the same count), a second
    turn resumes from one on both stages, and a verify row's spare in host memory keeps the greedy
    tokens after rejections."""
    from dataclasses import replace

    from moeray.cluster.placement import plan_from_reports
    from moeray.stages.gguf.reader import read_gguf_header
    from moeray.stages.runtime.step import ProbeReport
    from moeray.stages.runtime.device import simulated_device

    header = read_gguf_header(launched.path)
    engine = EngineConfig(max_seqs=MAX_SEQS, max_len=MAX_LEN, kv_blocks=12)
    opts = LaunchOptions(2, torch_threads=1, timeout_s=180, split="K=2")
    # what each card holds without checkpoints (the planner's own charge), and 1 KiB more
    reports = [ProbeReport(i, 0, simulated_device(64 * MiB, i), 1.0, 0.1, 0.0, [0]) for i in range(2)]
    sized, *_ = plan_from_reports(header, reports, opts, replace(engine, state_checkpoints=0), 0.2)
    tight = launch(launched.path, replace(opts, simulate=[s.trunk_bytes + 1024 for s in sized.stages]), engine,
                   log=lambda line: None)
    try:
        assert (tight.kv.checkpoints, tight.kv.host_checkpoints) == (0, 2 * MAX_SEQS)
        assert any(l.startswith("[state] 0 checkpoint(s)") and f"{2 * MAX_SEQS} more in host memory" in l
                   for l in tight.lines)
        eng = Engine(tight.pipeline(), EngineConfig(max_seqs=MAX_SEQS, max_len=MAX_LEN, token_budget=16,
                                                    prefill_chunk=8, step_timeout_s=60))
        assert eng.scheduler.checkpoints.n == 2 * MAX_SEQS
        first = eng.generate([PROMPTS[0]], SamplingParams(max_tokens=N_NEW, ignore_eos=True), timeout_s=300)[0]
        turn = PROMPTS[0] + first.output + [5, 6, 7]
        second = eng.generate([turn], SamplingParams(max_tokens=N_NEW, ignore_eos=True), timeout_s=300)[0]
        assert second.cached_tokens == 32 and second.output == _greedy(launched.path, turn, N_NEW)
        refs = {tuple(p): _greedy(launched.path, p, N_NEW) for p in PROMPTS[1:]}
        eng.speculation.new_drafter = lambda toks: _OftenWrong(refs, toks)
        eng.speculation.PROBE = 1.0
        reqs = eng.generate(PROMPTS[1:], SamplingParams(max_tokens=N_NEW, ignore_eos=True, speculative=True),
                            timeout_s=300)
        assert [r.output for r in reqs] == [refs[tuple(p)] for p in PROMPTS[1:]]
        assert eng.stats.state_restores > 0 and eng.scheduler.spares.stats.borrowed > 0
    finally:
        tight.shutdown()
