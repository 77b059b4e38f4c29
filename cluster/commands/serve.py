"""`moeray serve [MODEL.gguf]`: the OpenAI-compatible endpoint on a Ray cluster.

Starts a local Ray cluster (or joins one with --address), deploys the Serve app whose replica
runs the driver (probe -> plan -> load -> wire), prints the plan, the URL and a curl to paste,
then serves until Ctrl-C or `kill` (SIGINT, SIGTERM: Serve, the stages and the local Ray are shut
down in order, exit 0). With no model it serves the embedded default model on 4 simulated stages
(no GPUs needed). Stop and start it again to reload: the replica owns the stages. With --local
the model and the HTTP server are in this process instead (cluster/local_server.py: no Serve
proxy or replica between the client and the engine); Ray runs beside it for the metrics.

Its HTTP port and, when it starts Ray, the metrics port are checked before Ray starts: a port in
use is one line naming the flag that changes it (exit 2), not a Ray node that times out.
"""
from __future__ import annotations

import argparse
import errno
import json
import os
import re
import signal
import socket
import sys
import time
from pathlib import Path

from moeray.cluster.config import (LOOPBACK_HOSTS, ServeOptions, add_chat_format_argument, add_engine_arguments,
                                   add_launch_arguments, add_limits_arguments, engine_config_from_args, is_loopback,
                                   launch_options_from_args, limits_from_args, simulated_devices)
from moeray import environment
from moeray.errors import MoerayError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", help="GGUF file (default: the embedded upcycled SmolLM2 MoE)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=environment.api_key(),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $MOERAY_API_KEY, else none)")
    p.add_argument("--model-name", help="the model id clients send (default: the file's name)")
    p.add_argument("--served-model-name", nargs="+", metavar="NAME",
                   help="the ids clients may send, as vLLM takes them: the first is the one responses and "
                        "/v1/models name, the others are aliases (instead of --model-name; after the model path)")
    p.add_argument("--any-model", action="store_true",
                   help="answer requests whatever model they name (as llama-server does): coding agents name their "
                        "own models for side calls (docs/agents/)")
    p.add_argument("--responses-store", type=int, default=ServeOptions.responses_store, metavar="N",
                   help="responses of POST /v1/responses kept for previous_response_id and GET /v1/responses/ID, "
                        f"the most recently used first (0: none; default {ServeOptions.responses_store})")
    p.add_argument("--default-max-tokens", type=int, default=None, metavar="N",
                   help="output tokens of a request that sets no limit (default: 256 on /v1/chat/completions and "
                        "/v1/completions, the rest of the context on /v1/responses)")
    p.add_argument("--local", action="store_true",
                   help="the whole model in this process, which serves the HTTP API itself (no Serve proxy or "
                        "replica, no stage actors)")
    p.add_argument("--max-waiting", type=int, default=ServeOptions.max_waiting,
                   help=f"requests queued for a slot before 429 (default {ServeOptions.max_waiting})")
    p.add_argument("--allowed-hosts", metavar="NAMES",
                   help="Host headers the server answers, comma-separated (a name, an address, or * for any); "
                        "others get a 403, which stops a DNS-rebinding web page (default: "
                        f"{','.join(LOOPBACK_HOSTS)} when --host is a loopback address, else any)")
    p.add_argument("--drain-timeout", type=float, default=ServeOptions.drain_s, metavar="S",
                   help="on SIGTERM or Ctrl-C: stop admitting, let running requests finish for this long, then end "
                        f"the rest with an error event and [DONE] (default {ServeOptions.drain_s:.0f})")
    p.add_argument("--open-metrics", action="store_true",
                   help="GET /metrics without the API key (default: it wants the key, as /v1/* does)")
    p.add_argument("--threads", type=int, default=None,
                   help="--local: ggml's threads in the one process (default: every core it may run on; each "
                        "graph then learns whether one thread or all compute it faster; 1: one thread)")
    p.add_argument("--no-metrics", action="store_true",
                   help="--local: no Prometheus metrics and no Ray at all (Ray's metrics cost the one process "
                        "~3 ms a token on a small machine: docs/performance.md)")
    add_chat_format_argument(p)
    p.add_argument("--chat-template", metavar="FILE",
                   help="a Jinja chat template to use instead of the GGUF's (as llama-server's --chat-template-file "
                        "and vLLM's --chat-template); the chat format is then chosen from it")
    p.add_argument("--reasoning-budget", type=int, default=ServeOptions.reasoning_budget, metavar="N",
                   help="thinking tokens a reply may spend before its reasoning block is closed for it, where the "
                        "request sets no budget: -1 unlimited (default), 0 no thinking (docs/chat-formats.md)")
    add_launch_arguments(p)
    add_engine_arguments(p)
    add_limits_arguments(p)
    p.add_argument("--metrics-export-port", type=int, default=8080,
                   help="Prometheus port of the local Ray node (when this command starts Ray); 0: a free one")
    p.add_argument("--dashboard", action="store_true",
                   help="start the Ray dashboard with the local cluster and print its URL (stage actors, logs, metrics)")
    p.add_argument("--dashboard-port", type=int, default=8265, help="port of that Ray dashboard (default 8265)")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for the server")


