"""Ray Serve's own deployment route: `serve run ray_configs/serve.yaml`, `serve deploy ...`.

The application builder `build(args)` takes the options of `moeray serve`, spelled as the flags
without their dashes (`stages: 2`, `simulate_devices: 176MiB,176MiB`, `max_seqs: 8`, `model: PATH`
or none for the embedded default model), parses them with `moeray serve`'s own parser (same
defaults, same checks, same one-line errors) and returns the same one-replica application:

    serve run moeray.cluster.serve_build:build stages=2 simulate_devices=176MiB,176MiB
    serve run ray_configs/serve.yaml        # import_path: moeray.cluster.serve_build:build

What Serve or Ray own is not an application option: the HTTP address is the config file's
`http_options`, Ray's metrics port belongs to `ray start`, and `serve run` / `serve deploy` say
which cluster to use. Such a key is a one-line error naming where it goes, never silently dropped.
"""
from __future__ import annotations

import argparse
from typing import Any

from moeray import environment
from moeray.errors import MoerayError

# `moeray serve` flags that Serve or `ray start` decide when deploying from a config file.
NOT_APP_OPTIONS = {
    "host": "http_options.host in the config file",
    "port": "http_options.port in the config file",
    "address": "the cluster `serve run --address` / `serve deploy --address` connects to",
    "metrics_export_port": "`ray start --metrics-export-port` on each node",
    "dashboard": "`ray start --head --include-dashboard=true`",
    "dashboard_port": "`ray start --head --dashboard-port`",
    "ready_timeout": "`serve run` (it waits for the application itself)",
}


def _parser() -> argparse.ArgumentParser:
    from moeray.cluster.commands.serve import add_arguments

    p = argparse.ArgumentParser(prog="moeray.cluster.serve_build:build", exit_on_error=False)
    add_arguments(p)
    return p


def argv_from(args: dict[str, Any]) -> list[str]:
    """The `moeray serve` command line the builder's args stand for."""
    argv: list[str] = []
    flags = {a.dest: a for a in _parser()._actions if a.option_strings}
    for key, value in args.items():
        dest = key.replace("-", "_")
        if dest == "model":
            if value is not None:
                argv.insert(0, str(value))
            continue
        if dest in NOT_APP_OPTIONS:
            raise MoerayError(f"serve_build: '{key}' is not an application option here; it is set by "
                              f"{NOT_APP_OPTIONS[dest]}")
        action = flags.get(dest)
        if action is None:
            raise MoerayError(f"serve_build: unknown option '{key}'; the options are `moeray serve`'s flags "
                              "without the dashes (e.g. stages, simulate_devices, max_seqs, api_key)")
        flag = action.option_strings[-1]
        if action.nargs == 0:  # a switch: true turns it on
            if str(value).lower() in ("1", "true", "yes", "on"):
                argv.append(flag)
            elif str(value).lower() not in ("0", "false", "no", "off", "none"):
                raise MoerayError(f"serve_build: '{key}' is a switch: give true or false, not {value!r}")
        elif value is not None:
            argv += [flag, str(value)]
    return argv


def options(args: dict[str, Any]):
    """ServeOptions from the builder's args, through `moeray serve`'s parser and checks."""
    import ray

    from moeray.cluster.commands.serve import options_from_args

    if not ray.is_initialized():
        # `serve run IMPORT_PATH` calls the builder before it joins Ray, but the options depend on
        # the cluster (GPUs, or the simulated cards in their place): join it here, as serve run would.
        ray.init(address=environment.ray_address(), namespace="serve", logging_level="WARNING")
    try:
        ns = _parser().parse_args(argv_from(args))
    except (argparse.ArgumentError, SystemExit) as exc:
        raise MoerayError(f"serve_build: {exc}") from None
    return options_from_args(ns, bind_host=None)  # http_options.host binds it: no default Host check


def build(args: dict[str, Any]):
    """Serve's application builder: the `moeray serve` app for these options."""
    from moeray.cluster.serve_app import deployment

    return deployment(options(dict(args or {})))
