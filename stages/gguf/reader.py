"""GGUF files: the header and tensor directory, validation, and memory-mapped tensor bytes.

Torch-free (numpy + gguf only): the planner and the CLI read headers with it.

The header parser is our own (about sixty lines of the spec) rather than gguf.GGUFReader, because
the reader maps every tensor at open and so cannot read a file that holds only the header and
tensor directory, which is what `moeray plan` is given for models too big to copy around.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from moeray.stages.arch import arch_of, config_from_metadata
from moeray.stages.arch.config import ModelConfig
from moeray.errors import (GGUFError, MissingTensorError, ModelPartsError, NotGGUFError, TensorShapeError,
                           TruncatedGGUFError, UnsupportedQuantError)
from moeray.stages.gguf.parts import PartInfo, gather_parts, is_in_parts, join_tensors

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# Weight formats moeray dequantises (stages/gguf/quant.py has fast paths for the common ones and falls
# back to gguf.quants for the rest).
SUPPORTED_TYPES = frozenset(GGMLQuantizationType[n] for n in (
    "F32", "F16", "BF16", "F64", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
    "Q6_K", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M", "IQ4_NL", "IQ4_XS",
    "TQ1_0", "TQ2_0", "MXFP4"))

EXPERT_KINDS = ("gate", "up", "down")


@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy/PyTorch order, outermost first
    ggml_type: GGMLQuantizationType
    offset: int  # absolute offset of the data in its part's file
    n_bytes: int
    part: int = 0  # the part (file) that holds it: 0 for a model in one file


@dataclass
class GGUFHeader:
    """A model's metadata and tensor directory: of its one file, or the union of its parts'."""
    path: str  # the file (the first part of a model in parts)
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    arch: str
    config: ModelConfig
    data_offset: int = 0  # where tensor data starts (in the first part)
    header_bytes: int = 0  # bytes of magic + metadata + tensor directory (before alignment padding)
    parts: list[PartInfo] = field(default_factory=list)  # one per file, in order

    @property
    def in_parts(self) -> bool:
        return len(self.parts) > 1

    def stage_tensors(self, first: int, end: int) -> list[str]:
        """The tensors a stage over layers [first, end) reads: its layers' (trunk and experts),
        the embedding where it is first, the head where it is last (and the embedding matrix a
        tied head reuses), and tensors of no layer (rope factors) everywhere."""
        last = end >= self.config.n_layers
        out = []
        for name in self.tensors:
            role, layer = tensor_role(name)
            if layer is not None:
                wanted = first <= layer < end
            elif role == "embedding":
                wanted = first == 0 or (last and self.config.tie_embeddings)
            elif role == "head":
                wanted = last
            else:
                wanted = True
            if wanted:
                out.append(name)
        return out

    def stage_parts(self, first: int, end: int) -> list[int]:
        """The parts (0-based) holding the tensors a stage over layers [first, end) reads."""
        return sorted({self.tensors[n].part for n in self.stage_tensors(first, end)})

    def part_holds(self, index: int) -> str:
        """What part `index` holds, for a reader: 'layers 3-7', 'layers 0-5, embedding', 'metadata only'."""
        layers, extra = set(), []
        for name, t in self.tensors.items():
            if t.part != index:
                continue
            role, layer = tensor_role(name)
            if layer is not None and layer < self.config.n_layers:
                layers.add(layer)
            elif role in ("embedding", "head") and role not in extra:
                extra.append(role)
        span = [f"layers {min(layers)}-{max(layers)}" if len(layers) > 1 else f"layer {min(layers)}"] if layers else []
        return ", ".join(span + sorted(extra)) or "metadata only"

    def layers_within(self, parts) -> list[int]:
        """The layers all of whose tensors lie in `parts`."""
        parts = set(parts)
        out = set(range(self.config.n_layers))
        for name, t in self.tensors.items():
            layer = tensor_role(name)[1]
            if layer is not None and t.part not in parts:
                out.discard(layer)
        return sorted(out)

    def expert_bytes(self, layer: int) -> int:
        """Bytes of one routed expert (gate + up + down) of `layer` as stored; 0 for a dense layer."""
        return expert_bytes(self.tensors, layer)

    def trunk_bytes(self) -> dict:
        return trunk_bytes(self.tensors, self.config)

    def token_bytes(self) -> int:
        """Weight bytes one decode token reads as stored: every layer's trunk and the head once,
        k routed experts per MoE layer (the embedding's one row aside)."""
        t, cfg = self.trunk_bytes(), self.config
        return sum(t["layers"]) + t["head"] + cfg.n_experts_used * sum(
            self.expert_bytes(l) for l in range(cfg.n_layers))


# --- header parsing -------------------------------------------------------------------------

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
            12: "<d"}