def allowed_hosts(given: str | None, bind_host: str | None) -> tuple[str, ...] | None:
    """The Host headers to answer: --allowed-hosts as given (* for any), else the loopback names
    when the server binds a loopback address (nothing else can name it), else any (None)."""
    if given is not None:
        names = tuple(n.strip().lower() for n in given.split(",") if n.strip())
        return None if "*" in names or not names else names
    return LOOPBACK_HOSTS if bind_host is not None and is_loopback(bind_host) else None


def options_from_args(args: argparse.Namespace, bind_host: str | None = "flag") -> ServeOptions:
    """ServeOptions from the command line (checked here, before the replica starts). `bind_host`:
    the address the HTTP server binds (default --host), which decides the default --allowed-hosts;
    None where another program binds it (Serve's config file): no default check then."""
    from moeray.cluster.cli import CLIError

    if args.stages < 1:
        raise CLIError("--stages must be >= 1")
    chat_template = None
    if args.chat_template is not None:
        try:
            chat_template = Path(args.chat_template).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise CLIError(f"--chat-template {args.chat_template}: cannot read it ({exc})") from None
    if args.reasoning_budget < -1:
        raise CLIError(f"--reasoning-budget {args.reasoning_budget}: give -1 (unlimited), 0 (no thinking) or a "
                       "number of tokens")
    engine = engine_config_from_args(args)
    sim = None if args.local else simulated_devices(args, _has_gpus(), "serve")
    launch = launch_options_from_args(args, sim, threads=args.threads)
    if args.local:
        launch.torch_threads = 1
        if args.micro_batches is None:
            # One stage has no other stage to overlap with: one micro-batch of every running sequence,
            # which reads each routed expert once per step instead of once per lane (bench/load.py,
            # 16 clients: 48.6 against 37.0 out tok/s with two lanes; the method: docs/performance.md#served).
            engine.micro_batches = 1
    bind_host = args.host if bind_host == "flag" else bind_host
    names = args.served_model_name or ([args.model_name] if args.model_name else [None])
    if args.served_model_name and args.model_name:
        raise CLIError("give --model-name or --served-model-name, not both")
    if args.responses_store < 0:
        raise CLIError("--responses-store must be >= 0 (0: keep none)")
    if args.default_max_tokens is not None and args.default_max_tokens < 1:
        raise CLIError("--default-max-tokens must be >= 1")
    return ServeOptions(model=args.model, model_name=names[0], model_aliases=tuple(names[1:]), any_model=args.any_model,
                        local=args.local, launch=launch, engine=engine,
                        max_waiting=args.max_waiting, api_key=args.api_key or None,
                        metrics=not args.no_metrics, chat_format=args.chat_format, limits=limits_from_args(args),
                        allowed_hosts=allowed_hosts(args.allowed_hosts, bind_host), drain_s=args.drain_timeout,
                        metrics_need_key=not args.open_metrics,
                        responses_store=args.responses_store, default_max_tokens=args.default_max_tokens,
                        reasoning_budget=args.reasoning_budget, chat_template=chat_template)


