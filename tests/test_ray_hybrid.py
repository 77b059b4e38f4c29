"""A hybrid (Gated DeltaNet) model on four simulated stages as Ray actors: the plan charges each
stage its layers' sequence states and state checkpoints beside their KV, every stage allocates
exactly that, and the pipeline gives the one-process greedy tokens; a second turn resumes from a
checkpoint of the state at its last cached block, on every stage (cluster/state_checkpoints.py)."""
from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from moeray.cluster.config import EngineConfig, LaunchOptions  # noqa: E402
from moeray.cluster.driver import launch, state_bytes_by_layer  # noqa: E402
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
