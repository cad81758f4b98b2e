"""Draft workers as Ray actors on a real local Ray cluster (2 CPUs, started once for the module):
greedy output over the torch and grpc transports equals Hugging Face `generate`; a worker
actor killed mid-generation leaves the output unchanged, Ray restarts it, it re-registers, and
the target leases it again; a lost lease registry is replaced and its workers rejoin the new one;
a lease that is not renewed expires and goes to another target; a provider's renewer keeps its
leases past their ttl and its close() gives them back; a worker that cannot start says why;
worker processes carry the title `ray::DraftWorkerActor`.
"""

from __future__ import annotations

import dataclasses
import subprocess
import threading
import time

import pytest

ray = pytest.importorskip("ray")

from test_ssd import check_greedy, finish, generate_until_replaced, greedy, metric, prompts, ssd_llm, tiny_reference  # noqa: E402, F401

from ssd import LLM, EngineArgs  # noqa: E402
from ssd.model.demo_models import VOCAB_SIZE  # noqa: E402


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def ray_llm(*args, **kw):
    """An ssd engine whose draft workers are leased from the Ray pool (the provider passed in)."""
    from actors.leased_workers import leased_workers

    return ssd_llm(*args, worker_provider=leased_workers, **kw)


def pool_snapshot() -> list[dict]:
    from actors.lease_registry import get_or_create_registry

    return ray.get(get_or_create_registry().snapshot.remote())


@pytest.mark.parametrize("transport,workers", [("torch", 2), ("grpc", 1)])
def test_ray_workers_greedy_matches_hf(cluster, tiny_pair, prompts, tiny_reference, transport, workers):
    target, draft = tiny_pair
    with ray_llm(
        target, draft, draft_transport=transport, draft_workers=workers, ssd_backup="neural", max_num_seqs=2
    ) as llm:
        provider = llm.engine.proposer.client.provider
        assert type(provider).__name__ == "RayLeasedWorkers" and len(provider.actors) == workers
        held = [w for w in pool_snapshot() if w["lessee"] == provider.lessee]
        assert len(held) == workers
        check_greedy(llm, prompts, tiny_reference)
        m = llm.metrics()
    assert m["cache_hits"] > 0 and min(m["ssd"]["draft_shard_hits"]) > 0, m
    assert pool_snapshot() == []  # the workers it started left the pool with it


def test_a_killed_worker_actor_restarts_rejoins_and_is_leased_again(cluster, tiny_pair, prompts, tiny_reference):
    target, draft = tiny_pair
    with ray_llm(target, draft, draft_transport="torch", draft_workers=1, ssd_backup="neural", max_num_seqs=2) as llm:
        engine, provider = llm.engine, llm.engine.proposer.client.provider
        before = {w["worker_id"]: w["address"] for w in pool_snapshot()}
        for p in prompts[:2]:
            engine.add_request(p, greedy())
        engine.step()
        engine.step()
        ray.kill(provider.actors[0], no_restart=False)  # Ray restarts it (max_restarts=-1)
        assert finish(engine) == sorted(tiny_reference[:2])
        generate_until_replaced(llm, prompts, tiny_reference)
        after = {w["worker_id"]: w["address"] for w in pool_snapshot()}
        assert set(after) == set(before) and after != before  # the same actor, re-registered at a new port
        hits = llm.metrics()["cache_hits"]
        check_greedy(llm, prompts, tiny_reference)
        assert llm.metrics()["cache_hits"] > hits and metric(llm.metrics(), "draft_worker_failures") == 1


