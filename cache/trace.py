"""Routing traces: every routing decision of a run, as an append-only msgpack stream.

A trace file is a sequence of msgpack objects:

  header  {"format": "moeray-trace", "version": 1, "n_layers": L, "n_experts": E, "k": k,
           "first": a, "end": b}           -- written once per writer session (layers [a, b) are traced)
  record  [layer, pos, ids, weights]        -- one MoE call of one layer: tokens pos, pos+1, ...,
                                              ids and weights are [n_tokens][k] lists

`pos` is the index of the call's first token in the writer's token stream (counted at the first
traced layer, so the same token has the same pos at every layer). A new step of the engine starts
at every record of layer `first`, which is what the replay needs to apply "one copy per step".

Why this shape: the writer must never lose what it flushed and never grow without bound, so it
buffers packed bytes and hands them to the kernel with one os.write per chunk (a killed process
keeps everything written before its last flush) and stops appending at `max_bytes`. Readers use a
streaming unpacker, so a record cut in half by a kill (or still being written) is simply not
returned yet.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import msgpack

from moeray.errors import MoerayError

FORMAT = "moeray-trace"
VERSION = 1

DEFAULT_CHUNK_BYTES = 64 * 1024
DEFAULT_MAX_BYTES = 256 * 1024 * 1024


class TraceError(MoerayError, ValueError):
    """A routing trace that is not a moeray trace, or whose sessions disagree about the model."""


@dataclass(frozen=True)
class TraceHeader:
    n_layers: int
    n_experts: int
    k: int
    first: int
    end: int

    def to_obj(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "n_layers": self.n_layers,
                "n_experts": self.n_experts, "k": self.k, "first": self.first, "end": self.end}


@dataclass(frozen=True)
class TraceRecord:
    layer: int
    pos: int
    ids: list[list[int]]        # [n_tokens][k]
    weights: list[list[float]]  # [n_tokens][k]


def _as_lists(x) -> list:
    if hasattr(x, "tolist"):   # torch.Tensor or numpy array
        return x.tolist()
    return [list(row) for row in x]


class TraceWriter:
    """Appends routing records to `path`. Safe against kill -9 up to the last flush.

    The header of this session is written (and flushed) at open, so even an empty run leaves a
    readable file. When the file would grow past `max_bytes`, appending stops and
    `dropped_records` counts what was not written: a trace is bounded, never silently truncated
    in the middle of a record.
    """

    def __init__(self, path: str | os.PathLike, *, n_layers: int, n_experts: int, k: int,
                 first: int = 0, end: int | None = None,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, max_bytes: int = DEFAULT_MAX_BYTES):
        self.path = os.fspath(path)
        self.header = TraceHeader(n_layers, n_experts, k, first, n_layers if end is None else end)
        self.chunk_bytes = int(chunk_bytes)
        self.max_bytes = int(max_bytes)
        self._packer = msgpack.Packer(use_single_float=True)
        self._buf: list[bytes] = []
        self._buf_len = 0
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._size = os.fstat(self._fd).st_size
        self._next_pos = 0
        self._closed = False
        self.records_written = 0
        self.dropped_records = 0
        head = self._packer.pack(self.header.to_obj())
        if self._size + len(head) > self.max_bytes:
            os.close(self._fd)
            raise TraceError(f"{self.path}: trace already holds {self._size} bytes, "
                             f"limit is {self.max_bytes}; remove it or raise the limit")
        self._append(head)
        self.flush()

    # -- writing -----------------------------------------------------------------------------
    def record(self, layer: int, expert_ids, weights, pos: int | None = None) -> None:
        """One MoE call of `layer`: expert_ids and weights are [n_tokens, k] (tensor, array or lists)."""
        if self._closed:
            raise TraceError(f"{self.path}: trace writer is closed")
        ids = _as_lists(expert_ids)
        ws = _as_lists(weights)
        if pos is None:
            if layer == self.header.first:
                pos = self._next_pos
                self._next_pos += len(ids)
            else:
                pos = self._next_pos - len(ids)   # same tokens as the first layer's call of this step
        packed = self._packer.pack([int(layer), int(pos), ids, ws])
        if self._size + self._buf_len + len(packed) > self.max_bytes:
            self.dropped_records += 1
            return
        self._append(packed)
        self.records_written += 1
        if self._buf_len >= self.chunk_bytes:
            self.flush()

    def __call__(self, layer: int, expert_ids, weights) -> None:
        """So a writer can be a model's routing_hook directly."""
        self.record(layer, expert_ids, weights)

    def _append(self, b: bytes) -> None:
        self._buf.append(b)
        self._buf_len += len(b)

    def flush(self) -> None:
        """Hand the buffered records to the kernel in one write: they survive the process from here on."""
        if not self._buf:
            return
        data = b"".join(self._buf)
        view = memoryview(data)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]
        self._size += len(data)
        self._buf.clear()
        self._buf_len = 0

    def close(self) -> None:
        if not self._closed:
            self.flush()
            os.close(self._fd)
            self._closed = True

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):  # a writer dropped without close still keeps its records
        try:
            self.close()
        except Exception:
            pass


