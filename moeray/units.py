"""Byte sizes as people write them: '12GiB' in, '12.00 GiB' out. Shared by the CLI, the stages'
ledgers and the planner's printed decisions (torch-free, like moeray.errors)."""
from __future__ import annotations

import re

from moeray.errors import MoerayError

GiB, MiB, KiB = 1 << 30, 1 << 20, 1 << 10
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 1000**2,
          "mib": 1 << 20, "g": GiB, "gb": 1000**3, "gib": GiB, "t": 1 << 40, "tb": 1000**4, "tib": 1 << 40}


def parse_size(text: str, error: type[MoerayError] = MoerayError, allow_zero: bool = False) -> int:
    """'12GiB' -> 12884901888; '1.5G' (binary, as nvidia-smi counts) and '800MB' (decimal) work
    too. Raises `error` naming the text on anything else."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise error(f"cannot read size '{text}': write a number with a unit, e.g. 12GiB, 800MiB, 7.5GB")
    n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n < 0 or (n == 0 and not allow_zero):
        raise error(f"size '{text}' must be positive")
    return n


def parse_sizes(text: str) -> list[int]:
    """'12GiB,12GiB,8GiB,8GiB' -> four byte budgets (the --simulate-devices argument)."""
    parts = [p for p in text.split(",") if p.strip()]
    if not parts:
        raise MoerayError("--simulate-devices needs at least one size, e.g. 12GiB,8GiB")
    return [parse_size(p) for p in parts]


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