_NP_SCALARS = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
               6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


class _Cursor:
    """Reads the header straight from the file, pulling more bytes as the parse needs them (a
    header with a big tokenizer is megabytes; the tensor data behind it is never read)."""

    def __init__(self, f, path: str, size: int):
        self.f, self.path, self.size = f, path, size
        self.buf, self.pos = b"", 0

    def need(self, n: int) -> None:
        if self.pos + n <= len(self.buf):
            return
        if self.pos + n > self.size:
            raise TruncatedGGUFError(
                f"{self.path}: the file ends inside its GGUF header (at byte {self.size}); "
                "it was cut short while copying or downloading; fetch it again")
        want = max(self.pos + n - len(self.buf), len(self.buf), 1 << 20)
        self.f.seek(len(self.buf))
        self.buf += self.f.read(want)

    def unpack(self, fmt: str):
        n = struct.calcsize(fmt)
        self.need(n)
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += n
        return v

    def string(self) -> str:
        n = self.unpack("<Q")
        self.need(n)
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def strings(self, count: int) -> list[str]:
        out, unpack = [], struct.unpack_from
        for _ in range(count):
            if self.pos + 8 > len(self.buf):
                self.need(8)
            n = unpack("<Q", self.buf, self.pos)[0]
            start = self.pos + 8
            if start + n > len(self.buf):
                self.need(8 + n)
            out.append(self.buf[start:start + n].decode("utf-8", errors="replace"))
            self.pos = start + n
        return out

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.unpack("<I"), self.unpack("<Q")
            if etype in _NP_SCALARS:
                dt = np.dtype(_NP_SCALARS[etype])
                self.need(count * dt.itemsize)
                arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos).tolist()
                self.pos += count * dt.itemsize
                return arr
            if etype == _STRING:  # token lists and merges: hundreds of thousands of strings
                return self.strings(count)
            return [self.value(etype) for _ in range(count)]
        raise NotGGUFError(f"{self.path}: unknown GGUF metadata value type {vtype}; the file is corrupt "
                           "or from a newer GGUF version than moeray knows")


def _tensor_nbytes(path: str, name: str, dims: tuple[int, ...], ggml_type: GGMLQuantizationType) -> int:
    block, type_size = GGML_QUANT_SIZES[ggml_type]
    n = int(np.prod(dims, dtype=np.int64)) if dims else 1
    if dims and dims[0] % block:  # dims are innermost first: dims[0] is the row
        raise TensorShapeError(f"{path}: tensor '{name}' has a row of {dims[0]} values, not a multiple "
                               f"of the {ggml_type.name} block size {block}; the file is corrupt")
    return n // block * type_size


@dataclass
class _Directory:
    """One file's header as parsed: its metadata and tensor directory (no config yet)."""
    path: str
    size: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    data_offset: int
    header_bytes: int
    kv_span: tuple[int, int]  # where the metadata key/values lie in the file (the splitter copies them)

    def part_info(self, index: int = 0, count: int = 1) -> PartInfo:
        end = max((t.offset + t.n_bytes for t in self.tensors.values()), default=self.data_offset)
        return PartInfo(self.path, index, count, len(self.tensors), self.data_offset, self.header_bytes, end,
                        self.size)


