"""Models in parts: the layout llama.cpp's `gguf-split` writes, as big models are published.

A model cut by gguf-split is N files named `NAME-00001-of-0000N.gguf` ... `NAME-0000N-of-0000N.gguf`.
Each is a valid GGUF with three keys of its own: `split.no` (0-based), `split.count` (N) and
`split.tensors.count` (the tensors of the whole model). The first part holds the model's metadata;
the tensors are spread over the parts in the order of the whole file, each part with its own
tensor directory and data offsets, no tensor ever cut in two.

Any part names the model (llama.cpp insists on the first; moeray finds the first by name). The
parts are found beside it by that name and checked before anything is loaded: the count, that
every part carries the same `split.count` and tensor total, none missing, renamed or a copy of
another, no tensor in two parts, the total found equal to the total announced. Each problem is one
line naming the file and the fix. The reader (stages/gguf/reader.py) joins the parts' directories
into one header; a stage then maps only the parts that hold its tensors (GGUFFile, `parts=`).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Callable

from moeray.errors import ModelPartsError

# llama.cpp's llama_split_path: "%s-%05d-of-%05d.gguf" with the 1-based part number.
_PART_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS = "split.no", "split.count", "split.tensors.count"


@dataclass(frozen=True)
class PartInfo:
    """One file of a model: for a model in one file, the file itself (index 0 of 1)."""
    path: str
    index: int  # split.no: 0-based
    count: int  # split.count
    n_tensors: int  # tensors in this part
    data_offset: int  # where its tensor data starts
    header_bytes: int  # its magic + metadata + tensor directory
    data_end: int  # bytes a complete copy holds at least: the end of its last tensor's data
    size: int  # bytes of the file where the header was read (a header-only copy holds fewer than data_end)

    @property
    def name(self) -> str:
        return os.path.basename(self.path)


def split_name(path: str) -> tuple[str, int, int] | None:
    """(prefix, 0-based index, count) of a path named as gguf-split names parts, else None."""
    m = _PART_NAME.match(os.fspath(path))
    if m is None:
        return None
    return m.group("prefix"), int(m.group("no")) - 1, int(m.group("count"))


def part_path(prefix: str, index: int, count: int) -> str:
    """The path gguf-split gives part `index` (0-based) of `count`."""
    return f"{prefix}-{index + 1:05d}-of-{count:05d}.gguf"


def model_stem(path: str) -> str:
    """The model's name without the part suffix: `NAME` for `dir/NAME-00002-of-00004.gguf`."""
    named = split_name(path)
    base = os.path.basename(named[0] if named else os.fspath(path))
    return base[:-5] if base.endswith(".gguf") else base


def first_part_path(path: str) -> str:
    """The first part of the model `path` names (itself when it is not named as a part)."""
    named = split_name(path)
    return part_path(named[0], 0, named[2]) if named and named[2] > 1 else os.fspath(path)


def _split_keys(meta: dict[str, Any]) -> tuple[int, int, int | None]:
    return (int(meta.get(SPLIT_NO, 0) or 0), int(meta.get(SPLIT_COUNT, 0) or 0),
            None if meta.get(SPLIT_TENSORS) is None else int(meta[SPLIT_TENSORS]))


def is_in_parts(meta: dict[str, Any]) -> bool:
    return _split_keys(meta)[1] > 1


def gather_parts(path: str, given: Any, read: Callable[[str], Any]) -> list[Any]:
    """Every part's directory, in order, from the directory `given` of the file `path` (any part).

    `read(path)` parses one file's header (reader._read_directory); the directories it returns have
    `.metadata` and `.path`. Raises ModelPartsError, one line naming the file at fault and the fix.
    """
    index, count, total = _split_keys(given.metadata)
    named = split_name(path)
    if named is None:
        raise ModelPartsError(
            f"{path}: part {index + 1} of a model in {count} parts (split.count {count}), but not named as "
            f"gguf-split names parts (NAME-{index + 1:05d}-of-{count:05d}.gguf), so the other parts cannot be "
            "found beside it; give the parts their published names")
    prefix, name_index, name_count = named
    if name_count != count:
        raise ModelPartsError(
            f"{path}: its name says {name_count} parts but split.count says {count}: it was renamed, or belongs to "
            f"another split of the model; fetch it again as {os.path.basename(part_path(prefix, index, count))}")
    if name_index != index:
        raise ModelPartsError(
            f"{path}: its name says part {name_index + 1} of {count} but it holds part {index + 1} (split.no "
            f"{index}): a copy of another part under this name; fetch part {name_index + 1} again")
    paths = [part_path(prefix, i, count) for i in range(count)]
    missing = [p for p in paths if not os.path.exists(p)]
    if missing:
        names = ", ".join(os.path.basename(p) for p in missing)
        raise ModelPartsError(
            f"{missing[0]}: missing: {model_stem(path)} is in {count} parts and {names} "
            f"{'is' if len(missing) == 1 else 'are'} not beside the others in {os.path.dirname(paths[0]) or '.'}; "
            "fetch every part into that folder under its published name")
    dirs = [given if i == index else read(p) for i, p in enumerate(paths)]
    first = dirs[0]
    total = _split_keys(first.metadata)[2]
    for i, d in enumerate(dirs):
        no, n, t = _split_keys(d.metadata)
        if n != count or t != total:
            raise ModelPartsError(
                f"{d.path}: a part of another model: it says {t} tensors in {n} parts where "
                f"{os.path.basename(first.path)} says {total} in {count}; fetch part {i + 1} again from the "
                "same release as the others")
        if no != i:
            raise ModelPartsError(
                f"{d.path}: holds part {no + 1} of {count} (split.no {no}), its name says part {i + 1}: a copy "
                f"of another part under this name; fetch part {i + 1} again")
    return dirs


def join_tensors(dirs: list[Any]) -> dict[str, Any]:
    """The union of the parts' tensor directories (each TensorInfo's `part` set to its part's
    index), checked: no tensor in two parts, as many tensors as split.tensors.count says."""
    tensors: dict[str, Any] = {}
    where: dict[str, str] = {}
    for i, d in enumerate(dirs):
        for name, t in d.tensors.items():
            if name in tensors:
                raise ModelPartsError(
                    f"{d.path}: tensor '{name}' is also in {os.path.basename(where[name])}: these parts come from "
                    "two different splits (or models); fetch every part from the same release")
            t.part = i
            tensors[name] = t
            where[name] = d.path
    total = _split_keys(dirs[0].metadata)[2]
    if total is not None and total != len(tensors):
        raise ModelPartsError(
            f"{dirs[0].path}: the {len(dirs)} parts hold {len(tensors)} tensors but split.tensors.count says "
            f"{total}: a part belongs to another model or split; fetch the parts again from one release")
    return tensors


def stage_parts_lines(header: Any, split: list[tuple[int, int]]) -> list[str]:
    """One `[parts]` line per stage: the parts it reads, what to copy to its node."""
    from moeray.units import format_bytes

    if len(header.parts) <= 1:
        return []
    out = []
    for i, (a, b) in enumerate(split):
        idx = header.stage_parts(a, b)
        size = sum(header.parts[j].data_end for j in idx)
        out.append(f"[parts] stage {i} (layers {a}-{b - 1}) reads {len(idx)} of {len(header.parts)} parts "
                   f"({format_bytes(size)}): {', '.join(header.parts[j].name for j in idx)}")
    return out
