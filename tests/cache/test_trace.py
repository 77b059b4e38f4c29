"""Routing traces: append, bound, read while written, survive a killed writer."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from moeray.cache.trace import TraceError, TraceWriter, iter_trace, read_trace

REPO = Path(__file__).resolve().parents[2]


def _ids(t: int, layer: int) -> list[int]:
    return [(t * 7 + layer) % 8, (t * 3 + layer + 1) % 8]


def test_roundtrip_records_and_positions(tmp_path):
    path = tmp_path / "t.msgpack"
    with TraceWriter(path, n_layers=3, n_experts=8, k=2) as w:
        # A 4-token prefill step, then two decode steps; layers in order within a step.
        for n in (4, 1, 1):
            for layer in range(3):
                w.record(layer, [[1, 2]] * n, [[0.75, 0.25]] * n)
    tr = read_trace(path)
    assert (tr.header.n_layers, tr.header.n_experts, tr.header.k) == (3, 8, 2)
    assert [(r.layer, r.pos, len(r.ids)) for r in tr.records] == [
        (0, 0, 4), (1, 0, 4), (2, 0, 4), (0, 4, 1), (1, 4, 1), (2, 4, 1), (0, 5, 1), (1, 5, 1), (2, 5, 1)]
    assert tr.records[0].ids[0] == [1, 2]
    assert tr.records[0].weights[0] == pytest.approx([0.75, 0.25])
    assert tr.n_tokens == 6
    assert tr.truncated_bytes == 0


def test_reopening_appends_a_second_session(tmp_path):
    path = tmp_path / "t.msgpack"
    for _ in range(2):
        with TraceWriter(path, n_layers=2, n_experts=4, k=1) as w:
            w.record(0, [[3]], [[1.0]])
            w.record(1, [[2]], [[1.0]])
    tr = read_trace(path)
    assert [r.ids for r in tr.records] == [[[3]], [[2]], [[3]], [[2]]]


def test_readable_while_being_written(tmp_path):
    path = tmp_path / "t.msgpack"
    w = TraceWriter(path, n_layers=1, n_experts=4, k=1, chunk_bytes=1 << 20)
    w.record(0, [[1]], [[1.0]])
    assert read_trace(path).records == []           # still in the writer's buffer
    w.flush()
    assert len(read_trace(path).records) == 1       # visible to a reader while the writer is open
    w.record(0, [[2]], [[1.0]])
    w.close()
    assert [r.ids for r in read_trace(path).records] == [[[1]], [[2]]]


def test_bounded_total_size(tmp_path):
    path = tmp_path / "t.msgpack"
    limit = 2000
    with TraceWriter(path, n_layers=1, n_experts=8, k=2, chunk_bytes=100, max_bytes=limit) as w:
        for t in range(1000):
            w.record(0, [_ids(t, 0)], [[0.5, 0.5]])
    assert os.path.getsize(path) <= limit
    assert w.dropped_records > 0
    tr = read_trace(path)
    assert len(tr.records) == w.records_written == 1000 - w.dropped_records
    # What was kept is the beginning of the run, whole.
    assert [r.ids[0] for r in tr.records] == [_ids(t, 0) for t in range(len(tr.records))]


def test_truncated_last_record_is_tolerated(tmp_path):
    path = tmp_path / "t.msgpack"
    with TraceWriter(path, n_layers=1, n_experts=8, k=2) as w:
        for t in range(10):
            w.record(0, [_ids(t, 0)], [[0.5, 0.5]])
    data = path.read_bytes()
    path.write_bytes(data[:-3])
    tr = read_trace(path)
    assert len(tr.records) == 9
    assert tr.truncated_bytes > 0


def test_not_a_trace_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.msgpack"
    bad.write_bytes(b"\x93\x01\x02\x03")             # a msgpack list, no header
    with pytest.raises(TraceError, match="not a moeray trace"):
        read_trace(bad)
    empty = tmp_path / "empty.msgpack"
    empty.write_bytes(b"")
    with pytest.raises(TraceError, match="empty"):
        list(iter_trace(empty))


def test_traces_of_different_models_do_not_mix(tmp_path):
    a, b = tmp_path / "a.msgpack", tmp_path / "b.msgpack"
    TraceWriter(a, n_layers=2, n_experts=4, k=1).close()
    TraceWriter(b, n_layers=2, n_experts=8, k=1).close()
    with pytest.raises(TraceError, match="does not match"):
        read_trace([a, b])


WRITER = textwrap.dedent("""
    import sys, time
    from moeray.cache.trace import TraceWriter
    w = TraceWriter(sys.argv[1], n_layers=2, n_experts=8, k=2, chunk_bytes=256)
    t = 0
    while True:
        for layer in range(2):
            before = w._size
            w.record(layer, [[(t * 7 + layer) % 8, (t * 3 + layer + 1) % 8]], [[0.5, 0.5]])
            if w._size != before:                   # a chunk reached the kernel
                print(w.records_written, flush=True)
        t += 1
        time.sleep(0.0005)