def _parse(f, path: str, size: int) -> _Directory:
    cur = _Cursor(f, path, size)
    cur.need(min(4, size))
    if size < 4 or cur.buf[:4] != GGUF_MAGIC:
        head = cur.buf[:4]
        raise NotGGUFError(f"{path}: not a GGUF file (starts with {head!r}, expected b'GGUF'); "
                           "pass a .gguf model (convert safetensors with llama.cpp's convert_hf_to_gguf.py)")
    cur.pos = 4
    version = cur.unpack("<I")
    if version not in (2, 3):
        hint = " (a big-endian file?)" if version > 0xFFFF else ""
        raise NotGGUFError(f"{path}: GGUF version {version}{hint} is not supported; moeray reads little-endian "
                           "GGUF v2 and v3 (re-convert with a current llama.cpp)")
    n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
    kv_start = cur.pos
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        meta[key] = cur.value(cur.unpack("<I"))
    kv_end = cur.pos
    raw_infos = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.unpack("<I")
        dims = tuple(cur.unpack("<Q") for _ in range(n_dims))
        type_id = cur.unpack("<I")
        rel = cur.unpack("<Q")
        raw_infos.append((name, dims, type_id, rel))
    header_bytes = cur.pos
    align = int(meta.get("general.alignment", DEFAULT_ALIGNMENT))
    data_offset = (header_bytes + align - 1) // align * align

    tensors: dict[str, TensorInfo] = {}
    for name, dims, type_id, rel in raw_infos:
        try:
            gtype = GGMLQuantizationType(type_id)
        except ValueError:
            raise UnsupportedQuantError(
                f"{path}: tensor '{name}' has ggml type id {type_id}, which moeray does not know; "
                f"re-quantise the model to one of {_supported_names()}") from None
        # GGUF stores dims innermost first; numpy order is outermost first.
        shape = tuple(int(d) for d in reversed(dims))
        tensors[name] = TensorInfo(name, shape, gtype, data_offset + rel, _tensor_nbytes(path, name, dims, gtype))
    return _Directory(path, size, meta, tensors, data_offset, header_bytes, (kv_start, kv_end))


def _read_directory(path: str) -> _Directory:
    """One file's metadata and tensor directory (a part of a model is read alone)."""
    if not os.path.exists(path):
        raise GGUFError(f"{path}: no such file")
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise NotGGUFError(f"{path}: not a GGUF file (it is empty)")
        return _parse(f, path, size)


def _supported_names() -> str:
    return ", ".join(sorted(t.name for t in SUPPORTED_TYPES))


def read_gguf_header(path: str | os.PathLike) -> GGUFHeader:
    """Metadata, tensor directory and config. Works on a file holding ONLY the header and directory.

    A model in parts (llama.cpp's gguf-split) is read from any of its parts: the parts are found
    beside it by name, checked (stages/gguf/parts.py) and their directories joined; each tensor
    records its part. Only headers are read, so header-only copies of the parts are enough."""
    path = os.fspath(path)
    given = _read_directory(path)
    if is_in_parts(given.metadata):
        dirs = gather_parts(path, given, _read_directory)
        tensors = join_tensors(dirs)
        count = len(dirs)
        parts = [d.part_info(i, count) for i, d in enumerate(dirs)]
        first = dirs[0]
    else:
        first, tensors, parts = given, given.tensors, [given.part_info()]
    shapes = {n: t.shape for n, t in tensors.items()}
    config = config_from_metadata(first.metadata, shapes, first.path)
    return GGUFHeader(path=first.path, metadata=first.metadata, tensors=tensors, arch=config.arch, config=config,
                      data_offset=first.data_offset, header_bytes=first.header_bytes, parts=parts)


def write_header_only(src: str | os.PathLike, dst: str | os.PathLike) -> int:
    """Copy just the header + tensor directory of the file `src` to `dst` (what `moeray plan`
    needs). One file: a model in parts needs each part's, under its own name (`moeray plan
    --headers-to`). Returns bytes."""
    d = _read_directory(os.fspath(src))
    with open(src, "rb") as f:
        data = f.read(d.header_bytes)
    with open(dst, "wb") as f:
        f.write(data)
    return len(data)


# --- the expected tensors of an architecture -----------------------------------------------

def expected_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the engine reads, with its numpy shape: its architecture's table."""
    return arch_of(cfg).tensors(cfg)


def _shape_matches(actual: tuple[int, ...], expected: tuple[int, ...]) -> bool:
    # ffn_gate_inp_shexp is stored as [H] by llama.cpp; some writers keep HF's [1, H].
    return actual == expected or (len(expected) == 1 and actual == (1,) + expected)


# --- the full, memory-mapped file ----------------------------------------------------------

_LAYOUTS: dict[tuple, tuple] = {}


