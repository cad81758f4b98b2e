"""Served layouts beyond one draft worker and one device, on the real Ray Serve:

1. a pool of two draft workers sharing each round's tree (engine.draft_workers = 2), over grpc:
   concurrent greedy streams equal the target alone (the same app's mode "ar"), also when one
   of the two leased workers is killed mid-stream (over torch, a killed worker is
   test_serve_reliability's, and a served pool on another host test_two_hosts');
2. a target split over two tensor-parallel ranks, rank 1 an actor in the placement group Serve
   reserved for the replica: it answers as the target alone does; a rank killed gets the client
   the engine-failed status, and Serve replaces the replica, which then serves.
"""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

requests = pytest.importorskip("requests")

import ray  # noqa: E402
from ray import serve  # noqa: E402

from serving.test_serve_reliability import pool_workers, post, replicas, stream_all, wait_for  # noqa: E402

PROMPTS = [f"def g{i}(y):\n    return" for i in range(6)]
MAX_TOKENS = 40


def deploy(served, tiny_pair, name: str, engine: dict, **app) -> None:
    from serve_app.app import build_app

    target, draft = tiny_pair
    config = {
        "engine": {"target": target, "draft": draft, "k": 4, "max_num_seqs": 8, "draft_deadline_s": 2.0, **engine},
        "extra_modes": ["ar"],
        "model_name": name,
        "api_key": served.api_key,
        "health_check_period_s": 1.0,  # replicas replaced in seconds, not 15
        **app,
    }
    serve.run(build_app(config), name=name, route_prefix=f"/{name}")


def complete(served, name: str, prompt: str, mode: str | None = None):
    body = {"model": name, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    if mode is not None:
        body["speculation"] = {"mode": mode}
    return post(served, f"/{name}/v1/completions", body)


def streams(served, name: str, on_all_started=None) -> list[str]:
    """The prompts as concurrent greedy streams -> their texts; on_all_started() once each has a chunk."""
    out = stream_all(served, on_all_started, app=name, model=name, prompts=PROMPTS, max_tokens=MAX_TOKENS)
    return [text for text, _ in out]


@pytest.mark.parametrize("transport", ["grpc"])
def test_two_worker_pool_streams_equal_the_target_alone_with_a_worker_killed(served, tiny_pair, transport):
    name = f"pool-{transport}"
    deploy(
        served, tiny_pair, name, {"mode": "ssd", "draft_workers": 2, "draft_transport": transport}, draft_pool_size=2
    )
    try:
        wait_for(lambda: len(pool_workers(name)) == 2, 60, "both draft workers registered")
        alone = [complete(served, name, p, mode="ar").json()["choices"][0]["text"] for p in PROMPTS]
        response = complete(served, name, PROMPTS[0]).json()
        assert response["choices"][0]["text"] == alone[0]
        assert response["speculation"][0]["cache_hits"] > 0, response  # the pool drafted

        def kill_one_leased():
            leased = [w["worker_id"].removeprefix("serve-") for w in pool_workers(name) if w["lessee"]]
            assert len(leased) == 2, pool_workers(name)  # D = 2: the target leases both
            ray.kill(replicas(name, "DraftPool")[leased[0]], no_restart=True)

        assert streams(served, name, kill_one_leased) == alone
    finally:
        serve.delete(name)


def _rank_pids() -> list[int]:
    out = subprocess.run(["pgrep", "-f", "ray::TensorParallelRank"], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _replica_groups(app: str) -> list[dict]:
    """The placement groups Serve reserved for the app's target replicas (named as each replica is),
    from the GCS's table (the state API would need a dashboard)."""
    from ray.util import placement_group_table

    prefix = f"SERVE_REPLICA::{app}#Target#"
    return [g for g in placement_group_table().values() if g["name"].startswith(prefix) and g["state"] == "CREATED"]


def test_a_tensor_parallel_target_serves_and_a_dead_rank_gets_it_replaced(served, tiny_pair):
    name = "tp"
    deploy(served, tiny_pair, name, {"mode": "sd", "tensor_parallel_size": 2})
    try:
        first = set(wait_for(lambda: replicas(name, "Target"), 60, "the target replica"))
        alone = complete(served, name, PROMPTS[0], mode="ar")
        assert alone.status_code == 200, alone.text
        speculated = complete(served, name, PROMPTS[0])
        assert speculated.json()["choices"][0]["text"] == alone.json()["choices"][0]["text"]
        ranks = _rank_pids()
        assert len(ranks) == 1, ranks  # rank 1; rank 0 is the replica itself
        (group,) = _replica_groups(name)  # one bundle per rank, on one node
        assert group["strategy"] == "STRICT_PACK" and list(group["bundles"].values()) == [{"CPU": 1.0}] * 2, group
        os.kill(ranks[0], signal.SIGKILL)
        failed = complete(served, name, PROMPTS[1])
        if failed.status_code == 200:  # the health check (every 5 s) caught the dead rank first
            assert set(replicas(name, "Target")) != first, "served by the replica that lost its rank"
        else:
            assert failed.status_code in (500, 503), failed.text
            assert failed.json()["error"]["code"] == "engine_failed", failed.text
        # Serve's health check finds the replica unhealthy and starts another, which serves.
        wait_for(lambda: set(replicas(name, "Target")) - first, 90, "a replacement target replica")
        served_again = wait_for(
            lambda: (r := complete(served, name, PROMPTS[0])).status_code == 200 and r, 90, "served"
        )
        assert served_again.json()["choices"][0]["text"] == alone.json()["choices"][0]["text"]
        assert len(_rank_pids()) == 1  # the new replica's rank; the old one's are gone
    finally:
        serve.delete(name)
    wait_for(lambda: not _rank_pids(), 30, "no rank left after the app is deleted")