def check_ports(args: argparse.Namespace) -> None:
    """Fail in one line, before Ray starts, when a port this command needs is in use: Ray would
    otherwise wait minutes for a node whose metrics agent cannot bind, then print a traceback.
    `--metrics-export-port 0` becomes a free port here."""
    from moeray.cluster.cli import CLIError

    wanted = [("--port", args.host, args.port)]
    if not args.address and not args.no_metrics:  # joining a cluster: its nodes export their own metrics
        if args.metrics_export_port == 0:
            from moeray.stages.runtime.transport import free_port

            args.metrics_export_port = free_port()
        wanted.append(("--metrics-export-port", "", args.metrics_export_port))
        if args.dashboard:
            wanted.append(("--dashboard-port", "", args.dashboard_port))
    for flag, host, port in wanted:
        if not 0 < port < 65536:
            raise CLIError(f"{flag} {port}: a port is a number from 1 to 65535")
        problem = _port_problem(host, port)
        if problem:
            raise CLIError(f"{flag} {port}: {problem}; stop what holds it or pass another {flag}")


def _port_problem(host: str, port: int) -> str | None:
    """Why (host, port) cannot be listened on, or None. SO_REUSEADDR as the servers set it, so a
    port still in TIME_WAIT after the last run counts as free, one somebody listens on does not."""
    try:
        family = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as exc:
        return f"cannot resolve the address {host!r} ({exc.strerror})"
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return f"port {port} is already in use" + (f" on {host}" if host else "")
            return f"cannot listen on {host or '*'}:{port} ({exc.strerror})"
    return None


class Stop(BaseException):
    """SIGTERM or SIGINT: leave the serving loop (or the start-up) and shut down in order. Not an
    Exception, so no `except Exception` on the way (Ray's or ours) swallows it."""