def _layout(path: str) -> tuple[int, dict[str, tuple[int, int]]]:
    """(data offset, {tensor: (offset, bytes)}) of one file as it is now; kept per process while the
    file is unchanged (a stage checks its files at probe, check and load: one parse)."""
    st = os.stat(path)
    key = (path, st.st_size, st.st_mtime_ns, st.st_ino)
    if key not in _LAYOUTS:
        d = _read_directory(path)
        _LAYOUTS[key] = (d.data_offset, {n: (t.offset, t.n_bytes) for n, t in d.tensors.items()})
    return _LAYOUTS[key]


class GGUFFile:
    """A validated GGUF model, memory-mapped. Tensor bytes are views into the mapping (no copies).

    A model in parts maps each part on first use: a stage that reads layers [a, b) opens only the
    parts holding them (`opened`), and each tensor's view is into its own part's mapping, so
    nothing after loading knows there were parts. `parts` (0-based indices, default all) are the
    ones checked at once, before anything loads: present, long enough, and, where the header came
    from elsewhere (the driver's), holding the directory that header says. `header`: the model's
    header when the caller has it (a stage gets the driver's), else read from `path`.

    `touched` records every tensor name whose bytes were handed out, so a loader can be held to
    reading only its layer range.
    """

    def __init__(self, path: str | os.PathLike, header: GGUFHeader | None = None, parts=None):
        shipped = header is not None
        header = header if shipped else read_gguf_header(path)
        self.path = header.path
        self.header = header
        self.metadata = header.metadata
        self.tensors = header.tensors
        self.config = header.config
        self.arch = header.arch
        self.parts = header.parts
        self.touched: set[str] = set()
        self._maps: dict[int, np.memmap] = {}
        self._checked: set[int] = set()
        self._shipped = shipped
        self._validate()
        for i in (range(len(self.parts)) if parts is None else parts):
            self.check_part(i)

    @property
    def opened(self) -> list[int]:
        """The parts mapped so far (0-based)."""
        return sorted(self._maps)

    def check_part(self, i: int) -> None:
        """Part `i` is here, complete, and (for a header read elsewhere) the same file: one line
        naming the file and the fix if not."""
        if i in self._checked:
            return
        p = self.parts[i]
        which = f"part {i + 1} of {len(self.parts)}: " if len(self.parts) > 1 else ""
        if not os.path.exists(p.path):
            raise ModelPartsError(f"{p.path}: missing ({which}{self.header.part_holds(i)}); fetch it to this path")
        size = os.path.getsize(p.path)
        if size < p.data_end:
            raise TruncatedGGUFError(
                f"{p.path}: truncated: {which}the tensor directory needs {p.data_end} bytes but the file has {size} "
                f"({p.data_end - size} missing); it was cut short while copying or downloading; fetch it again")
        if self._shipped:
            mine = (p.data_offset, {n: (t.offset, t.n_bytes) for n, t in self.tensors.items() if t.part == i})
            if _layout(p.path) != mine:
                raise ModelPartsError(
                    f"{p.path}: not the file the model's header describes ({which}its tensor directory differs): "
                    "another model or quantisation under this name; copy the right file here")
        self._checked.add(i)


    def _map_of(self, t: TensorInfo) -> np.memmap:
        m = self._maps.get(t.part)
        if m is None:
            self.check_part(t.part)
            m = self._maps[t.part] = np.memmap(self.parts[t.part].path, dtype=np.uint8, mode="r")
        return m

    def _where(self, name: str) -> str:
        """' (in NAME-00002-of-00004.gguf)' for a model in parts, else ''."""
        t = self.tensors[name]
        return f" (in {self.parts[t.part].name})" if len(self.parts) > 1 else ""

    def _validate(self) -> None:
        p = self.path
        for name, expected in expected_tensor_shapes(self.config).items():
            info = self.tensors.get(name)
            if info is None:
                raise MissingTensorError(
                    f"{p}: tensor '{name}' is missing; a {self.arch} model with these metadata needs it "
                    "(the file is incomplete or was written by an incompatible converter)")
            if not _shape_matches(info.shape, expected):
                hint = "; a part of another model? fetch the parts from one release" if len(self.parts) > 1 else ""
                raise TensorShapeError(
                    f"{p}: tensor '{name}'{self._where(name)} has shape {info.shape}, expected {expected} from the "
                    f"metadata ({self.arch}); the metadata and weights disagree, re-convert the model{hint}")
            if info.ggml_type not in SUPPORTED_TYPES:
                raise UnsupportedQuantError(
                    f"{p}: tensor '{name}' is stored as {info.ggml_type.name}, which moeray cannot dequantise; "
                    f"re-quantise the model to one of {_supported_names()}")

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise MissingTensorError(f"{self.path}: tensor '{name}' is not in the file") from None

    def has(self, name: str) -> bool:
        return name in self.tensors

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a uint8 view of its part's mapping (no copy)."""
        t = self.info(name)
        m = self._map_of(t)
        self.touched.add(name)
        return m[t.offset:t.offset + t.n_bytes]

    def read_into(self, name: str, dst: torch.Tensor) -> None:
        """Read the tensor's bytes from the file into `dst` (contiguous uint8, as many bytes): the
        kernel copies from the page cache, where reading through the mapping would fault in
        every 4 KiB page of it first (~1 s for the default model's experts, ~30 s at 30B)."""
        t = self.info(name)
        self._map_of(t)  # checked, and counted as opened
        self.touched.add(name)
        view = memoryview(dst.numpy()).cast("B")
        if len(view) != t.n_bytes:
            raise ValueError(f"{name}: {t.n_bytes} bytes into a buffer of {len(view)}")
        path = self.parts[t.part].path
        fd = os.open(path, os.O_RDONLY)
        try:
            done = 0
            while done < t.n_bytes:
                n = os.preadv(fd, [view[done:]], t.offset + done)
                if n <= 0:
                    raise TruncatedGGUFError(f"{path}: the file ended inside tensor '{name}'; fetch it again")
                done += n
        finally:
            os.close(fd)

    def expert_raw(self, layer: int, kind: str, expert: int, part: str = "weight") -> np.ndarray:
        """One expert's slab of blk.{layer}.ffn_{kind}_exps.{part} (experts are the outermost dim;
        part "bias": its per-expert bias row, where the file has one)."""
        if kind not in EXPERT_KINDS:
            raise ValueError(f"expert kind must be one of {EXPERT_KINDS}, not {kind!r}")
        name = f"blk.{layer}.ffn_{kind}_exps.{part}"
        t = self.info(name)
        n_exp = t.shape[0]
        if not 0 <= expert < n_exp:
            raise IndexError(f"{self.path}: layer {layer} has {n_exp} experts, no expert {expert}")
        per = t.n_bytes // n_exp
        m = self._map_of(t)
        self.touched.add(name)
        start = t.offset + expert * per
        return m[start:start + per]

    def dequantize(self, name: str) -> np.ndarray:
        """The tensor as float32 in TensorInfo.shape."""
        from gguf.quants import dequantize as gguf_dequantize
        t = self.info(name)
        raw = self.raw(name)
        if t.ggml_type == GGMLQuantizationType.F32:
            return np.array(raw.view(np.float32).reshape(t.shape))
        rows = np.asarray(raw).reshape(-1, _row_bytes(t))
        return gguf_dequantize(rows, t.ggml_type).astype(np.float32, copy=False).reshape(t.shape)

    def expert_bytes(self, layer: int) -> int:
        """Bytes of one routed expert (gate + up + down) of `layer` as stored; 0 for a dense layer."""
        return expert_bytes(self.tensors, layer)

    def trunk_bytes(self) -> dict:
        return trunk_bytes(self.tensors, self.config)

    def __repr__(self) -> str:
        return f"GGUFFile({self.path!r}, arch={self.arch}, layers={self.config.n_layers})"


