"""`ssd serve`: the application on a local Ray cluster (or the one `ray start --head` started),
HTTP and gRPC addresses printed, everything shut down on Ctrl-C or SIGTERM.

Flags: one per AppConfig field (--target-replicas, --draft-pool-size, --max-queue, ...) and one
per engine field (--target, --draft, --mode, --k, --ssd-budget, --draft-workers, ...), with the
short forms --budget and --transport; --config FILE reads a YAML AppConfig (or a Serve config
file, whose first application's `args` are taken) and flags given beside it override it.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import sys
import threading
import uuid
from pathlib import Path

import yaml

from serve_app.config import AppConfig
from serve_app.placement import check_fits, cluster_view, cpus_needed, reservations
from ssd.cli import ENGINE_DEST, Command, engine_arguments, flag_options

logger = logging.getLogger("ssd.serve")

APP_NAME = "ssd"
_APP_DEST = "app_"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        help="YAML file: an AppConfig, or a Serve config file (its first application's args). Flags override it.",
    )
    parser.add_argument("--host", default="127.0.0.1", help="HTTP host (0.0.0.0 to listen on every interface).")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port.")
    parser.add_argument("--grpc-port", type=int, default=9000, help="gRPC port.")
    parser.add_argument(
        "--ray-address",
        default="auto",
        help="auto: attach to the Ray cluster of RAY_ADDRESS or one running on this machine (`ray start --head`), "
        "else start one; "
        "local: always start a cluster of its own (stopped on exit); or a cluster address to attach to.",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="Port of Ray's Prometheus metrics endpoint when this command starts the Ray cluster (default: Ray picks "
        "one).",
    )
    for name, field in AppConfig.model_fields.items():
        if name == "engine":
            continue
        options = flag_options(name, field)
        options["dest"] = _APP_DEST + name
        parser.add_argument(f"--{name.replace('_', '-')}", **options)
    engine_arguments(parser)
    parser.add_argument(
        "--budget",
        dest=ENGINE_DEST + "ssd_budget",
        type=int,
        default=argparse.SUPPRESS,
        help="Short for --ssd-budget.",
    )
    parser.add_argument(
        "--transport",
        dest=ENGINE_DEST + "draft_transport",
        choices=["torch", "grpc"],
        default=argparse.SUPPRESS,
        help="Short for --draft-transport: the data plane between target replicas and draft workers.",
    )


def _file_args(path: str) -> dict:
    data = yaml.safe_load(Path(path).read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a YAML mapping (an AppConfig or a Serve config file)")
    if "applications" in data:  # a Serve config file: take its first application's args
        apps = data["applications"] or []
        if not apps:
            raise ValueError(f"{path}: the Serve config file lists no applications")
        return dict(apps[0].get("args") or {})
    return data


def app_config_from(args: argparse.Namespace) -> AppConfig:
    """The AppConfig of --config and the flags (validated; a bad value raises ValueError naming it)."""
    from serve_app.app import parse_config

    base = _file_args(args.config) if args.config else {}
    app = {name: getattr(args, _APP_DEST + name) for name in AppConfig.model_fields if hasattr(args, _APP_DEST + name)}
    engine = dict(base.pop("engine", None) or {})
    engine.update(
        {name[len(ENGINE_DEST) :]: value for name, value in vars(args).items() if name.startswith(ENGINE_DEST)}
    )
    return parse_config({**base, **app, **({"engine": engine} if engine else {})})


def _start_ray(address: str, metrics_port: int | None, cpus: float) -> bool:
    """Attach to a running cluster or start one (see --ray-address) with at least `cpus` logical
    CPUs (the reservations; serve_app/placement.py). -> whether this process started it (and so
    stops it on exit)."""
    import ray

    if address != "local":
        try:
            ray.init(
                address=os.environ.get("RAY_ADDRESS", "auto") if address == "auto" else address,
                logging_level=logging.WARNING,
            )
            logger.info("attached to the running Ray cluster")
            return False
        except ConnectionError:
            if address != "auto":
                raise
    options = {"_metrics_export_port": metrics_port} if metrics_port else {}
    cores = os.cpu_count() or 1
    logical = max(cores, math.ceil(cpus))
    if logical > cores:
        logger.warning(
            "the deployment reserves %g CPUs and this machine has %d cores: the local Ray cluster counts %d, so "
            "every replica is placed, sharing the cores",
            cpus, cores, logical,
        )  # fmt: skip
    ray.init(address="local", include_dashboard=False, logging_level=logging.WARNING, num_cpus=logical, **options)
    return True


def run(args: argparse.Namespace) -> int:
    """`ssd serve`: validate, start (or attach to) Ray, deploy, wait for a signal, drain, shut down."""
    config = app_config_from(args)  # every user error before any process starts
    settings = config.to_settings()
    # Read by Serve's gRPC proxy when it starts (a child of the cluster this process starts).
    os.environ.setdefault("RAY_SERVE_GRPC_MAX_MESSAGE_SIZE", str(config.max_grpc_message_bytes))
    reserved = reservations(config)
    # A cluster started here has no Ray autoscaler to add nodes: it counts room for the most replicas.
    started = _start_ray(args.ray_address, args.metrics_port, cpus_needed(reservations(config, most=True)))
    # On a cluster this process joined, a running ssd app is replaced by this deploy, so what it
    # holds counts as free.
    view = cluster_view(None if started else APP_NAME)
    try:
        check_fits(reserved, *view)  # before anything is deployed that could never be placed
    except ValueError:
        if started:
            import ray

            ray.shutdown()
        raise  # nothing deployed: a joined cluster's applications stay as they were
    signals, owner = _Signals(), uuid.uuid4().hex
    try:
        _deploy(args, config, owner)
        _announce(args, config, settings)
        signals.wait()
        if _ours(owner):
            _drain(config, signals)
        else:
            logger.warning("another `ssd serve` has replaced this one's application since; leaving it running")
    finally:
        _shutdown(started, signals, owner)
    return 0


class _Signals:
    """SIGINT and SIGTERM, installed after ray.init (which installs handlers of its own): the first
    signal starts the drain, a second one during the drain skips what is left of it; later ones
    are ignored, so that the shutdown itself always runs to its end."""

    def __init__(self) -> None:
        self.stop, self.draining = threading.Event(), threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, *_) -> None:
        if not self.stop.is_set():
            self.stop.set()
        elif self.draining.is_set():
            self.draining.clear()
            raise KeyboardInterrupt

    def wait(self) -> None:
        while not self.stop.wait(0.5):
            pass


def _deploy(args: argparse.Namespace, config: AppConfig, owner: str) -> None:
    from ray import serve
    from ray.serve.config import HTTPOptions, gRPCOptions

    from serve_app.app import build_app
    from serve_app.drain import reset_board
    from serve_app.grpc_api import SERVICER_FUNCTIONS

    serve.start(
        http_options=HTTPOptions(host=args.host, port=args.port),
        grpc_options=gRPCOptions(port=args.grpc_port, grpc_servicer_functions=SERVICER_FUNCTIONS),
    )
    reset_board(APP_NAME, owner)  # this deploy is the app's now; an earlier killed run's drain does not carry over
    serve.run(build_app(config), name=APP_NAME, route_prefix="/", blocking=False)


def _announce(args: argparse.Namespace, config: AppConfig, settings) -> None:
    name = settings.model_name
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    auth = ' -H "Authorization: Bearer $SSD_API_KEY"' if settings.api_key_here() else ""
    sys.stdout.write(
        f"ssd-serve is up: model {name!r}, mode {config.engine.mode}, {_replicas(settings)} target replica(s), "
        f"draft pool {_pool(settings)}\n"
        f"  HTTP (OpenAI): http://{host}:{args.port}/v1   health: http://{host}:{args.port}/health\n"
        f"  gRPC:          {host}:{args.grpc_port} (ssd.serve.v1.Generation)\n"
        f"Try:\n  curl http://{host}:{args.port}/v1/completions -H 'Content-Type: application/json'{auth} "
        f'-d \'{{"model": "{name}", "prompt": "def fibonacci(n):", "max_tokens": 64, "temperature": 0}}\'\n'
        "Ctrl-C stops it (in-flight requests finish first, up to --drain-timeout-s).\n"
    )
    sys.stdout.flush()


def _replicas(settings) -> str:
    low, high = settings.target_replicas, settings.target_replicas_max
    return f"{low}" if low == high else f"{low}-{high} (autoscaling)"


def _pool(settings) -> str:
    scaling = settings.draft_pool_autoscaling
    return f"{settings.draft_pool_size}" if scaling is None else f"{scaling['min_replicas']}-{scaling['max_replicas']}"


def _drain(config: AppConfig, signals: _Signals) -> None:
    from serve_app.drain import drain

    sys.stdout.write(
        f"draining: new requests get 503, waiting up to {config.drain_timeout_s:g} s for those in flight\n"
    )
    sys.stdout.flush()
    signals.draining.set()
    try:
        left, waited = drain(APP_NAME, config.drain_timeout_s)
        signals.draining.clear()
        still = "unknown (not every ingress replica answered)" if left is None else str(left)
        sys.stdout.write(f"shutting down after {waited:.1f} s; generations still in flight: {still}\n")
    except KeyboardInterrupt:
        sys.stdout.write("drain skipped: shutting down now\n")


def _ours(owner: str) -> bool:
    """Whether the application is still this process's deploy: a later `ssd serve` on the same
    cluster replaces it, and then it is that one's to drain and stop."""
    from serve_app.drain import deployed_by

    return deployed_by(APP_NAME) == owner


def _shutdown(started: bool, signals: _Signals, owner: str) -> None:
    import ray
    from ray import serve

    from serve_app.drain import remove_board

    signals.draining.clear()
    try:
        # Serve itself on a cluster this process started; only its own application on one it
        # joined, whose other applications (and a later deploy of this one) are not ours to stop.
        if started:
            serve.shutdown()
        elif _ours(owner):
            serve.delete(APP_NAME)
            remove_board(APP_NAME)  # after the ingress replicas, which would create it again
    finally:
        if started:
            try:
                remove_board(APP_NAME)
            finally:
                ray.shutdown()


COMMAND = Command(
    help="Serve the OpenAI-compatible HTTP API and the gRPC API with Ray Serve (default: the demo pair, mode auto, on "
    "this machine).",
    add_arguments=add_arguments,
    run=run,
)
