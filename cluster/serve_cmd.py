"""`moeray serve [MODEL.gguf]`: the OpenAI-compatible endpoint on a Ray cluster.

Starts a local Ray cluster (or joins one with --address), deploys the Serve app whose replica
runs the driver (probe -> plan -> load -> wire), prints the plan, the URL and a curl to paste,
then serves until Ctrl-C. With no model it serves the embedded default model on 4 simulated
stages (no GPUs needed). Stop and start it again to reload: the replica owns the stages.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

from moeray.cluster.config import (ServeOptions, add_engine_arguments, add_launch_arguments, engine_config_from_args,
                                   launch_options_from_args, simulated_devices)
from moeray.errors import MoerayError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", help="GGUF file (default: the embedded upcycled SmolLM2 MoE)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("MOERAY_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $MOERAY_API_KEY, else none)")
    p.add_argument("--model-name", help="the model id clients send (default: the file's name)")
    p.add_argument("--local", action="store_true", help="the whole model in the Serve replica, no stage actors")
    p.add_argument("--max-waiting", type=int, default=ServeOptions.max_waiting,
                   help=f"requests queued for a slot before 429 (default {ServeOptions.max_waiting})")
    add_launch_arguments(p)
    add_engine_arguments(p)
    p.add_argument("--metrics-export-port", type=int, default=8080,
                   help="Prometheus port of the local Ray node (when this command starts Ray)")
    p.add_argument("--dashboard", action="store_true",
                   help="start the Ray dashboard with the local cluster and print its URL (stage actors, logs, metrics)")
    p.add_argument("--dashboard-port", type=int, default=8265, help="port of that Ray dashboard (default 8265)")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for the server")


def options_from_args(args: argparse.Namespace) -> ServeOptions:
    """ServeOptions from the command line (checked here, before the replica starts)."""
    from moeray.cluster.cli import CLIError

    if args.stages < 1:
        raise CLIError("--stages must be >= 1")
    engine = engine_config_from_args(args)
    sim = None if args.local else simulated_devices(args, _has_gpus(), "serve")
    launch = launch_options_from_args(args, sim)
    if args.local:
        launch.torch_threads = 1
    return ServeOptions(model=args.model, model_name=args.model_name, local=args.local, launch=launch, engine=engine,
                        max_waiting=args.max_waiting, api_key=args.api_key or None)


def start_ray(address: str | None, metrics_port: int, dashboard: bool, dashboard_port: int = 8265) -> str | None:
    """Start a local Ray (or join `address`); returns the Ray dashboard's URL when one runs."""
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    # Serve's HTTP proxy must answer a readiness check in 5 s by default; on a small machine busy
    # loading a model it can miss three in a row and be killed. The processes a local cluster starts
    # inherit these, so they take effect from ray.init on.
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "30")
    os.environ.setdefault("RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S", "30")
    import ray

    if ray.is_initialized():
        return None
    if address:
        ctx = ray.init(address=address, logging_level="WARNING")
    else:
        ctx = ray.init(include_dashboard=dashboard, dashboard_port=dashboard_port, _metrics_export_port=metrics_port,
                       logging_level="WARNING")
    url = getattr(ctx, "dashboard_url", None)
    return f"http://{url}" if url and not url.startswith("http") else url or None


def start_server(opts, host: str, port: int, ready_timeout_s: float = 600.0) -> str:
    """Deploy the app on the running Ray cluster; returns its URL once /health answers."""
    from ray import serve

    from moeray.cluster.serve_app import deployment, wait_ready

    serve.start(http_options={"host": host, "port": port})
    try:
        serve.run(deployment(opts), name="moeray", route_prefix="/")
    except RuntimeError as exc:
        raise MoerayError(f"the server did not start: {_root_cause(exc)}") from None
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
    wait_ready(url, ready_timeout_s)
    return url


def _root_cause(exc: Exception) -> str:
    """The replica's own error (e.g. 'PlacementError: no placement fits ...'), not Serve's wrapper."""
    from ray import serve

    try:
        message = serve.status().applications["moeray"].deployments["moeray"].message
    except Exception:  # noqa: BLE001 - fall back to Serve's message
        message = ""
    lines = [ln.strip() for ln in message.splitlines() if re.match(r"^\s*[\w.]+(Error|Exception): ", ln)]
    return lines[-1] if lines else str(exc)


def stages_report(url: str, api_key: str | None, timeout_s: float = 30.0) -> dict:
    import urllib.request

    req = urllib.request.Request(f"{url}/v1/stages")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())


def curl_example(url: str, model: str, api_key: str | None) -> str:
    auth = ' -H "Authorization: Bearer $MOERAY_API_KEY"' if api_key else ""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
                       "max_tokens": 32})
    return f"curl -s {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'"


def run(args: argparse.Namespace) -> int:
    import signal

    # `kill PID` shuts down as Ctrl-C does: Serve, the stages and the local Ray go with it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    ray_dashboard = start_ray(args.address, args.metrics_export_port, args.dashboard, args.dashboard_port)
    opts = options_from_args(args)
    print("moeray serve: deploying (probe -> plan -> load -> wire) ...", file=sys.stderr)
    from ray import serve

    try:
        url = start_server(opts, args.host, args.port, args.ready_timeout)
        report = stages_report(url, opts.api_key)
        for line in report["plan"]:
            print(line)
        print(f"serving {report['model']} at {url}/v1 (context {report['context']} tokens)")
        if not args.address:
            print(f"Ray metrics (Prometheus): http://127.0.0.1:{args.metrics_export_port}/metrics")
        if ray_dashboard:
            print(f"Ray dashboard (stage actors, logs, metrics): {ray_dashboard}")
        elif args.dashboard:
            print("moeray serve: the Ray dashboard did not start (it needs ray[default]; see Ray's log)", file=sys.stderr)
        print(f"live stage page: {url}/dashboard" + ("?key=$MOERAY_API_KEY" if opts.api_key else ""))
        print(curl_example(url, report["model"], opts.api_key))
        sys.stdout.flush()
        while True:  # serve until Ctrl-C
            time.sleep(3600)
    finally:
        try:
            serve.shutdown()
        finally:
            import ray

            ray.shutdown()


def _has_gpus() -> bool:
    import ray

    return ray.cluster_resources().get("GPU", 0) >= 1