def _row_bytes(t: TensorInfo) -> int:
    block, type_size = GGML_QUANT_SIZES[t.ggml_type]
    return t.shape[-1] // block * type_size if t.shape else type_size


def is_routed_expert(name: str) -> bool:
    """A routed expert's weight, or its per-expert bias (gpt-oss): both live in the expert's slot."""
    return name.endswith(("_exps.weight", "_exps.bias"))


def tensor_role(name: str) -> tuple[str, int | None]:
    """Where a tensor belongs: ("expert", layer), ("layer", layer) for a layer's dense trunk,
    ("embedding", None), ("head", None) or ("other", None). The one classifier the loader, the
    memory report and the planner's pricing share."""
    if name.startswith("blk."):
        layer = int(name.split(".")[1])
        return ("expert" if is_routed_expert(name) else "layer"), layer
    if name == "token_embd.weight":
        return "embedding", None
    if name in ("output.weight", "output_norm.weight"):
        return "head", None
    return "other", None


def held_as_float(name: str, t: TensorInfo) -> bool:
    """Vectors (norms, biases) and routers are held as float32 copies: they are small and the
    router's softmax wants full precision (so are per-expert bias rows, [E, F] but vectors per
    expert). Everything else is held in its stored block form."""
    return len(t.shape) == 1 or ".ffn_gate_inp" in name or name.endswith(".bias")