def test_a_lost_lease_registry_is_replaced_and_the_workers_rejoin(cluster, tiny_pair, prompts, tiny_reference):
    """The lease registry killed under a running target: generation goes on over the open channel,
    the worker registers with the new registry within its heartbeat (5 s), and a worker failure
    after that is reported to the new registry, which leases the restarted worker again. Before,
    the worker never rejoined and the target's report to the dead registry failed the round."""
    from actors.lease_registry import REGISTRY_NAME, REGISTRY_NAMESPACE

    target, draft = tiny_pair
    with ray_llm(target, draft, draft_transport="torch", draft_workers=1, ssd_backup="neural", max_num_seqs=2) as llm:
        provider = llm.engine.proposer.client.provider
        workers = {w["worker_id"] for w in pool_snapshot()}
        ray.kill(ray.get_actor(REGISTRY_NAME, namespace=REGISTRY_NAMESPACE))
        check_greedy(llm, prompts, tiny_reference)
        deadline = time.monotonic() + 15
        while {w["worker_id"] for w in pool_snapshot()} != workers:  # pool_snapshot() makes the new registry
            assert time.monotonic() < deadline, pool_snapshot()
            time.sleep(0.5)
        ray.kill(provider.actors[0], no_restart=False)
        generate_until_replaced(llm, prompts, tiny_reference)
        hits = llm.metrics()["cache_hits"]
        check_greedy(llm, prompts, tiny_reference)
        assert llm.metrics()["cache_hits"] > hits


def test_a_live_worker_dropped_from_the_pool_registers_again(cluster, tiny_pair):
    """A target's failure report drops a worker that is in fact alive (it stalled past the
    deadline once, say): its heartbeat (5 s) puts it back. Before, it stayed out for good."""
    from actors.lease_registry import get_or_create_registry
    from actors.leased_workers import start_draft_workers

    config = EngineArgs(target=tiny_pair[0], draft=tiny_pair[1], mode="ssd", k=4, draft_transport="torch").to_config()
    registry = get_or_create_registry()
    actors = start_draft_workers(config, VOCAB_SIZE, 1, registry)
    try:
        address = ray.get(actors[0].address.remote())
        (worker,) = [w for w in ray.get(registry.snapshot.remote()) if w["address"] == address]
        ray.get(registry.report_failed.remote("a-target", worker["worker_id"], address))
        assert not ray.get(
            registry.has.remote(worker["worker_id"], address)
        )  # out (a heartbeat landing in between: 1 in ~2000)
        deadline = time.monotonic() + 12
        while not ray.get(registry.has.remote(worker["worker_id"], address)):
            assert time.monotonic() < deadline, ray.get(registry.snapshot.remote())
            time.sleep(0.25)
    finally:
        for a in actors:
            ray.get(a.shutdown.remote())
            ray.kill(a, no_restart=True)


def test_a_lease_not_renewed_expires_and_another_target_gets_the_worker(cluster, tiny_pair):
    from actors.lease_registry import get_or_create_registry
    from actors.leased_workers import start_draft_workers

    config = EngineArgs(target=tiny_pair[0], draft=tiny_pair[1], mode="ssd", k=4, draft_transport="torch").to_config()
    registry = get_or_create_registry()
    actors = start_draft_workers(config, VOCAB_SIZE, 1, registry)
    try:
        first = ray.get(registry.lease.remote("crashed-target", 1, 1.0))
        assert len(first) == 1 and ray.get(registry.lease.remote("second-target", 1, 1.0)) == []
        time.sleep(1.2)  # the first target never renews
        second = ray.get(registry.lease.remote("second-target", 1, 30.0))
        assert [x.worker_id for x in second] == [first[0].worker_id]
        assert ray.get(registry.renew.remote("crashed-target", [first[0].worker_id], 30.0)) == []
    finally:
        for a in actors:
            ray.get(a.shutdown.remote())
            ray.kill(a, no_restart=True)


def test_ray_launcher_refuses_a_transport_that_cannot_cross_nodes(tiny_pair):
    with pytest.raises(ValueError, match="draft_launcher='ray'.*torch' or 'grpc'"):
        LLM(*tiny_pair, mode="ssd", draft_launcher="ray", draft_transport="shm")


