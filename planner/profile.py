"""Routing profiles: every (layer, expert) pair of a model ranked hottest first.

Three formats are read, so users of Strata and colibri can bring their data:
  * moeray:  msgpack {"format": "moeray-profile", "version": 1, "n_layers", "n_experts",
             "pairs": [[layer, expert], ...] hottest first, "counts": [...] optional};
  * Strata:  b"STRP", u32 version=1, n_layers, n_expert, slots, n_ranked; at offset 24,
             n_ranked (u16 layer, u16 expert) hottest first; then an n_layers x n_expert
             int32 table of ranks, -1 = unranked;
  * colibri: u32 magic 0x51544831, nl, ne, then nl*ne u32 counters, layer-major.
All little-endian. Pairs a trace never saw are ranked after the seen ones, interleaved
across layers (expert 0 of every layer, then expert 1, ...), so no layer's tail is
favoured over another's.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import msgpack
import numpy as np

from moeray.errors import ProfileError

MOERAY_FORMAT = "moeray-profile"
STRP_MAGIC = b"STRP"
HEAT_MAGIC = 0x51544831


def interleaved(n_layers: int, n_experts: int) -> list[tuple[int, int]]:
    return [(l, e) for e in range(n_experts) for l in range(n_layers)]


def complete_ranking(n_layers: int, n_experts: int, seen: list[tuple[int, int]], where: str):
    """`seen` hottest first, then every unseen pair interleaved across layers."""
    taken = np.zeros((n_layers, n_experts), dtype=bool)
    for l, e in seen:
        if not (0 <= l < n_layers and 0 <= e < n_experts):
            raise ProfileError(f"{where}: pair (layer {l}, expert {e}) is outside a model of "
                               f"{n_layers} layers x {n_experts} experts")
        if taken[l, e]:
            raise ProfileError(f"{where}: pair (layer {l}, expert {e}) is ranked twice")
        taken[l, e] = True
    rest = [(l, e) for e in range(n_experts) for l in range(n_layers) if not taken[l, e]]
    return [(int(l), int(e)) for l, e in seen] + rest


@dataclass
class Profile:
    n_layers: int
    n_experts: int
    pairs: list[tuple[int, int]]  # all L*E pairs (or those of `layers`), hottest first
    counts: list[int] | None = None  # same order as pairs; 0 for unseen pairs
    # The layers the ranking covers: None = every layer; an MoE model with dense layers ranks only
    # its MoE layers' pairs (a dense layer has no experts, so no pairs: `for_layers`).
    layers: tuple[int, ...] | None = None

    def __post_init__(self):
        n_ranked = self.n_layers if self.layers is None else len(self.layers)
        T = n_ranked * self.n_experts
        if len(self.pairs) != T:
            raise ProfileError(f"profile ranks {len(self.pairs)} pairs; a model of {n_ranked} x "
                               f"{self.n_experts} routed layers and experts has {T}")
        if self.counts is not None and len(self.counts) != T:
            raise ProfileError(f"profile has {len(self.counts)} counts for {T} pairs")

    # --- constructors -------------------------------------------------------------
    @classmethod
    def uniform(cls, n_layers: int, n_experts: int) -> "Profile":
        """No data: every pair equal, interleaved across layers."""
        return cls(n_layers, n_experts, interleaved(n_layers, n_experts), None)

    @classmethod
    def from_counts(cls, counts) -> "Profile":
        """Rank by count, hottest first; ties and unseen pairs interleaved across layers."""
        c = np.asarray(counts)
        if c.ndim != 2:
            raise ProfileError(f"counts must be a [n_layers, n_experts] table, got shape {c.shape}")
        if (c < 0).any():
            raise ProfileError("counts must not be negative")
        L, E = c.shape
        flat = c.T.reshape(-1)  # interleaved order: index e*L + l
        order = np.argsort(-flat, kind="stable")
        arr = np.stack([order % L, order // L], axis=1).astype(np.int64)
        prof = cls(L, E, list(map(tuple, arr.tolist())), flat[order].tolist())
        prof.__dict__["_pairs_array"] = arr
        prof.__dict__["_counts_array"] = flat[order].astype(np.int64)
        return prof

    def for_layers(self, layers) -> "Profile":
        """The ranking of `layers` only, order and counts kept: what an MoE model whose other
        layers are dense ranks (their pairs do not exist: no slots, no mass)."""
        layers = tuple(sorted(int(l) for l in layers))
        if layers == tuple(range(self.n_layers)) or layers == self.layers:
            return self
        keep = np.isin(self.layers_array(), layers)
        arr = self.pairs_array()[keep]
        counts = None if self.counts is None else self.counts_array()[keep]
        prof = Profile(self.n_layers, self.n_experts, list(map(tuple, arr.tolist())),
                       None if counts is None else counts.tolist(), layers)
        prof.__dict__["_pairs_array"] = arr
        if counts is not None:
            prof.__dict__["_counts_array"] = counts
        return prof

    # --- arrays the planner computes with ------------------------------------------
    # The ranking as an [T, 2] int array, built once (treat `pairs` as immutable).
    def pairs_array(self) -> np.ndarray:
        arr = self.__dict__.get("_pairs_array")
        if arr is None:
            arr = np.array(self.pairs, dtype=np.int64).reshape(-1, 2)
            self.__dict__["_pairs_array"] = arr
        return arr

    def counts_array(self) -> np.ndarray | None:
        if self.counts is None:
            return None
        arr = self.__dict__.get("_counts_array")
        if arr is None:
            arr = np.asarray(self.counts, dtype=np.int64)
            self.__dict__["_counts_array"] = arr
        return arr

    def layers_array(self) -> np.ndarray:
        return self.pairs_array()[:, 0]

    def experts_array(self) -> np.ndarray:
        return self.pairs_array()[:, 1]

    def count_table(self) -> np.ndarray | None:
        if self.counts is None:
            return None
        t = np.zeros((self.n_layers, self.n_experts), dtype=np.int64)
        t[self.layers_array(), self.experts_array()] = self.counts_array()
        return t

    def check_model(self, n_layers: int | None, n_experts: int | None, where: str = "profile"):
        if n_layers is not None and n_layers != self.n_layers:
            raise ProfileError(f"{where} is for {self.n_layers} layers but the model has {n_layers}; "
                               "record a profile for this model")
        if n_experts is not None and n_experts != self.n_experts:
            raise ProfileError(f"{where} is for {self.n_experts} experts per layer but the model has "
                               f"{n_experts}; record a profile for this model")

    # --- files ----------------------------------------------------------------------
    @classmethod
    def load(cls, path, n_layers: int | None = None, n_experts: int | None = None) -> "Profile":
        path = Path(path)
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise ProfileError(f"cannot read profile {path}: {exc.strerror or exc}") from None
        if data[:4] == STRP_MAGIC:
            prof = _parse_strp(data, str(path))
        elif len(data) >= 4 and struct.unpack_from("<I", data)[0] == HEAT_MAGIC:
            prof = _parse_heat(data, str(path))
        else:
            prof = _parse_moeray(data, str(path))
        prof.check_model(n_layers, n_experts, where=f"profile {path}")
        return prof

    def to_bytes(self) -> bytes:
        """The moeray msgpack format."""
        doc = {"format": MOERAY_FORMAT, "version": 1, "n_layers": self.n_layers,
               "n_experts": self.n_experts, "pairs": [[l, e] for l, e in self.pairs]}
        if self.counts is not None:
            doc["counts"] = list(self.counts)
        return msgpack.packb(doc)

    def save(self, path) -> None:
        """Write the moeray msgpack format."""
        Path(path).write_bytes(self.to_bytes())

    def save_strp(self, path, n_ranked: int | None = None, slots: int = 0) -> None:
        """Write Strata's STRP format (ranks only; the counts are lost)."""
        n = len(self.pairs) if n_ranked is None else n_ranked
        ranks = np.full((self.n_layers, self.n_experts), -1, dtype="<i4")
        body = bytearray(struct.pack("<4s5I", STRP_MAGIC, 1, self.n_layers, self.n_experts, slots, n))
        for r, (l, e) in enumerate(self.pairs[:n]):
            body += struct.pack("<HH", l, e)
            ranks[l, e] = r
        Path(path).write_bytes(bytes(body) + ranks.tobytes())

    def save_heat(self, path) -> None:
        """Write colibri's heat file (needs counts)."""
        table = self.count_table()
        if table is None:
            raise ProfileError("a colibri heat file holds counts; this profile has a ranking only")
        Path(path).write_bytes(struct.pack("<3I", HEAT_MAGIC, self.n_layers, self.n_experts)
                               + table.astype("<u4").tobytes())


