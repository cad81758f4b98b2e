"""The GCS of a Ray cluster killed and started again under load, with the Serve application
serving throughout (tests/serving/test_gcs_restart.py runs this file as a script; it can also
be run by hand, see main()).

A process of its own, because it owns a Ray cluster that no other test may see: a head node
(`ray.cluster_utils.Cluster`) whose GCS stores its tables in the external Redis named by
RAY_REDIS_ADDRESS (GCS fault tolerance), every port picked by the OS, under a Ray temp directory
of its own (so /tmp/ray/ray_current_cluster, which a bare `ray.init()` connects to, is not
written). The head node object lives in this process, so this process can kill the GCS server
and start it again with the command line, port and session it had: what a head pod's restart
does to the GCS, while the raylet, Serve's controller, proxy and replicas keep running.
Rather than `ray start --head` with the GCS's command line read off /proc and run again by
hand: the Node object already keeps that process, its arguments and the port it bound, and
its kill_gcs_server() / start_gcs_server() are the path Ray's own GCS fault-tolerance tests
take, so the restart is exactly Ray's.

Sequence: deploy the application (SSD over a pool of one draft worker, so the lease registry is
in play); greedy reference texts; client threads send greedy /v1/completions through Serve's
HTTP proxy without pause, and two long streams are opened; once both are generating, the GCS
is killed (SIGKILL), stays down `down_s` seconds (meanwhile this driver looks up a named actor
and creates a new one, which wait for the GCS), and is started again; the clients go on for
`after_s` seconds more; then the state of the cluster is read (Serve's status, the live actors
and their processes, the lease registry) and everything is shut down. The result is one JSON
object written to `out`, checked by the test, with every process the cluster had so the test
can check that none outlived it.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import threading
import time

PROMPTS = [f"def g{i}(x):\n    return" for i in range(8)]
MAX_TOKENS = 24
LONG_MAX_TOKENS = 400  # streams opened just before the kill, still running while the GCS is down


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def app_config(target: str, draft: str) -> dict:
    return {
        "engine": {
            "target": target,
            "draft": draft,
            "mode": "ssd",
            "k": 4,
            "ssd_budget": 12,
            "ssd_autobudget": False,
            "draft_transport": "torch",
            "max_num_seqs": 8,
        },
        "extra_modes": [],
        "draft_pool_size": 1,
        "target_num_cpus": 1,
        "model_name": "tiny",
        "api_key": None,
    }


def complete(base: str, prompt: str, max_tokens: int = MAX_TOKENS, timeout: float = 120) -> tuple[int, str]:
    import requests

    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    r = requests.post(base + "/v1/completions", json=body, timeout=timeout)
    return r.status_code, (r.json()["choices"][0]["text"] if r.status_code == 200 else r.text[:300])


def stream(base: str, prompt: str, max_tokens: int, started: threading.Event | None = None) -> tuple[int, str]:
    """A streamed completion -> (status, its text); a stream cut short is status 0. `started` is
    set once its first chunk has arrived (the request is admitted and generating)."""
    import requests

    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    text, finished = [], False
    with requests.post(base + "/v1/completions", json=body, stream=True, timeout=120) as r:
        if r.status_code != 200:
            return r.status_code, r.text[:300]
        for line in r.iter_lines():
            if not line.startswith(b"data: "):
                continue
            if line == b"data: [DONE]":
                finished = True
                break
            chunk = json.loads(line[6:])
            text.append(chunk["choices"][0]["text"])
            if started is not None:
                started.set()
    return (200 if finished else 0), "".join(text)


def wait_for_port(address: str, timeout_s: float = 60) -> None:
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def live_actors() -> dict[str, str]:
    """Actor id -> class name of every ALIVE actor, read from the GCS."""
    import ray

    return {a: info["ActorClassName"] for a, info in ray._private.state.actors(actor_state_name="ALIVE").items()}


def cluster_processes() -> list[dict]:
    """Every process of the cluster: this driver's descendants (the head node's processes are
    its children, and the workers the raylet's), with their start times so that a later check
    cannot mistake a reused pid for one of them."""
    import psutil

    procs = []
    for p in psutil.Process().children(recursive=True):
        try:
            title = " ".join(p.cmdline())[:80] or p.name()
            procs.append({"pid": p.pid, "create_time": p.create_time(), "title": title})
        except psutil.Error:  # exited meanwhile
            pass
    return procs


def process_kind(title: str) -> str:
    """A process title's kind: ray::Actor, raylet, gcs_server, ... (arguments dropped)."""
    first = title.split()[0] if title.split() else title
    if first.startswith("ray::"):  # ray::Class, or ray::Class.method while it runs one
        return first.split(".")[0]
    return os.path.basename(first)