def test_ray_launcher_needs_a_worker_provider(tiny_pair):
    """ssd names no Ray code: draft_launcher='ray' without the provider says what to pass."""
    with pytest.raises(ValueError, match="draft_launcher='ray' needs a worker provider.*worker_provider="):
        LLM(*tiny_pair, mode="ssd", draft_launcher="ray", draft_transport="torch")


def process_titles() -> list[str]:
    return subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout.splitlines()


def test_a_provider_renews_its_leases_and_close_gives_them_back(cluster, tiny_pair):
    from actors.leased_workers import RayLeasedWorkers
    from ssd.core.protocol import DrafterUnavailable

    config = EngineArgs(target=tiny_pair[0], draft=tiny_pair[1], mode="ssd", k=4, draft_transport="grpc").to_config()
    first = RayLeasedWorkers(config, VOCAB_SIZE, lessee="renewing-target", lease_ttl_s=3.0, start_workers=1)
    try:
        assert any(t.startswith("ray::DraftWorkerActor") for t in process_titles()), process_titles()
        link = first.acquire()
        time.sleep(6.5)  # over twice the ttl: only the renewer (every ttl/3) keeps the lease
        assert [w["lessee"] for w in pool_snapshot()] == ["renewing-target"]
        second = RayLeasedWorkers(config, VOCAB_SIZE, lessee="waiting-target", acquire_timeout_s=0.5)
        try:
            with pytest.raises(DrafterUnavailable, match="no free draft worker in the Ray pool within"):
                second.acquire()
            assert_cancel_ends_a_waiting_acquire(config)
            first.discard(link, failed=False)  # released: the other target gets it
            other = second.acquire()
            assert [w["lessee"] for w in pool_snapshot()] == ["waiting-target"]
        finally:
            second.close()
        assert [w["lessee"] for w in pool_snapshot()] == [None]  # close() released it
        other.kill()
    finally:
        first.close()
    assert pool_snapshot() == []  # the worker it started left the pool


def assert_cancel_ends_a_waiting_acquire(config) -> None:
    """A provider waiting for a free worker (up to its 120 s default) gives up as soon as its pool
    closes: a served target replica whose worker had died once waited there on deletion until Ray
    Serve killed it, 30 s later."""
    from actors.leased_workers import RayLeasedWorkers
    from ssd.core.protocol import DrafterUnavailable

    waiting, ended = RayLeasedWorkers(config, VOCAB_SIZE, lessee="closing-target"), []

    def acquire() -> None:
        with pytest.raises(DrafterUnavailable, match="the draft pool is closing"):
            waiting.acquire()
        ended.append(time.monotonic())

    thread = threading.Thread(target=acquire)
    thread.start()
    time.sleep(1.0)  # polling the registry, nothing free
    cancelled = time.monotonic()
    waiting.cancel()
    thread.join(10)
    waiting.close()
    assert ended and ended[0] - cancelled < 1.5, ended


def test_a_worker_that_cannot_start_says_why(cluster, tiny_pair, tmp_path):
    from actors.leased_workers import start_draft_workers
    from ssd.core.protocol import DrafterUnavailable

    config = EngineArgs(target=tiny_pair[0], draft=tiny_pair[1], mode="ssd", k=4, draft_transport="torch").to_config()
    broken = dataclasses.replace(config, draft=str(tmp_path / "no-such-model"))
    with pytest.raises(DrafterUnavailable, match="(?s)failed to start.*no-such-model"):
        start_draft_workers(broken, VOCAB_SIZE, 1, timeout_s=120)
    assert pool_snapshot() == []


def test_draft_worker_resources_refuse_unknown_keys(tiny_pair):
    from actors.leased_workers import start_draft_workers

    config = EngineArgs(target=tiny_pair[0], draft=tiny_pair[1], mode="ssd", k=4, draft_transport="torch").to_config()
    with pytest.raises(ValueError, match="unknown keys \\['gpus'\\]; allowed: \\['num_cpus', 'num_gpus'"):
        start_draft_workers(config, VOCAB_SIZE, 1, registry=object(), resources={"gpus": 1})