@dataclass
class Trace:
    """Everything a trace file (or several) holds: the header and the records in file order."""
    header: TraceHeader
    records: list[TraceRecord] = field(default_factory=list)
    truncated_bytes: int = 0    # bytes at the end that did not form a whole record (a killed writer)
    paths: list[str] = field(default_factory=list)
    _record_paths: list[str] = field(default_factory=list, repr=False)  # each record's file

    @property
    def n_tokens(self) -> int:
        """Tokens routed through the first traced layer."""
        return sum(len(r.ids) for r in self.records if r.layer == self.header.first)

    def layer_tokens(self) -> dict[int, int]:
        """Tokens each traced layer routed, by layer (a dense layer records nothing)."""
        out: dict[int, int] = {}
        for r in self.records:
            out[r.layer] = out.get(r.layer, 0) + len(r.ids)
        return out

    def check_whole(self, layers: Sequence[int] = ()) -> None:
        """Raise TraceError naming the layers short of the others in a file: a whole trace routes
        every token through every MoE layer it traces (each step is written whole), so a layer
        with fewer picks than the rest was cut (or recorded only the rows some optimisation kept),
        and a profile made from it would weigh that layer wrong. `layers`: MoE layers that must
        be there (a trace's header does not say which layers are dense)."""
        for path, tokens in self._tokens_by_file().items():
            tokens = {**{layer: 0 for layer in layers}, **tokens}
            if len(set(tokens.values())) > 1:
                most = max(tokens.values())
                short = ", ".join(f"layer {layer} {n} of {most}" for layer, n in sorted(tokens.items()) if n < most)
                raise TraceError(f"{path}: the trace does not add up: every traced layer should route the same "
                                 f"{most} tokens, but {short}; record it again")

    def _tokens_by_file(self) -> dict[str, dict[int, int]]:
        out: dict[str, dict[int, int]] = {}
        for r, path in zip(self.records, self._record_paths):
            by = out.setdefault(path, {})
            by[r.layer] = by.get(r.layer, 0) + len(r.ids)
        return out

    def counts(self):
        """[n_layers, n_experts] int64: how often each (layer, expert) pair was routed to."""
        import numpy as np

        h = self.header
        table = np.zeros((h.n_layers, h.n_experts), dtype=np.int64)
        for r in self.records:
            if r.ids:
                np.add.at(table[r.layer], np.asarray(r.ids, dtype=np.int64).ravel(), 1)
        return table


def iter_trace(path: str | os.PathLike, tail: list | None = None) -> Iterator[TraceHeader | TraceRecord]:
    """Yield headers and records of one file in order; a truncated last object is not yielded.

    Safe on a file that is being written: what is complete now is returned. If `tail` is a list,
    the number of bytes after the last whole object (a record cut by a killed writer) is appended.
    """
    path = os.fspath(path)
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
    first = True
    read = 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(1 << 20)
            if not chunk:
                break
            read += len(chunk)
            unpacker.feed(chunk)
            try:
                for obj in unpacker:
                    if isinstance(obj, dict):
                        yield _header_from(obj, path)
                    elif first:
                        raise TraceError(f"{path}: not a moeray trace (no header)")
                    else:
                        yield _record_from(obj, path)
                    first = False
            except TraceError:
                raise
            except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError) as exc:
                raise TraceError(f"{path}: corrupt trace: {exc}") from exc
    if first:
        raise TraceError(f"{path}: empty or truncated before its header, not a moeray trace")
    if tail is not None:
        tail.append(read - unpacker.tell())


def _header_from(obj: dict, path: str) -> TraceHeader:
    if obj.get("format") != FORMAT:
        raise TraceError(f"{path}: not a moeray trace (format {obj.get('format')!r})")
    if obj.get("version") != VERSION:
        raise TraceError(f"{path}: trace version {obj.get('version')} is not supported (want {VERSION})")
    try:
        return TraceHeader(int(obj["n_layers"]), int(obj["n_experts"]), int(obj["k"]),
                           int(obj["first"]), int(obj["end"]))
    except KeyError as exc:
        raise TraceError(f"{path}: trace header lacks {exc}") from None


def _record_from(obj, path: str) -> TraceRecord:
    if not (isinstance(obj, list) and len(obj) == 4):
        raise TraceError(f"{path}: corrupt trace record {obj!r:.80}")
    layer, pos, ids, ws = obj
    return TraceRecord(int(layer), int(pos), ids, ws)


def read_trace(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> Trace:
    """Read one or more trace files (all of the same model) into one Trace, in the order given."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    trace: Trace | None = None
    for path in paths:
        path = os.fspath(path)
        tail: list[int] = []
        for obj in iter_trace(path, tail):
            if isinstance(obj, TraceHeader):
                if trace is None:
                    trace = Trace(header=obj)
                elif (obj.n_layers, obj.n_experts, obj.k) != (trace.header.n_layers,
                                                              trace.header.n_experts, trace.header.k):
                    raise TraceError(f"{path}: trace of a model with {obj.n_layers} layers, "
                                     f"{obj.n_experts} experts, top-{obj.k} does not match the "
                                     f"first trace ({trace.header.n_layers}, {trace.header.n_experts}, "
                                     f"top-{trace.header.k})")
                elif (obj.first, obj.end) != (trace.header.first, trace.header.end):
                    # Sessions over different layer ranges: widen so every record is in range.
                    trace.header = TraceHeader(obj.n_layers, obj.n_experts, obj.k,
                                               min(obj.first, trace.header.first),
                                               max(obj.end, trace.header.end))
            else:
                h = trace.header
                if not (0 <= obj.layer < h.n_layers) or any(
                        not (0 <= e < h.n_experts) for row in obj.ids for e in row):
                    raise TraceError(f"{path}: record names layer {obj.layer} / experts outside "
                                     f"the model ({h.n_layers} layers, {h.n_experts} experts)")
                trace.records.append(obj)
                trace._record_paths.append(path)
        trace.paths.append(path)
        trace.truncated_bytes += tail[0]
    if trace is None:
        raise TraceError("no trace files given")
    return trace