""")


def test_trace_survives_kill_9_up_to_last_flush(tmp_path):
    path = tmp_path / "killed.msgpack"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE,
                            text=True, env=env, cwd=REPO)
    flushed = 0
    try:
        for _ in range(5):                           # let it flush five chunks, then kill it mid-run
            flushed = int(proc.stdout.readline())
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert flushed > 0
    tr = read_trace(path)
    # Everything flushed before the kill is there; it may hold more (later flushes), never less.
    assert len(tr.records) >= flushed
    for i, r in enumerate(tr.records):
        t, layer = divmod(i, 2)
        assert (r.layer, r.pos, r.ids) == (layer, t, [_ids(t, layer)])


# -- moeray profile make / show ---------------------------------------------------------------------

def test_profile_make_ranks_pairs_by_count(tmp_path, capsys):
    from moeray.cluster.cli import main
    from moeray.planner.profile import Profile

    path = tmp_path / "known.msgpack"
    with TraceWriter(path, n_layers=2, n_experts=4, k=2) as w:
        # Layer 0: expert 2 x5, expert 0 x3, expert 1 x2.  Layer 1: expert 3 x5, 1 x4, 0 x1.
        w.record(0, [[2, 0], [2, 0], [2, 0], [2, 1], [2, 1]], [[0.6, 0.4]] * 5)
        w.record(1, [[3, 1], [3, 1], [3, 1], [3, 1], [3, 0]], [[0.6, 0.4]] * 5)
        w.record(0, [], [])                                      # an empty call changes nothing
    out = tmp_path / "p.msgpack"
    assert main(["profile", "make", str(path), "-o", str(out)]) == 0
    prof = Profile.load(out, 2, 4)
    # Hottest first; the tie at 5 goes to the lower expert index (interleaved across layers).
    assert prof.pairs[:6] == [(0, 2), (1, 3), (1, 1), (0, 0), (0, 1), (1, 0)]
    assert prof.counts == [5, 5, 4, 3, 2, 1, 0, 0]
    capsys.readouterr()
    assert main(["profile", "show", str(out)]) == 0
    text = capsys.readouterr().out
    assert "20 routed lookups" in text
    assert "    0       10  2: 50.0%" in text                     # layer 0's hottest expert and share
    assert "    1       10  3: 50.0% 1: 40.0%" in text


def test_profile_make_from_several_traces_and_a_killed_one(tmp_path):
    from moeray.cluster.commands.profile import profile_from_traces

    a, b = tmp_path / "a.msgpack", tmp_path / "b.msgpack"
    with TraceWriter(a, n_layers=1, n_experts=4, k=1) as w:
        w.record(0, [[1]] * 3, [[1.0]] * 3)
    with TraceWriter(b, n_layers=1, n_experts=4, k=1) as w:
        w.record(0, [[2]] * 4, [[1.0]] * 4)
        w.record(0, [[3]] * 9, [[1.0]] * 9)
    b.write_bytes(b.read_bytes()[:-2])                          # the last record cut by a kill
    prof, trace = profile_from_traces([a, b])
    assert prof.pairs[:2] == [(0, 2), (0, 1)] and prof.counts[:3] == [4, 3, 0]
    assert trace.truncated_bytes > 0


def test_profile_show_of_a_ranking_without_counts(tmp_path, capsys):
    from moeray.cluster.cli import main
    from moeray.planner.profile import Profile

    prof = Profile(2, 3, [(1, 2), (0, 0), (0, 1), (1, 0), (0, 2), (1, 1)])
    prof.save_strp(tmp_path / "p.strp")
    assert main(["profile", "show", str(tmp_path / "p.strp")]) == 0
    text = capsys.readouterr().out
    assert "ranking only" in text and "    1  2:#0 0:#3 1:#5" in text