def stop_on_signals() -> None:
    """`kill PID` and Ctrl-C stop the server the same way. Installed after ray.init, which puts its
    own SIGTERM handlers in (a C++ one that prints a stack trace and aborts); a second signal
    during the shutdown is ignored, so the shutdown finishes."""

    def handler(signum, _frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise Stop(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def start_ray(address: str | None, metrics_port: int, dashboard: bool, dashboard_port: int = 8265,
              bind_host: str = "127.0.0.1", workers: bool = True) -> str | None:
    """Start a local Ray (or join `address`); returns the Ray dashboard's URL when one runs. A server
    bound to a loopback address starts a Ray bound to loopback too: its metrics exporter (and every
    port of Ray's) is then not on the network either. `workers=False` (`--local`: Ray only carries
    this process's metrics, it runs no task or actor) starts a node with no CPUs to give: Ray then
    keeps no idle worker processes, and nothing in this process listens for workers' log lines;
    those idle workers' polling cost a quarter of a millisecond of CPU per token served to one
    client, time taken from ggml's threads on a small machine."""
    from moeray.cluster.driver import local_ray_env, ray_init_address

    local_ray_env()
    # Serve's HTTP proxy must answer a readiness check in 5 s by default; on a small machine busy
    # loading a model it can miss three in a row and be killed. The processes a local cluster starts
    # inherit these, so they take effect from ray.init on.
    environment.set_default("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "30")
    environment.set_default("RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S", "30")
    address = ray_init_address(address)
    if address == "local" and is_loopback(bind_host):
        # Ray's own switch for a cluster of this machine alone (its default off Linux), read when ray
        # is imported: the node takes the loopback address, so its metrics exporter, raylet and GCS
        # listen there.
        environment.set_default("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    if ray.is_initialized():
        return None
    try:
        if address != "local":
            ctx = ray.init(address=address, logging_level="WARNING")
        else:
            quiet = {} if workers else dict(num_cpus=0, log_to_driver=False)
            ctx = ray.init(address="local", include_dashboard=dashboard, dashboard_port=dashboard_port,
                           _metrics_export_port=metrics_port, logging_level="WARNING", **quiet)
    except Exception as exc:  # noqa: BLE001 - ray.init raises a plain Exception when its node times out
        where = "the local Ray node" if address == "local" else f"Ray at {address}"
        raise MoerayError(f"{where} did not start: {exc} Fix: retry when the machine is less loaded, `ray stop` a "
                          "stuck Ray first, or run without Ray (--local --no-metrics)") from None
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


def check_simulated_fit(opts: ServeOptions) -> None:
    """A machine without GPUs (simulated devices): plan the model on their budgets here, before
    Serve deploys, with the driver's own arithmetic (cluster/placement.py plan_from_reports over
    reports of those budgets: whether any placement fits is a matter of bytes, not of the speeds the
    stages will measure). A model that fits no placement is then one line naming the ways out, not
    a replica that fails inside Serve's controller, its traceback in the log."""
    from moeray.cluster.config import resolve_model
    from moeray.cluster.placement import plan_from_reports
    from moeray.errors import PlacementError
    from moeray.stages.gguf.reader import read_gguf_header
    from moeray.stages.runtime.device import DeviceInfo
    from moeray.stages.runtime.step import ProbeReport
    from moeray.units import format_bytes

    budgets = opts.launch.simulate
    if not budgets:
        return
    path = resolve_model(opts.model)
    reports = [ProbeReport(stage=i, pid=0, device=DeviceInfo("simulated", f"simulated device {i}", b, b, "cpu"),
                           layer_ms=1.0, miss_ms=1.0, measure_s=0.0) for i, b in enumerate(budgets)]
    try:
        plan_from_reports(read_gguf_header(path), reports, opts.launch, opts.engine, handoff_ms=0.0)
    except PlacementError as exc:
        model = "" if opts.model is None else f" {opts.model}"
        sizes = ",".join(format_bytes(b).replace(" ", "") for b in budgets)
        raise PlacementError(
            f"{exc}. No GPU here, and the model fits no placement on the simulated devices ({sizes}): serve it "
            f"in one process with `moeray serve --local{model}` (the machine's memory is its device), or give "
            f"larger simulated devices with --simulate-devices SIZE,... (`moeray plan{model} --devices SIZE,...` "
            "shows where it would fit)") from None


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
    if args.threads is not None and (args.threads < 1 or not args.local):
        from moeray.cluster.cli import CLIError

        raise CLIError("--threads N (N >= 1) is for --local, the one process; stages take their cores' share")
    if args.no_metrics and (not args.local or args.address or args.dashboard):
        from moeray.cluster.cli import CLIError

        raise CLIError("--no-metrics is for --local on its own (no Ray at all): not with stages, --address or --dashboard")
    check_ports(args)
    if args.model is not None and not os.path.isfile(args.model):  # before Ray starts: a minute saved, one line
        raise FileNotFoundError(f"{args.model}: no such file")
    local, rc, serving, deployed = None, 0, False, False
    try:
        ray_dashboard = None
        if not is_loopback(args.host) and not args.api_key:
            print(f"moeray serve: warning: --host {args.host} serves beyond this machine with no API key: anyone who "
                  f"reaches port {args.port} can use the model; set --api-key KEY (or MOERAY_API_KEY)",
                  file=sys.stderr, flush=True)
        if not args.no_metrics:
            ray_dashboard = start_ray(args.address, args.metrics_export_port, args.dashboard, args.dashboard_port,
                                      args.host, workers=not args.local)
        stop_on_signals()
        opts = options_from_args(args)
        if args.local:  # the model and the HTTP server in this process (cluster/local_server.py)
            from moeray.cluster.local_server import LocalServer

            print("moeray serve: loading the model in this process ...", file=sys.stderr)
            local = LocalServer(opts, args.host, args.port, args.ready_timeout)
            url = f"http://{'127.0.0.1' if args.host in ('0.0.0.0', '::') else args.host}:{args.port}"
        else:
            check_simulated_fit(opts)
            print("moeray serve: deploying (probe -> plan -> load -> wire) ...", file=sys.stderr)
            deployed = True
            url = start_server(opts, args.host, args.port, args.ready_timeout)
        report = stages_report(url, opts.api_key)
        for line in report["plan"]:
            print(line)
        print(f"serving {report['model']} at {url}/v1 (context {report['context']} tokens)")
        print(f"metrics (Prometheus): {url}/metrics" + (" (with the API key)" if opts.api_key and opts.metrics_need_key
                                                          else ""))
        if not args.address and not args.no_metrics:
            print(f"Ray metrics (Prometheus): http://127.0.0.1:{args.metrics_export_port}/metrics")
        if ray_dashboard:
            print(f"Ray dashboard (stage actors, logs, metrics): {ray_dashboard}")
        elif args.dashboard:
            print("moeray serve: the Ray dashboard did not start (it needs ray[default]; see Ray's log)", file=sys.stderr)
        print(f"live stage page: {url}/dashboard" + ("?key=$MOERAY_API_KEY" if opts.api_key else ""))
        print(curl_example(url, report["model"], opts.api_key))
        sys.stdout.flush()
        serving = True
        if local is not None:  # serve until SIGINT / SIGTERM, or until the one process cannot serve
            why = local.wait()
            print(f"moeray serve: {why}; exiting with status 1 so that a supervisor (systemd, Kubernetes, "
                  "a shell loop) restarts the server", file=sys.stderr, flush=True)
            rc = 1
        else:
            while True:  # serve until SIGINT / SIGTERM (Serve restarts a replica that dies)
                time.sleep(3600)
    except Stop as stop:
        what = ("the HTTP server, the engine" + ("" if args.no_metrics else " and Ray")) if args.local else \
            "Serve, the stages and Ray"
        if serving:
            drain(local, args.drain_timeout, str(stop))
        print(f"moeray serve: {stop}: shutting down {what} ...", file=sys.stderr, flush=True)
    finally:
        if local is not None:
            local.close()
        shutdown(serve_started=deployed)
    print("moeray serve: stopped", file=sys.stderr)
    return rc


def drain(local, timeout_s: float, signal_name: str) -> None:
    """Before stopping: admit nothing new (503, /health too), let running requests finish for up to
    `timeout_s`, then end the rest with an error (a stream: an error event and [DONE]). In this
    process with --local; in the Serve replica otherwise (MoerayServer.drain). Bounded."""
    print(f"moeray serve: {signal_name}: draining: no new requests; the running ones get up to {timeout_s:g} s "
          "(--drain-timeout) ...", file=sys.stderr, flush=True)
    try:
        if local is not None:
            ended = local.service.drain(timeout_s)
            time.sleep(0.5)  # the streams write their last events
        else:
            from ray import serve

            ended = serve.get_app_handle("moeray").drain.remote(timeout_s).result(timeout_s=timeout_s + 20)
    except Exception as exc:  # noqa: BLE001 - a replica already gone (Ctrl-C reaches Ray's processes too)
        print(f"moeray serve: the drain did not finish ({type(exc).__name__}); stopping anyway", file=sys.stderr,
              flush=True)
        return
    if ended:
        print(f"moeray serve: {ended} request(s) still running after {timeout_s:g} s were ended with an error",
              file=sys.stderr, flush=True)


def shutdown(serve_started: bool = True) -> None:
    """Serve (its replica owns the stage actors and closes them), then this driver's Ray: the
    local cluster when this command started it, the connection when it joined one (--address).
    `--local` never starts Serve (asking Serve to shut down would wait for a controller that is
    not there)."""
    import ray

    if not ray.is_initialized():
        return
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        if serve_started:
            from ray import serve

            serve.shutdown()
    finally:
        ray.shutdown()


def _has_gpus() -> bool:
    import ray

    return ray.cluster_resources().get("GPU", 0) >= 1
