"""A real Ray Serve deployment of the application on localhost, shared by the serving tests of a
module: a local Ray cluster, Serve's HTTP and gRPC proxies on ports the OS picked, and two
applications:

- "main" at /: SSD over the torch data plane on the tiny pair, with sd, ar and auto served too,
  an API key, room for 32 concurrent streams, hermes tool calls;
- "small" at /small: plain SD with a batch of 1 and a queue of 1 answering 429, for backpressure.
"""

from __future__ import annotations

import os
import random
import socket
from dataclasses import dataclass

API_KEY = "test-key-0123456789"
MAIN = {
    "engine": {
        "mode": "ssd",
        "k": 4,
        "ssd_budget": 12,
        "ssd_autobudget": False,
        "draft_transport": "torch",
        "max_num_seqs": 8,
    },
    "extra_modes": ["sd", "ar", "auto"],
    "max_queue": 64,
    "api_key": API_KEY,
    "max_n": 3,
    "max_body_bytes": 65536,
    "model_name": "tiny",
    "tool_call_parser": "hermes",
    "draft_pool_size": 2,  # the ssd engine's worker and the auto engine's
    "target_num_cpus": 1,
}
SMALL = {
    "engine": {"mode": "sd", "k": 4, "max_num_seqs": 1},
    "extra_modes": [],
    "max_queue": 1,
    "overload_status": 429,
    "retry_after_s": 2,
    "model_name": "tiny-small",
    "target_num_cpus": 1,
}


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range: a port the kernel handed out for port 0
    could be handed out again, to one of the many sockets Ray binds to port 0, before the server
    it was chosen for binds it (CI saw `ssd serve` fail with "Failed to bind to address")."""
    low = _ephemeral_low()
    for _ in range(200):
        port = random.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("", port))  # every address, as the servers bind
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port found below {low}")


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):  # not Linux: the IANA range starts here
        return 49152


@dataclass
class Served:
    http: str  # base URL, e.g. http://127.0.0.1:PORT
    grpc: str  # host:port
    api_key: str
    metrics: str  # Ray's Prometheus endpoint, e.g. http://127.0.0.1:PORT/metrics
    serve_logs: str  # the directory of the Serve components' logs (one file per replica)


def start(tiny_pair, main: dict | None = None, small: dict | None = None):
    """Start Ray, Serve and the two applications; -> Served. stop() undoes it."""
    import ray
    from ray import serve
    from ray.serve.config import HTTPOptions, gRPCOptions

    from serve_app.app import build_app
    from serve_app.grpc_api import SERVICER_FUNCTIONS

    target, draft = tiny_pair
    http_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    os.environ["RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"] = str(4 << 20)
    # Logical CPUs: ingress (0), targets and draft workers (1 each) of up to four applications
    # (test_serve_reliability.py and test_serve_sampling.py add some); the machine has 2 cores.
    context = ray.init(
        num_cpus=10,
        include_dashboard=False,
        log_to_driver=False,
        _metrics_export_port=metrics_port,
        _system_config={"metrics_report_interval_ms": 1000},
    )
    serve.start(
        http_options=HTTPOptions(host="127.0.0.1", port=http_port),
        grpc_options=gRPCOptions(port=grpc_port, grpc_servicer_functions=SERVICER_FUNCTIONS),
    )
    models = {"target": target, "draft": draft}
    for name, cfg, prefix in (("main", main or MAIN, "/"), ("small", small or SMALL, "/small")):
        cfg = {**cfg, "engine": {**models, **cfg["engine"]}}
        serve.run(build_app(cfg), name=name, route_prefix=prefix)
    return Served(
        f"http://127.0.0.1:{http_port}",
        f"127.0.0.1:{grpc_port}",
        API_KEY,
        f"http://127.0.0.1:{metrics_port}/metrics",
        os.path.join(context.address_info["session_dir"], "logs", "serve"),
    )


def stop() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()
