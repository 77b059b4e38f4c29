"""ggml's threads as `moeray serve --local` uses them: each graph learns whether one thread or all
of them compute it faster (stages/kernels/threads.ThreadChoice), and whichever it picks, the numbers are
the same: a row of the output is computed by one thread either way. And as pipeline stages use them:
a stage whose part of a step is done puts its workers to sleep."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from moeray.stages.kernels import graphs, threads
from moeray.stages.kernels.qmatmul import QMatrix
from moeray.stages.kernels.threads import ThreadChoice, ThreadSettings

pytest.importorskip("ggml")
from quant_blocks import random_blocks  # noqa: E402


def _run(choice: ThreadChoice, seconds: list[float], calls: int) -> list[int]:
    """Drive `choice` for `calls` calls where option i costs seconds[i]; the options it picked."""
    picked = []
    for _ in range(calls):
        i = choice.pick()
        choice.record(i, seconds[i])
        picked.append(i)
    return picked


def test_a_graph_keeps_the_faster_thread_count_and_still_tries_the_other():
    for first in (0, 1):
        c = ThreadChoice(first, explore=32)
        picked = _run(c, [1e-3, 3e-3], 1000)  # one thread 3x faster: a loaded machine
        assert c.current == 0
        tail = picked[100:]
        assert 0 < tail.count(1) <= len(tail) // (32 * 3) + 1  # tried, at most every 32 x 3 calls
    c = ThreadChoice(0)
    _run(c, [2e-3, 1e-3], 200)  # both threads faster: a quiet machine
    assert c.current == 1


def test_when_the_load_changes_the_choice_follows():
    c = ThreadChoice(1, explore=16)
    _run(c, [2e-3, 1e-3], 200)
    assert c.current == 1
    _run(c, [2e-3, 8e-3], 400)  # the machine got busy: splitting now costs 4x
    assert c.current == 0
    _run(c, [2e-3, 1e-3], 400)  # and quiet again
    assert c.current == 1


def test_first_calls_do_not_count():
    c = ThreadChoice(1)
    c.record(1, 10.0)  # a cold first call (page faults): ignored
    assert c.cost == [None, None]


@pytest.mark.parametrize("adapt", [False, True])
def test_one_thread_or_two_the_output_is_bitwise_the_same(adapt):
    rng = np.random.default_rng(0)
    n, k, m = 512, 1024, 3
    raw = random_blocks(QT.Q4_K, n * k // 256, rng, scale=0.01).reshape(-1)
    w = QMatrix.from_raw(raw, QT.Q4_K, (n, k), "ggml")
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
    before = (threads.ggml_threads(), threads.thread_settings())
    try:
        threads.set_threads(1)
        ref = w(x)
        threads.set_threads(2, ThreadSettings(poll=1, parallel_bytes=0, adapt=adapt))
        outs = [w(x) for _ in range(80)]  # with adapt, both plans run (the other is tried every 32 calls)
        g = next(iter(graphs._graphs.values()))
        assert (g.plans.choice is not None) == adapt and g.plans.plans[-1].n_threads == 2
        if adapt:
            assert min(g.plans.choice.seen) >= 2
    finally:
        threads.set_threads(*before)
    for out in outs:
        assert torch.equal(out, ref)


def test_serve_local_picks_its_threads_by_what_a_token_reads(default_model_path):
    """GGUFHeader.token_bytes, from the header alone, is what a loaded model's decode token reads
    (the trunk and head once, k routed experts per MoE layer: bench/decode.py's MB/token); `moeray
    serve --local` adapts its graphs' thread counts below 1 GiB of it (the default model: 147 MB)
    and keeps every thread fixed above (a 30B-A3B model reads ~1.9 GB)."""
    from moeray.cluster.config import BIG_LOCAL_THREADS, BIG_TOKEN_BYTES, LOCAL_THREADS, local_threads
    from moeray.stages.gguf.reader import read_gguf_header
    from moeray.stages.runtime.model import load_model

    header = read_gguf_header(default_model_path)
    model = load_model(default_model_path, backend="ggml")
    cfg = model.config
    read = model.trunk_bytes() + cfg.n_experts_used * sum(model.experts.slot_bytes(l) for l in range(cfg.n_layers))
    assert header.token_bytes() == read
    assert local_threads(header.token_bytes()) is LOCAL_THREADS and LOCAL_THREADS["adapt"]
    assert local_threads(BIG_TOKEN_BYTES + 1) is BIG_LOCAL_THREADS and not BIG_LOCAL_THREADS["adapt"]


def _cpu_while_idle(seconds: float = 0.5) -> float:
    """CPU seconds this process's threads (ggml's workers among them) use while its main thread sleeps."""
    t0 = time.process_time()
    time.sleep(seconds)
    return time.process_time() - t0


def test_a_rested_pool_stops_spinning_and_the_next_graph_wakes_it():
    """Pipeline stages that share a host's cores compute one after another on one stream: a stage
    whose part of the step is done puts its workers to sleep (threads.rest_threads) rather than let
    them spin `poll` on into the next stage's compute. Poll 100 spins for most of a second."""
    rng = np.random.default_rng(1)
    raw = random_blocks(QT.Q4_K, 256 * 1024 // 256, rng, scale=0.01).reshape(-1)
    w = QMatrix.from_raw(raw, QT.Q4_K, (256, 1024), "ggml")
    x = torch.from_numpy(rng.standard_normal((1, 1024)).astype(np.float32))
    before = (threads.ggml_threads(), threads.thread_settings())
    try:
        threads.set_threads(2, ThreadSettings(poll=100, parallel_bytes=0, adapt=False))
        ref = w(x)
        spinning = _cpu_while_idle()  # the helper spins on after the graph
        w(x)
        assert threads.rest_threads() >= 1  # this pool (and any other spinning one made before)
        rested = _cpu_while_idle()
        again = w(x)  # a paused pool is resumed by the next graph
    finally:
        threads.set_threads(*before)
    assert torch.equal(again, ref)
    assert rested < 0.05 < 0.15 < spinning, (rested, spinning)


def test_a_pipeline_stage_leaves_no_worker_spinning_after_its_part_of_a_step(tmp_path):
    """Stage 0 of 2 (StageActor, in this process) on a tiny MoE file, two ggml threads spinning poll
    100 between graphs: once its step has sent its activations on, its workers sleep."""
    from moeray.stages.kernels.settings import StageOptions
    from moeray.stages.runtime.actor import StageActor
    from moeray.stages.runtime.step import StepBatch
    from test_gguf_file import tiny_config, write_synthetic_gguf

    class Link:  # the process group's end: what stage 0 sends on
        sent = []

        def send(self, x, tokens=None):
            self.sent.append(tuple(x.shape))

    path = write_synthetic_gguf(tmp_path / "moe.gguf", tiny_config("llama"), seed=3)
    before = (threads.ggml_threads(), threads.thread_settings())
    try:
        stage = StageActor(0, 2, simulated_budget=64 << 20, options=StageOptions(backend="ggml", threads=2, ggml_poll=100, ggml_parallel_kb=0))
        stage.load(str(path), 0, 2, kv_blocks=4)
        stage.link = Link()
        for step, (start, toks) in enumerate([(0, [1, 2, 3, 4]), (4, [5])]):
            stage.step(StepBatch(step_id=step, slots=[0], n_new=[len(toks)], fresh=[start == 0], tokens=[toks],
                                 starts=[start], tables=[[0]]))
            idle = _cpu_while_idle()
            assert idle < 0.05, (step, idle)
    finally:
        threads.set_threads(*before)
    assert Link.sent == [(4, 64), (1, 64)]
