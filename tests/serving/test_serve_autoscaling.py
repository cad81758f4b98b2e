"""Target replicas that follow the load, and a draft pool that follows the targets, on the real
Ray Serve: a load of concurrent greedy requests raises the targets from 1 replica to 2, the new
replica's engine asks the lease registry for a worker, and the pool grows by one; idle, both fall
back to 1. Every request succeeds, with the text of the target alone, throughout. Fractional CPU
reservations, so that it fits beside the package's other applications on 2 cores.

The times it prints (`pytest tests/serving/test_serve_autoscaling.py -s`) are the figures of
docs/operations.md, "Autoscaling".
"""

from __future__ import annotations

import threading
import time

import pytest

requests = pytest.importorskip("requests")

import ray  # noqa: E402
from ray import serve  # noqa: E402

from serving.test_serve_pool_and_ranks import complete, deploy  # noqa: E402
from serving.test_serve_reliability import pool_actor, replicas, wait_for  # noqa: E402

NAME = "scaling"
PROMPTS = [f"def h{i}(z):\n    return" for i in range(6)]
SCALING = {
    "min_replicas": 1,
    "max_replicas": 2,
    "target_ongoing_requests": 2,
    "upscale_delay_s": 0,
    "downscale_delay_s": 4,
    "look_back_period_s": 1.5,
}


def running(deployment: str) -> int:
    """Serve's own count of the deployment's running replicas."""
    status = serve.status().applications[NAME].deployments[deployment]
    return status.replica_states.get("RUNNING", 0)


def leased_by_targets() -> int:
    """Workers the lease registry has leased to this application's targets."""
    return sum((w["lessee"] or "").startswith(f"{NAME}/") for w in ray.get(pool_actor().snapshot.remote()))


class Load:
    """`users` threads sending greedy requests back to back until stop(); every answer kept."""

    def __init__(self, served, users: int) -> None:
        self.served, self.answers, self.stopped = served, [], threading.Event()
        self.threads = [threading.Thread(target=self._user, args=(i,)) for i in range(users)]
        for t in self.threads:
            t.start()

    def _user(self, i: int) -> None:
        while not self.stopped.is_set():
            r = complete(self.served, NAME, PROMPTS[i % len(PROMPTS)])
            text = r.json()["choices"][0]["text"] if r.status_code == 200 else r.text
            self.answers.append((i % len(PROMPTS), r.status_code, text))

    def stop(self) -> None:
        self.stopped.set()
        for t in self.threads:
            t.join(120)


def test_targets_follow_the_load_and_the_pool_follows_the_targets(served, tiny_pair):
    deploy(
        served,
        tiny_pair,
        NAME,
        {"mode": "ssd", "draft_worker_resources": {"num_cpus": 0.5}},
        target_autoscaling=SCALING,
        target_num_cpus=0.5,
    )
    load = None
    try:
        wait_for(lambda: running("Target") == 1 and leased_by_targets() == 1, 60, "one target leasing one worker")
        alone = [complete(served, NAME, p, mode="ar").json()["choices"][0]["text"] for p in PROMPTS]

        started = time.monotonic()
        load = Load(served, users=6)
        wait_for(lambda: running("Target") == 2, 90, "a second target replica under load")
        up_s = time.monotonic() - started
        assert running("DraftPool") == 2 and leased_by_targets() == 2  # the new target holds its own worker
        load.stop()
        assert {status for _, status, _ in load.answers} == {200}, load.answers
        idle = time.monotonic()
        wait_for(lambda: running("Target") == 1, 60, "back to one target replica when idle")
        down_s = time.monotonic() - idle
        wait_for(lambda: running("DraftPool") == 1 and leased_by_targets() == 1, 60, "the pool back to one worker")
        pool_down_s = time.monotonic() - idle

        after = [complete(served, NAME, p).json()["choices"][0]["text"] for p in PROMPTS]
        assert [text for i, _, text in load.answers] == [alone[i] for i, _, _ in load.answers]
        assert after == alone
        print(
            f"\nautoscaling: {len(load.answers)} requests, 0 failed; load to 2 targets serving {up_s:.1f} s; "
            f"idle to 1 target {down_s:.1f} s, to 1 draft worker {pool_down_s:.1f} s"
        )
    finally:
        if load is not None:
            load.stop()
        serve.delete(NAME)
        assert not replicas(NAME, "DraftPool") and not leased_by_targets()
