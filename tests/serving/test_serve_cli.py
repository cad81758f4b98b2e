"""`ssd serve` as users run it: the embedded default (demo pair, SSD, a Ray draft worker) comes up
on the ports given, prints its addresses and a curl example that works, and SIGTERM drains it
(streams in flight finish, new requests get 503) and shuts down everything it started (no Ray
process left). The repository's Serve config file validates against Ray Serve's own schema and
builds the application."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

requests = pytest.importorskip("requests")

from serve_harness import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def ray_processes() -> set[int]:
    out = set()
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "raylet" in text or "gcs_server" in text or text.startswith("ray::"):
            out.add(int(cmdline.parent.name))
    return out


def test_ssd_serve_starts_answers_and_stops_clean(tmp_path):
    before = ray_processes()
    log = tmp_path / "serve.stderr"  # what the server logged: the failure message shows its end
    http, grpc_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # start a cluster of its own
    with log.open("w") as err:  # the child holds its own copy of the descriptor
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ssd.cli",
                "serve",
                "--port",
                str(http),
                "--grpc-port",
                str(grpc_port),
                "--k",
                "4",
                "--default-max-tokens",
                "16",
                "--drain-timeout-s",
                "150",
                "--ray-address",
                "local",
            ],  # never the test session's cluster
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
    try:
        lines, deadline = [], time.monotonic() + 240
        while not any(line.startswith("Ctrl-C") for line in lines):
            assert time.monotonic() < deadline and proc.poll() is None, (lines, log.read_text()[-4000:])
            lines.append(proc.stdout.readline())
        text = "".join(lines)
        assert f"http://127.0.0.1:{http}/v1" in text and f"127.0.0.1:{grpc_port}" in text
        curl = next(line.strip() for line in lines if line.strip().startswith("curl "))
        out = subprocess.run(curl, shell=True, capture_output=True, text=True, timeout=60)
        body = json.loads(out.stdout)
        assert body["choices"][0]["finish_reason"] in ("stop", "length") and body["speculation"][0]["mode"] == "auto"
        assert requests.get(f"http://127.0.0.1:{http}/health", timeout=10).status_code == 200
        drained = drain_under_load(proc, f"http://127.0.0.1:{http}")
    finally:
        if proc.poll() is None and not drained_started(proc):
            proc.send_signal(signal.SIGTERM)
        proc.wait(180)
    assert proc.returncode == 0, log.read_text()[-4000:]
    assert drained["refused"] and all(status == 503 for status in drained["refused"]), drained
    assert drained["health"] == 503, drained
    assert drained["streams"] == [("length", True)] * 4, drained  # each finished, [DONE] included
    assert drained["knocked_at"] < max(drained["ended_at"]), drained  # the knocks came while they ran
    deadline = time.monotonic() + 30
    while ray_processes() - before:
        assert time.monotonic() < deadline, ray_processes() - before
        time.sleep(0.5)


def drained_started(proc) -> bool:
    return getattr(proc, "drain_signalled", False)


def drain_under_load(proc, base: str) -> dict:
    """Open 4 long streams, SIGTERM the server while they run, then knock: every new request
    must get 503 while the streams still finish. -> what was seen."""
    seen = {"streams": [], "refused": [], "health": None, "ended_at": [], "knocked_at": None}
    started = threading.Barrier(5)

    def stream():
        body = {
            "model": "ssd-demo",
            "prompt": "def f(x):",
            "max_tokens": 300,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
            "speculation": {"mode": "ar"},
        }  # plain decoding: outlasts the knocking
        first, finish, done = True, None, False
        with requests.post(base + "/v1/completions", json=body, stream=True, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    if first:
                        first = False
                        started.wait(30)
                    finish = json.loads(line[6:])["choices"][0].get("finish_reason") or finish
                done = done or line == b"data: [DONE]"
        seen["streams"].append((finish, done))
        seen["ended_at"].append(time.monotonic())

    threads = [threading.Thread(target=stream) for _ in range(4)]
    for t in threads:
        t.start()
    started.wait(60)
    proc.send_signal(signal.SIGTERM)
    proc.drain_signalled = True  # one signal only: a second would skip the drain
    # The drain flag reaches the ingress within two report periods: knock once /health says it
    # has (the ingress refuses from then on), or after 1 s in any case.
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline and requests.get(base + "/health", timeout=30).status_code != 503:
        time.sleep(0.05)
    for _ in range(3):
        r = requests.post(
            base + "/v1/completions", json={"model": "ssd-demo", "prompt": "x", "max_tokens": 2}, timeout=30
        )
        seen["refused"].append(r.status_code)
    seen["health"] = requests.get(base + "/health", timeout=30).status_code
    seen["knocked_at"] = time.monotonic()
    for t in threads:
        t.join(150)
    return seen


def test_the_serve_config_file_validates_and_builds():
    from ray.serve.schema import ServeDeploySchema

    from serve_app.app import build_app

    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    schema = ServeDeploySchema.model_validate(config)
    app = schema.applications[0]
    assert app.import_path == "serve_app.app:build_app"
    module, attr = app.import_path.split(":")
    assert getattr(__import__(module, fromlist=[attr]), attr) is build_app
    build_app(app.args)
    for servicer in schema.grpc_options.grpc_servicer_functions:
        module, _, name = servicer.rpartition(".")
        assert callable(getattr(__import__(module, fromlist=[name]), name))
    with pytest.raises(ValueError, match="frobnicate"):
        build_app({**app.args, "frobnicate": 1})


def test_flags_override_the_config_file():
    from serve_app.cli import app_config_from
    from ssd.cli import build_parser

    args = build_parser().parse_args(
        [
            "serve",
            "--config",
            str(ROOT / "serve_config.yaml"),
            "--k",
            "3",
            "--budget",
            "8",
            "--transport",
            "grpc",
            "--target-replicas",
            "2",
            "--draft-pool-size",
            "2",
            "--extra-modes",
            "ar",
        ]
    )
    config = app_config_from(args)
    assert (config.engine.k, config.engine.ssd_budget, config.engine.draft_transport) == (3, 8, "grpc")
    assert config.target_replicas == 2 and config.extra_modes == ["ar"] and config.engine.max_num_seqs == 16
    assert app_config_from(build_parser().parse_args(["serve", "--k", "2"])).engine.mode == "auto"  # the served default
    # The pool's size defaults to what the targets lease: target_replicas x engine.draft_workers.
    for flags, pool in (
        (["--draft-workers", "2"], 2),
        (["--target-replicas", "2"], 2),
        (["--draft-workers", "2", "--target-replicas", "3"], 6),
    ):
        assert app_config_from(build_parser().parse_args(["serve", *flags])).to_settings().draft_pool_size == pool
    with pytest.raises(
        ValueError, match=r"draft_pool_size \(1\) is below target_replicas x engine.draft_workers \(2 x 1 = 2\)"
    ):  # a replica would find no worker
        app_config_from(build_parser().parse_args(["serve", "--target-replicas", "2", "--draft-pool-size", "1"]))
    assert app_config_from(
        build_parser().parse_args(["serve", "--target-replicas", "2", "--mode", "sd", "--extra-modes", "ar"])
    )
