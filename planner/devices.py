"""The cards of a pipeline, in pipeline order, as the planner sees them."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from moeray.errors import PlacementError
from moeray.units import parse_size

# Used when only sizes are given (`--devices 12GiB,8GiB`): a plausible mid-range card.
DEFAULT_LAYER_MS = 1.0
DEFAULT_MISS_MS = 0.5

@dataclass
class DeviceSpec:
    name: str
    free_bytes: int  # net of reserve, KV cache and scratch
    layer_ms: float = DEFAULT_LAYER_MS  # one dense layer, trunk on the card
    miss_ms: float = DEFAULT_MISS_MS  # one expert computed on the host on a miss

    def __post_init__(self):
        if self.free_bytes < 0 or self.layer_ms < 0 or self.miss_ms < 0:
            raise PlacementError(f"device {self.name}: free_bytes, layer_ms and miss_ms must be >= 0")


def parse_devices(text: str) -> list[DeviceSpec]:
    """`12GiB,12GiB:0.8:0.4,8GiB` -> one device per item: SIZE[:LAYER_MS[:MISS_MS]]."""
    out = []
    for i, item in enumerate(x for x in text.split(",") if x.strip()):
        parts = item.split(":")
        if len(parts) > 3:
            raise PlacementError(f"device {item!r}: write SIZE[:LAYER_MS[:MISS_MS]]")
        try:
            ms = [float(p) for p in parts[1:]]
        except ValueError:
            raise PlacementError(f"device {item!r}: LAYER_MS and MISS_MS are numbers of milliseconds") from None
        out.append(DeviceSpec(f"dev{i}", parse_size(parts[0], PlacementError, allow_zero=True), *ms))
    if not out:
        raise PlacementError("--devices lists no device")
    return out


def load_devices_json(path) -> list[DeviceSpec]:
    try:
        items = json.loads(Path(path).read_text())
        return [DeviceSpec(str(d.get("name", f"dev{i}")), int(d["free_bytes"]),
                           float(d.get("layer_ms", DEFAULT_LAYER_MS)), float(d.get("miss_ms", DEFAULT_MISS_MS)))
                for i, d in enumerate(items)]
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
        raise PlacementError(f"cannot read devices {path}: {exc!r}; expected "
                             '[{"name", "free_bytes", "layer_ms", "miss_ms"}, ...]') from None
