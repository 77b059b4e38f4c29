"""docs/cli.md, written from the `moeray` command's own argparse parsers, so the reference cannot
drift from the flags: `python -m moeray.cluster.commands.cli_docs > docs/cli.md`
(tests/cluster/test_cli_docs.py fails when the file differs from what this prints)."""
from __future__ import annotations

import argparse
import importlib
import sys

from moeray.cluster.cli import SUBCOMMANDS

REGENERATE = "python -m moeray.cluster.commands.cli_docs > docs/cli.md"
WIDTH = 100  # usage lines wrap here whatever the terminal (argparse reads $COLUMNS otherwise)


def _formatter(prog: str) -> argparse.HelpFormatter:
    return argparse.HelpFormatter(prog, width=WIDTH)


def subcommand_parsers() -> dict[str, argparse.ArgumentParser]:
    """Each subcommand's parser as `moeray NAME --help` builds it (cli.py imports only the one
    that runs; here every one)."""
    parsers = {}
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = argparse.ArgumentParser(prog=f"moeray {name}", description=help_text, formatter_class=_formatter)
        importlib.import_module(module).add_arguments(p)
        parsers[name] = p
    return parsers


def _nested(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The actions of a subcommand with its own subcommands (`moeray profile make`), in order."""
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _default(action: argparse.Action) -> str:
    """The parser's own default; none shown where the help says it comes from the environment
    ("default: $MOERAY_API_KEY"): the docs would carry the writer's value, a key among them."""
    d = action.default
    if "$" in (action.help or "") or d is None or d is False or d == argparse.SUPPRESS or isinstance(action, argparse._StoreTrueAction):
        return ""
    return f"`{d}`"


def _options(p: argparse.ArgumentParser) -> list[str]:
    """One table per argument group (positional, options, the groups a command defines)."""
    fmt = _formatter(p.prog)
    out = []
    for group in p._action_groups:
        rows = [a for a in group._group_actions
                if a.help != argparse.SUPPRESS and not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))]
        if not rows:
            continue
        title = "arguments" if group.title == "positional arguments" else group.title
        out += [f"**{title}**", "", "| argument | default | what it does |", "|---|---|---|"]
        for a in rows:
            invocation = fmt._format_action_invocation(a)
            help_text = fmt._expand_help(a) if a.help else ""
            out.append(f"| `{_cell(invocation)}` | {_default(a)} | {_cell(help_text)} |")
        out.append("")
    return out


def _command(p: argparse.ArgumentParser, level: int) -> list[str]:
    out = [f"{'#' * level} `{p.prog}`", ""]
    if p.description:
        out += [p.description, ""]
    out += ["```", p.format_usage().strip(), "```", ""]
    out += _options(p)
    nested = _nested(p)
    for child in nested.values():
        child.formatter_class = _formatter
        out += _command(child, level + 1)
    return out


def render() -> str:
    parsers = subcommand_parsers()
    out = [
        "# Command line reference",
        "",
        f"<!-- Generated from the argparse parsers by `{REGENERATE}`; do not edit by hand:",
        "     tests/cluster/test_cli_docs.py fails when this file is stale. -->",
        "",
        "`moeray COMMAND --help` prints the same. An error a user can act on (a missing or corrupt GGUF, an",
        "unsupported architecture or quant type, a model that fits no placement, a bad size or flag) is one",
        "line naming the value and the fix, exit status 2, never a traceback.",
        "",
        "| command | what it does |",
        "|---|---|",
    ]
    out += [f"| [`moeray {name}`](#moeray-{name}) | {_cell(help_text)} |" for name, (_, help_text) in SUBCOMMANDS.items()]
    out.append("")
    for p in parsers.values():
        out += _command(p, 2)
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
