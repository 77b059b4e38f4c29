"""One writer for every bench's `--json PATH`: the figures, and beside them the command that made
them, the commit it ran at and the date, so that a table rendered from the file
(bench/render_docs.py) can always say how to make its rows again.

    from results import write_results
    write_results(args.json, {"rows": rows, ...})   # a dict payload keeps its keys
    write_results(args.json, rows)                  # a list payload goes under "rows"

The file is `{"run": {...}, **payload}`. `run` holds:
- `command`: the bench as it was called, made portable (the repository's own paths relative,
  the home directory as `~`), so that it can be pasted on another machine from the repository root;
- `commit`: `git rev-parse --short=10 HEAD` of the repository, `dirty` when tracked files differ
  from it (None outside a git checkout);
- `date`: UTC, ISO 8601; `machine`: CPU count, architecture and the load average at the end
  (the docs never quote these two; they say how loud the machine was).
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTHON = ".venv/bin/python"


def portable(arg: str) -> str:
    """`arg` with this machine's paths taken out: the repository's own paths made relative to its
    root, anything else under the home directory written from `~`. A `--flag=PATH` keeps its flag."""
    flag, eq, value = arg.partition("=") if arg.startswith("--") else ("", "", arg)
    if not value.startswith("/"):
        return arg
    path = Path(value)
    home = Path.home()
    if path == ROOT or ROOT in path.parents:
        value = str(path.relative_to(ROOT)) if path != ROOT else "."
    elif home != Path("/") and (path == home or home in path.parents):
        value = "~" if path == home else "~/" + str(path.relative_to(home))
    return flag + eq + value


def quote(word: str) -> str:
    """shlex.quote, but a leading `~/` stays outside the quotes so that the shell still expands it."""
    return "~/" + shlex.quote(word[2:]) if word.startswith("~/") else shlex.quote(word)


def command(argv: list[str] | None = None) -> str:
    """The bench's command line, runnable from the repository root with the project's venv."""
    argv = list(sys.argv if argv is None else argv)
    script = portable(str(Path(argv[0]).resolve())) if argv else ""
    return " ".join(quote(w) for w in [PYTHON, script, *(portable(a) for a in argv[1:])])


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def run_record(argv: list[str] | None = None) -> dict:
    """What made a results file: command, commit (dirty or not), date, machine."""
    commit = _git("rev-parse", "--short=10", "HEAD")
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no")) if commit else None
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {"command": command(argv), "commit": commit, "dirty": dirty,
            "date": datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat(),
            "machine": {"cpus": os.cpu_count(), "arch": platform.machine(),
                        "load_average": [round(x, 2) for x in load] if load else None}}


def portable_values(value):
    """`value` with every string that is a path made portable (a model file under the home directory
    becomes `~/...`): a results file kept in the repository names no one machine's folders."""
    if isinstance(value, str):
        if value.startswith("/"):
            return portable(value)
        # a path inside a line of text (a log line a bench keeps): its words made portable one by one
        return " ".join(portable(w) if w.startswith("/") else w for w in value.split(" ")) if " /" in value else value
    if isinstance(value, dict):
        return {k: portable_values(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [portable_values(v) for v in value]
    return value


def write_results(path: str | os.PathLike, payload, argv: list[str] | None = None) -> dict:
    """Write `payload` (a dict, or a list of rows) with its run record to `path`; returns what was written."""
    body = portable_values(dict(payload) if isinstance(payload, dict) else {"rows": list(payload)})
    if "run" in body:
        raise ValueError("a results payload may not carry its own 'run' key: the writer adds it")
    data = {"run": run_record(argv), **body}
    Path(path).write_text(json.dumps(data, indent=1, default=str) + "\n")
    return data


def read_results(path: str | os.PathLike) -> dict:
    """A results file as written by write_results (a file without a run record is refused: a figure
    without its command is not one the docs may quote)."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or not isinstance(data.get("run"), dict) or not data["run"].get("command"):
        raise ValueError(f"{path}: not a results file (no run record with its command); "
                         "write it with a bench's --json, never by hand")
    return data


def compact_memory() -> None:
    """Ask the kernel for contiguous memory before a big model loads (root only; skipped otherwise):
    a process that maps or copies gigabytes right after another freed them gets few 2 MiB pages and
    runs slower, so each server or run of a side-by-side bench starts from compacted memory."""
    try:
        with open("/proc/sys/vm/compact_memory", "w") as f:
            f.write("1")
    except OSError:
        pass