def serve_state() -> dict:
    from ray import serve

    status = serve.status()
    app = status.applications["main"]
    return {
        "app": str(app.status.value if hasattr(app.status, "value") else app.status),
        "deployments": {
            name: {
                "status": str(d.status.value if hasattr(d.status, "value") else d.status),
                "replicas": {str(k.value if hasattr(k, "value") else k): v for k, v in d.replica_states.items()},
            }
            for name, d in app.deployments.items()
        },
        "proxies": {n: str(p.value if hasattr(p, "value") else p) for n, p in status.proxies.items()},
    }


def run(result: dict, target: str, draft: str, down_s: float, clients: int, after_s: float, before_s: float) -> None:
    """Fills `result` as it goes (so that what was measured before an error is kept)."""
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster
    from ray.serve.config import HTTPOptions

    from actors.lease_registry import REGISTRY_NAME, REGISTRY_NAMESPACE
    from serve_app.app import build_app
    from serve_app.drain import BOARD_NAMESPACE, board_name

    timings: dict[str, float] = {}
    t0 = time.monotonic()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 4,
            "include_dashboard": False,
            "dashboard_agent_listen_port": free_port(),
            "metrics_export_port": free_port(),
            "runtime_env_agent_port": free_port(),
            "object_store_memory": 100 * 1024 * 1024,
        },
    )
    result.update(redis=os.environ.get("RAY_REDIS_ADDRESS"), session_dir=cluster.head_node.get_session_dir_path())
    seen: dict[tuple[int, float], dict] = {}
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        http_port = free_port()
        base = f"http://127.0.0.1:{http_port}"
        serve.start(http_options=HTTPOptions(host="127.0.0.1", port=http_port))
        serve.run(build_app(app_config(target, draft)), name="main", route_prefix="/")
        timings["deployed_s"] = time.monotonic() - t0

        # The greedy reference texts, all prompts at once (one batch; greedy text does not
        # depend on what else is in the batch, which the load below relies on anyway).
        answers: dict[str, tuple[int, str]] = {}
        first = [threading.Thread(target=lambda p=p: answers.__setitem__(p, complete(base, p))) for p in PROMPTS]
        for t in first:
            t.start()
        for t in first:
            t.join(timeout=150)
        reference = {}
        for p in PROMPTS:
            status, text = answers.get(p, (-1, "no answer within 150 s"))
            assert status == 200, (status, text)
            reference[p] = text
        registry = ray.get_actor(REGISTRY_NAME, namespace=REGISTRY_NAMESPACE)
        result["pool_before"] = ray.get(registry.snapshot.remote())
        actors_before = live_actors()
        pids_before = list(ray._private.state.actors(actor_state_name="ALIVE").values())
        result["serve_before"] = serve_state()

        records: list[dict] = []
        stop = threading.Event()
        lock = threading.Lock()

        def client(i: int) -> None:
            n = 0
            while not stop.is_set():
                p = PROMPTS[(i + n * clients) % len(PROMPTS)]
                n += 1
                start = time.monotonic()
                try:
                    status, text = complete(base, p)
                except Exception as err:  # noqa: BLE001 - any error (refused, reset, timeout) is a failed request
                    status, text = -1, repr(err)
                with lock:
                    records.append(
                        {
                            "start": start,
                            "end": time.monotonic(),
                            "status": status,
                            "same": text == reference[p],
                            "text": text[:200],
                        }
                    )

        long_results: list[dict] = []

        def long_stream(i: int, started: threading.Event) -> None:
            start = time.monotonic()
            try:
                status, text = stream(base, PROMPTS[i], LONG_MAX_TOKENS, started)
            except Exception as err:  # noqa: BLE001 - any error (refused, reset, timeout) is a failed stream
                status, text = -1, repr(err)
            with lock:
                long_results.append(
                    {"prompt": i, "start": start, "end": time.monotonic(), "status": status, "text": text}
                )

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
        t_load = time.monotonic()
        for t in threads:
            t.start()
        time.sleep(before_s)
        admitted = [threading.Event() for _ in range(2)]
        longs = [threading.Thread(target=long_stream, args=(i, admitted[i]), daemon=True) for i in range(2)]
        for t in longs:
            t.start()
        for event in admitted:  # both long streams admitted and generating
            event.wait(timeout=60)

        procs_before = cluster_processes()
        seen.update({(p["pid"], p["create_time"]): p for p in procs_before})
        gcs_pid = cluster.head_node.all_processes["gcs_server"][0].process.pid
        t_kill = time.monotonic()
        cluster.head_node.kill_gcs_server()
        t_dead = time.monotonic()
        control: dict = {}

        @ray.remote(num_cpus=0)
        class Probe:
            def ping(self) -> str:
                return "pong"

        def control_calls() -> None:
            """Control-plane calls made while the GCS is down: the lookup of a named actor this
            driver has not looked up before (the drain board), then a new actor and a call to it."""
            start = time.monotonic()
            try:
                ray.get_actor(board_name("main"), namespace=BOARD_NAMESPACE)
                control["lookup_end"] = time.monotonic()
                probe = Probe.remote()
                control["pong"] = ray.get(probe.ping.remote(), timeout=120)
                control["actor_end"] = time.monotonic()
                control["probe_id"] = probe._actor_id.hex()
                ray.kill(probe)
            except Exception as err:  # noqa: BLE001 - reported
                control["error"] = repr(err)[:300]
            control["start"] = start

        time.sleep(min(1.0, down_s / 2))
        prober = threading.Thread(target=control_calls, daemon=True)
        prober.start()
        time.sleep(max(0.0, down_s - min(1.0, down_s / 2)))
        t_restart = time.monotonic()
        cluster.head_node.start_gcs_server()
        # The GCS binds its port once it has loaded its tables from Redis (a call from this
        # driver before that would wait in its GCS client; one to a GCS that lost the tables
        # aborts the process on its cluster-id check, so this only connects).
        wait_for_port(cluster.head_node.gcs_address)
        t_ready = time.monotonic()
        time.sleep(after_s)
        stop.set()
        for t in threads + longs + [prober]:
            t.join(timeout=150)
        t_end = time.monotonic()

        # The long streams' reference: the same prompts on the same replicas, with no fault
        # under way (greedy, so any difference is the outage's).
        again: dict[int, str] = {}
        refs = [
            threading.Thread(target=lambda i=i: again.__setitem__(i, stream(base, PROMPTS[i], LONG_MAX_TOKENS)[1]))
            for i in range(len(longs))
        ]
        for t in refs:
            t.start()
        for t in refs:
            t.join(timeout=150)
        for r in long_results:
            r["same"] = r["text"] == again.get(r["prompt"])
            r["in_flight_at_kill"] = r["start"] < t_kill < r["end"]
            r["spans_outage"] = r["start"] < t_kill and r["end"] > t_restart
            r["text"] = r["text"][:80]

        def phase(r: dict) -> str:
            if r["end"] < t_kill:
                return "before"
            if r["start"] > t_ready:
                return "after"
            if r["start"] < t_kill:
                return "admitted_before_kill"
            if r["end"] < t_restart:
                return "within_outage"
            return "during"

        phases: dict[str, dict[str, int]] = {}
        for r in records:
            p = phases.setdefault(phase(r), {"ok": 0, "failed": 0, "different": 0})
            p["ok" if r["status"] == 200 else "failed"] += 1
            p["different"] += r["status"] == 200 and not r["same"]
        result.update(
            phases=phases,
            failures=[r for r in records if r["status"] != 200][:10],
            different=[r for r in records if r["status"] == 200 and not r["same"]][:10],
            requests=len(records),
            long_streams=long_results,
            gcs_pid_killed=gcs_pid,
            gcs_pid_new=cluster.head_node.all_processes["gcs_server"][0].process.pid,
            gcs_down_s=round(t_ready - t_dead, 2),
            gcs_kill_s=round(t_dead - t_kill, 2),
            gcs_start_s=round(t_ready - t_restart, 2),
            control_calls={
                "error": control.get("error"),
                "started_after_kill_s": round(control["start"] - t_dead, 2),
                "lookup_waited_s": round(control["lookup_end"] - control["start"], 2),
                "lookup_returned_after_restart": control["lookup_end"] >= t_restart,
                "new_actor_waited_s": round(control["actor_end"] - control["start"], 2),
                "new_actor_answered_after_restart": control["actor_end"] >= t_restart,
                "new_actor": control["pong"],
            }
            if "pong" in control
            else control,
            load_s=round(t_end - t_load, 1),
        )

        # The probe actor (killed above) gone from the table before the actors are compared.
        deadline = time.monotonic() + 30
        while "probe_id" in control and time.monotonic() < deadline:
            if ray._private.state.actors(actor_id=control["probe_id"]).get("State") == "DEAD":
                break
            time.sleep(0.1)
        # After: the same cluster, the same actors, the application healthy, the registry intact.
        result["serve_after"] = serve_state()
        actors_after = live_actors()
        result["actors_before"] = sorted(actors_before.values())
        result["actors_after"] = sorted(actors_after.values())
        result["actors_same_ids"] = set(actors_before) == set(actors_after)
        result["actors_added"] = sorted(actors_after[a] for a in set(actors_after) - set(actors_before))
        result["actors_lost"] = sorted(actors_before[a] for a in set(actors_before) - set(actors_after))
        again = ray.get_actor(REGISTRY_NAME, namespace=REGISTRY_NAMESPACE)
        result["registry_same_actor"] = again._actor_id == registry._actor_id
        result["pool_after"] = ray.get(again.snapshot.remote())

        procs_after = cluster_processes()
        seen.update({(p["pid"], p["create_time"]): p for p in procs_after})
        result["process_kinds_before"] = sorted(process_kind(p["title"]) for p in procs_before)
        result["process_kinds_after"] = sorted(process_kind(p["title"]) for p in procs_after)
        result["actor_pids_same"] = {a["Pid"] for a in pids_before} == {
            a["Pid"] for a in ray._private.state.actors(actor_state_name="ALIVE").values()
        }

        timings["total_s"] = time.monotonic() - t0
        result["timings"] = {k: round(v, 1) for k, v in timings.items()}
    finally:
        # The processes this cluster had (at the kill, after the restart and now), for the
        # test's leak check once this driver has exited.
        seen.update({(p["pid"], p["create_time"]): p for p in cluster_processes()})
        result["processes"] = list(seen.values())
        t_down = time.monotonic()
        try:
            serve.shutdown()
        except Exception:  # noqa: BLE001 - a cluster whose GCS never came back: tear down the rest
            pass
        ray.shutdown()
        cluster.shutdown()
        result["teardown_s"] = round(time.monotonic() - t_down, 1)


def main() -> None:
    """python tests/serving/gcs_restart_driver.py TARGET DRAFT OUT.json [--down-s 5] with
    RAY_REDIS_ADDRESS=host:port (without it, the GCS has no external storage: the broken setup)
    and RAY_TMPDIR set to a directory of its own."""
    parser = argparse.ArgumentParser()
    parser.add_argument("target")
    parser.add_argument("draft")
    parser.add_argument("out")
    parser.add_argument("--down-s", type=float, default=5.0)
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--before-s", type=float, default=2.0)
    parser.add_argument("--after-s", type=float, default=4.0)
    args = parser.parse_args()
    result: dict = {}
    try:
        run(result, args.target, args.draft, args.down_s, args.clients, args.after_s, args.before_s)
    except BaseException as err:  # noqa: BLE001 - reported to the test, with the traceback
        import traceback

        result.update(error=f"{type(err).__name__}: {err}", traceback=traceback.format_exc()[-4000:])
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, default=str)


if __name__ == "__main__":
    main()
