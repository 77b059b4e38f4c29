"""docs/cli.md is the argparse parsers' own text (cluster/commands/cli_docs.py writes it), and the
docs name only flags the commands have."""
from __future__ import annotations

import difflib
import re
from pathlib import Path

from moeray.cluster.commands import cli_docs

ROOT = Path(__file__).resolve().parents[2]


def test_docs_cli_md_is_what_the_parsers_print_now():
    want = cli_docs.render()
    got = (ROOT / "docs" / "cli.md").read_text()
    if got != want:
        diff = "".join(list(difflib.unified_diff(got.splitlines(True), want.splitlines(True),
                                                 "docs/cli.md", "the parsers"))[:40])
        raise AssertionError(f"docs/cli.md is stale; regenerate it with `{cli_docs.REGENERATE}`\n{diff}")


def _flags(p) -> set[str]:
    return {s for a in p._actions for s in a.option_strings}


def test_every_flag_of_every_command_is_in_the_reference():
    text = cli_docs.render()
    parsers = {f"moeray {name}": p for name, p in cli_docs.subcommand_parsers().items()}
    parsers.update({f"moeray profile {name}": p
                    for name, p in cli_docs._nested(parsers["moeray profile"]).items()})
    for prog, p in parsers.items():
        assert f"`{prog}`\n" in text, f"the reference has no section for {prog}"
        section = text.split(f"`{prog}`\n", 1)[1]
        missing = [f for f in _flags(p) - {"-h", "--help"} if f"`{f}" not in section and f", {f}" not in section]
        assert not missing, f"{prog}: {missing} not in docs/cli.md's section"


def test_the_reference_does_not_depend_on_the_terminal_or_the_environment(monkeypatch):
    want = cli_docs.render()
    monkeypatch.setenv("COLUMNS", "40")
    monkeypatch.setenv("MOERAY_API_KEY", "a-secret-key")
    got = cli_docs.render()
    assert "a-secret-key" not in got
    assert got == want


# `moeray CMD ... --flag` in a code span or a code line of the README and docs/
COMMAND = re.compile(r"moeray (serve|run|generate|logits|plan|profile (?:make|record|show))\b([^`\n]*)")


def test_the_readme_and_docs_name_only_flags_the_commands_have():
    parsers = dict(cli_docs.subcommand_parsers())
    parsers.update({f"profile {n}": p for n, p in cli_docs._nested(parsers["profile"]).items()})
    wrong = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for line_no, line in enumerate(path.read_text().splitlines(), 1):
            for command, rest in COMMAND.findall(line):
                rest = re.split(r"[;|\"']", rest)[0]  # one command: up to the next one, a table cell or a quote (either kind)
                for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", rest):
                    if flag not in _flags(parsers[command]):
                        wrong.append(f"{path.relative_to(ROOT)}:{line_no}: moeray {command} has no {flag}")
    assert not wrong, "\n".join(wrong)
