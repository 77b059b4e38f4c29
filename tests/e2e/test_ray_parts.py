"""The default model in parts on four simulated stages as Ray actors: the one-process greedy tokens,
each stage mapping only the parts that hold its layers (what it opened, as it reports), and the
driver's per-stage check of those files naming a stage's missing or short part before loading."""
from __future__ import annotations

import os
import shutil

import pytest

ray = pytest.importorskip("ray")

from moeray.cluster.config import EngineConfig, LaunchOptions  # noqa: E402
from moeray.cluster.driver import StageGroup, launch  # noqa: E402
from moeray.cluster.engine import Engine  # noqa: E402
from moeray.errors import MoerayError  # noqa: E402
from moeray.stages.gguf.reader import read_gguf_header  # noqa: E402
from moeray.stages.gguf.writer import split_gguf  # noqa: E402
from moeray.stages.text.sampling import SamplingParams  # noqa: E402

MiB = 1 << 20
BUDGETS = [72 * MiB, 72 * MiB, 64 * MiB, 64 * MiB]
MAX_SEQS, MAX_LEN = 4, 64
PROMPTS = [[504, 3575, 282, 4649, 314], [1] + list(range(20, 39)), [1, 9]]
N_NEW = 5


@pytest.fixture(scope="module")
def parts(default_model_path, tmp_path_factory):
    return split_gguf(default_model_path, tmp_path_factory.mktemp("ray-parts") / "smollm2-moe", max_tensors=60,
                      layer_order=True)


@pytest.fixture(scope="module")
def launched(parts):
    lines: list[str] = []
    opts = LaunchOptions(4, simulate=BUDGETS, torch_threads=1, timeout_s=180)
    out = launch(str(parts[2]), opts, EngineConfig(max_seqs=MAX_SEQS, max_len=MAX_LEN), log=lines.append)
    out.lines_seen = lines
    yield out
    out.shutdown()
    ray.shutdown()


@pytest.mark.slow
def test_four_stages_over_parts_give_the_one_process_tokens_each_mapping_only_its_parts(launched, parts,
                                                                                         default_model_path):
    from greedy import one_process_greedy

    from moeray.stages.runtime.model import load_model

    eng = Engine(launched.pipeline(), EngineConfig(max_seqs=MAX_SEQS, max_len=MAX_LEN, token_budget=12,
                                                   prefill_chunk=8, micro_batches=2, step_timeout_s=60))
    got = [r.output for r in eng.generate(PROMPTS, SamplingParams(max_tokens=N_NEW, ignore_eos=True), timeout_s=300)]
    assert got == one_process_greedy(load_model(str(default_model_path)), PROMPTS, N_NEW, MAX_LEN)

    header = read_gguf_header(parts[0])
    stats = launched.stage_stats()
    opened = [s.parts_opened for s in stats]
    assert opened == [header.stage_parts(a, b) for a, b in launched.ranges]
    assert all(len(o) < len(parts) for o in opened)  # no stage mapped the whole model
    assert {j for o in opened for j in o} == set(range(len(parts)))
    # The driver said, per stage, which files its node reads, after checking them there.
    said = [l for l in launched.lines_seen if l.startswith("[parts] stage")]
    assert len(said) == 4 and all("; checked on simulated device" in l for l in said)
    for line, o in zip(said, opened):
        assert all(parts[j].name in line for j in o)


@pytest.mark.slow
def test_a_part_missing_or_short_on_a_stages_node_is_named_before_loading(launched, parts, tmp_path):
    # Another copy of the parts, spoiled after the driver read its header and the stages probed it.
    for p in parts:
        shutil.copy(p, tmp_path / p.name)
    copies = [tmp_path / p.name for p in parts]
    header = read_gguf_header(copies[0])
    group = StageGroup(2, [64 * MiB, 64 * MiB], torch_threads=1, timeout_s=120).start()
    try:
        group.probe(str(copies[0]), header)
        ranges = [(0, 15), (15, 30)]
        copies[3].unlink()  # layers 17-23: the second stage's
        with open(copies[1], "r+b") as f:  # layers 5-11: the first stage's
            f.truncate(os.path.getsize(copies[1]) // 2)
        with pytest.raises(MoerayError) as err:
            group.check_parts(header, ranges)
        msg = str(err.value)
        assert "\n" not in msg
        assert f"stage 0 (simulated device 0" in msg and f"{copies[1]}: truncated" in msg and "fetch it again" in msg
        assert f"stage 1 (simulated device 1" in msg and f"{copies[3]}: missing" in msg and "layers 17-23" in msg
    finally:
        group.shutdown()


@pytest.mark.slow
def test_a_model_in_parts_serves_through_moeray_serve_to_the_openai_client(parts, default_model_path):
    """`moeray serve PART` on two Ray stages (Ray Serve), asked with the openai client: the model is
    named without its part suffix and answers the one-process greedy text."""
    openai = pytest.importorskip("openai")
    from greedy import one_process_greedy
    from serve_process import start_serve

    from moeray.stages.runtime.model import load_model
    from moeray.stages.runtime.transport import free_port
    from moeray.stages.text.tokenizer import Tokenizer

    server = start_serve([str(parts[4]), "--stages", "2", "--simulate-devices", "150MiB,150MiB", "--max-seqs", "2",
                          "--max-len", "128", "--ready-timeout", "240"], free_port())
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        assert [m.id for m in client.models.list().data] == ["smollm2-moe"]
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        r = client.chat.completions.create(model="smollm2-moe", messages=messages, max_tokens=6, temperature=0)
    finally:
        server.stop()
    tok = Tokenizer.from_gguf(default_model_path)
    want = one_process_greedy(load_model(str(default_model_path)), [tok.encode_chat(messages)], 6, 128)[0]
    assert r.choices[0].message.content == tok.decode(want)