def _parse_moeray(data: bytes, where: str) -> Profile:
    try:
        doc = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProfileError(f"{where} is not a moeray, Strata STRP or colibri heat profile "
                           f"(msgpack: {exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != MOERAY_FORMAT:
        raise ProfileError(f"{where} is not a moeray, Strata STRP or colibri heat profile")
    if doc.get("version") != 1:
        raise ProfileError(f"{where}: moeray profile version {doc.get('version')!r}; this moeray reads version 1")
    try:
        L, E = int(doc["n_layers"]), int(doc["n_experts"])
        seen = [(int(p[0]), int(p[1])) for p in doc["pairs"]]
        counts = doc.get("counts")
        counts = None if counts is None else [int(c) for c in counts]
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise ProfileError(f"{where}: malformed moeray profile ({exc!r})") from None
    if L <= 0 or E <= 0:
        raise ProfileError(f"{where}: n_layers and n_experts must be positive")
    if counts is not None:
        if len(counts) != len(seen):
            raise ProfileError(f"{where}: {len(counts)} counts for {len(seen)} pairs")
        if any(c < 0 for c in counts):
            raise ProfileError(f"{where}: negative count")
    pairs = complete_ranking(L, E, seen, where)
    if counts is not None:
        counts = counts + [0] * (len(pairs) - len(seen))
    return Profile(L, E, pairs, counts)


def _parse_strp(data: bytes, where: str) -> Profile:
    if len(data) < 24:
        raise ProfileError(f"{where}: STRP header truncated ({len(data)} bytes, need 24)")
    _, version, L, E, _slots, n = struct.unpack_from("<4s5I", data)
    if version != 1:
        raise ProfileError(f"{where}: STRP version {version}; moeray reads version 1")
    if L == 0 or E == 0 or L > 65536 or E > 65536:
        raise ProfileError(f"{where}: STRP header says {L} layers x {E} experts")
    if n > L * E:
        raise ProfileError(f"{where}: STRP ranks {n} pairs of a {L} x {E} model")
    need = 24 + 4 * n + 4 * L * E
    if len(data) != need:
        raise ProfileError(f"{where}: STRP file is {len(data)} bytes; its header implies {need}")
    raw = np.frombuffer(data, dtype="<u2", count=2 * n, offset=24).reshape(n, 2)
    seen = [(int(l), int(e)) for l, e in raw]
    pairs = complete_ranking(L, E, seen, where)
    table = np.frombuffer(data, dtype="<i4", count=L * E, offset=24 + 4 * n).reshape(L, E)
    expect = np.full((L, E), -1, dtype=np.int64)
    if n:
        expect[raw[:, 0], raw[:, 1]] = np.arange(n)
    if not np.array_equal(table, expect):
        raise ProfileError(f"{where}: STRP rank table disagrees with its ranked pair list")
    return Profile(L, E, pairs, None)


def _parse_heat(data: bytes, where: str) -> Profile:
    if len(data) < 12:
        raise ProfileError(f"{where}: colibri heat header truncated ({len(data)} bytes, need 12)")
    _, L, E = struct.unpack_from("<3I", data)
    if L == 0 or E == 0:
        raise ProfileError(f"{where}: colibri heat file says {L} layers x {E} experts")
    need = 12 + 4 * L * E
    if len(data) != need:
        raise ProfileError(f"{where}: colibri heat file is {len(data)} bytes; its header implies {need}")
    counts = np.frombuffer(data, dtype="<u4", count=L * E, offset=12).reshape(L, E).astype(np.int64)
    return Profile.from_counts(counts)
