"""The `moeray` command line.

Each subcommand lives in its own module of cluster/commands/, which exposes
`add_arguments(parser)` and `run(args) -> int`. Modules are imported only when their subcommand
runs, so that `moeray plan` starts in milliseconds and never imports torch or Ray.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from moeray.errors import MoerayError  # torch-free

# name -> (module, one-line help). Add a subcommand by adding a line here.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("moeray.cluster.commands.generate", "generate text from a prompt in one process"),
    "logits": ("moeray.cluster.commands.logits", "write float32 logits for every position (parity checks)"),
    "plan": ("moeray.cluster.commands.plan", "run the placement search for a model and a set of devices"),
    "profile": ("moeray.cluster.commands.profile", "make a routing profile from traces, or show one"),
    "run": ("moeray.cluster.commands.run", "run prompts through the model on pipeline stages (Ray actors)"),
    "serve": ("moeray.cluster.commands.serve", "serve the model over an OpenAI-compatible HTTP API (Ray Serve)"),
}


class CLIError(MoerayError):
    """A user-facing error about the command line: printed as one line, exit status 2, no traceback.
    A MoerayError, so it is caught as one even when this module also runs as __main__
    (`python -m moeray.cluster.cli`), where a second copy of this class exists."""


def build_parser(argv: list[str]) -> tuple[argparse.ArgumentParser, str | None]:
    parser = argparse.ArgumentParser(prog="moeray", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    # Only the chosen subcommand's module is imported.
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            importlib.import_module(module).add_arguments(p)
    return parser, chosen


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, chosen = build_parser(argv)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    module = importlib.import_module(SUBCOMMANDS[args.command][0])
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - user-facing errors become one clear line
        if isinstance(exc, (MoerayError, FileNotFoundError)):
            print(f"moeray {args.command}: error: {exc}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