def held_bytes(name: str, t: TensorInfo, backend: str | None = "quantised") -> int:
    """Bytes a stage's copy of a tensor holds: its stored bytes (backend None: as in the file), the
    stored bytes on the quantised backends except float32 vectors and routers, float32 on the exact
    backend (the debugging backend dequantises everything once)."""
    if backend is None:
        return t.n_bytes
    n = 1
    for d in t.shape:
        n *= d
    if backend == "exact" or held_as_float(name, t):
        return 4 * n
    return t.n_bytes


def trunk_bytes(tensors: dict[str, TensorInfo], cfg: ModelConfig, backend: str | None = None) -> dict:
    """Bytes of everything that is not a routed expert: the embedding, the head (output_norm +
    output, or output_norm + token_embd when tied, since the last stage must then hold a copy of the
    embedding matrix), and each layer's dense part (attention, norms, router, shared expert).
    backend None: as stored in the file; else as a stage holds them on that backend (`held_bytes`)."""
    layers = [0] * cfg.n_layers
    emb = head = 0
    for name, t in tensors.items():
        role, layer = tensor_role(name)
        n = held_bytes(name, t, backend)
        if role == "layer" and layer < cfg.n_layers:
            layers[layer] += n
        elif role == "embedding":
            emb += n
        elif role == "head":
            head += n
    if cfg.tie_embeddings:
        head += emb
    return {"embedding": emb, "head": head, "layers": layers}


# The trunk pieces a layer's bytes are reported in (the planner's [place] lines): llama.cpp's tensor
# names, first match wins; "dnproj" is a DeltaNet layer's fused input projection and its output.
_PIECES = (("dnproj", ("attn_qkv.", "attn_gate.", "ssm_ba.", "ssm_beta.", "ssm_alpha.", "ssm_out.")),
           ("attn", ("attn_q.", "attn_k.", "attn_v.", "attn_output.")),
           ("shexp", ("_shexp.",)), ("router", ("ffn_gate_inp.",)), ("ffn", ("ffn_gate.", "ffn_up.", "ffn_down.")))


def trunk_pieces(tensors: dict[str, TensorInfo], cfg: ModelConfig, backend: str | None = None) -> list[dict[str, int]]:
    """Each layer's trunk bytes (as `trunk_bytes` counts them) split into named pieces; what no
    piece names (norms, conv kernels, biases, sinks) is "other"."""
    out: list[dict[str, int]] = [{} for _ in range(cfg.n_layers)]
    for name, t in tensors.items():
        role, layer = tensor_role(name)
        if role != "layer" or layer >= cfg.n_layers:
            continue
        piece = next((p for p, keys in _PIECES if any(k in name for k in keys)), "other")
        out[layer][piece] = out[layer].get(piece, 0) + held_bytes(name, t, backend)
    return out


def expert_bytes(tensors: dict[str, TensorInfo], layer: int, backend: str | None = None) -> int:
    """Bytes of one routed expert of `layer` as stored (backend None or a quantised backend: a slot
    holds exactly these bytes) or as float32 (the exact backend)."""
    total = 0
    for kind in EXPERT_KINDS:
        for part in ("weight", "bias"):  # a per-expert bias row travels with its expert
            name = f"blk.{layer}.ffn_{kind}_exps.{part}"
            t = tensors.get(name)
            if t is not None:
                total += held_bytes(name, t, backend) // t.shape[0]
    return total
