"""The `moeray` command's subcommands (cluster/cli.py dispatches to them), one module each with
`add_arguments(parser)` and `run(args) -> int`, and cli_docs, which writes docs/cli.md from their
parsers. Their heavy imports sit inside `run`: a command loads only what it uses."""
