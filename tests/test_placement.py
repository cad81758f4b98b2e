"""What a deployment reserves, and the check `ssd serve` runs before deploying (no Ray needed)."""

from __future__ import annotations

import pytest

from serve_app.app import parse_config
from serve_app.placement import check_fits, cpus_needed, reservations, target_actor_options, target_placement


def config(**kw):
    return parse_config(kw)


def test_a_tensor_parallel_replica_reserves_a_bundle_per_rank():
    """The replica is rank 0 (its own resources fit bundle 0); one bundle per rank, packed on one
    node by default; the strategy is the config's."""
    app = config(engine={"tensor_parallel_size": 4, "device": "cuda"}, target_num_cpus=2, target_num_gpus=1)
    assert target_actor_options(app) == {"num_cpus": 2, "num_gpus": 1}
    assert target_placement(app) == {
        "placement_group_bundles": [{"CPU": 2.0, "GPU": 1.0}] * 4,
        "placement_group_strategy": "STRICT_PACK",
    }
    assert (reservations(app)[0].count, reservations(app)[0].each) == (1, {"CPU": 8.0, "GPU": 4.0})
    spread = config(
        engine={"tensor_parallel_size": 4, "device": "cuda"}, target_num_gpus=1, tensor_parallel_strategy="SPREAD"
    )
    assert target_placement(spread)["placement_group_strategy"] == "SPREAD"
    assert (reservations(spread)[0].count, reservations(spread)[0].each) == (4, {"CPU": 1.0, "GPU": 1.0})
    assert target_placement(config(engine={"mode": "ar"})) == {}  # one rank: no placement group


def test_tensor_parallel_ranks_need_something_in_their_bundles():
    with pytest.raises(ValueError, match="a bundle cannot be empty: set target_num_cpus or target_num_gpus"):
        config(engine={"tensor_parallel_size": 2}, target_num_cpus=0)
    with pytest.raises(ValueError, match="tensor_parallel_strategy"):
        config(engine={"tensor_parallel_size": 2}, tensor_parallel_strategy="ANYWHERE")


def test_reservations_add_up_targets_and_the_draft_pool():
    app = config(engine={"mode": "ssd", "draft_workers": 2}, draft_pool_size=2, target_replicas=1)
    reserved = reservations(app)
    assert [(r.count, r.each) for r in reserved] == [(1, {"CPU": 1.0}), (2, {"CPU": 1.0})]
    assert cpus_needed(reserved) == 3
    custom = config(
        engine={"mode": "ssd", "draft_worker_resources": {"num_cpus": 0.5, "resources": {"draft_node": 1}}},
        extra_modes=[],
    )
    assert reservations(custom)[1].each == {"CPU": 0.5, "draft_node": 1.0}


def test_a_pool_the_cluster_cannot_place_is_refused_naming_numbers_and_flags():
    """The issue's case: `ssd serve --draft-workers 2 --draft-pool-size 2` on a 2-CPU cluster."""
    reserved = reservations(config(engine={"mode": "ssd", "draft_workers": 2}, draft_pool_size=2, extra_modes=[]))
    with pytest.raises(ValueError) as err:
        check_fits(reserved, {"CPU": 2.0}, [{"CPU": 2.0}])
    message = str(err.value)
    assert "reserves 3 CPU (target replicas (1 tensor-parallel rank(s) each) 1 x 1 + draft workers 2 x 1)" in message
    assert "has 2 free" in message and "--draft-pool-size" in message and "--target-num-cpus" in message
    check_fits(reserved, {"CPU": 3.0}, [{"CPU": 3.0}])  # fits


def test_a_replica_larger_than_any_node_is_refused():
    app = config(engine={"mode": "ar", "tensor_parallel_size": 4}, extra_modes=[], target_num_gpus=1)
    reserved = reservations(app)
    nodes = [{"CPU": 16.0, "GPU": 2.0}, {"CPU": 16.0, "GPU": 2.0}]
    with pytest.raises(ValueError, match="reserves 4 CPU, 4 GPU on one node, and no node"):
        check_fits(reserved, {"CPU": 32.0, "GPU": 4.0}, nodes)
    check_fits(reserved, {"CPU": 32.0, "GPU": 4.0}, [{"CPU": 16.0, "GPU": 4.0}])
    # Ranks that may be spread need only a node for each.
    spread = config(
        engine={"mode": "ar", "tensor_parallel_size": 4},
        extra_modes=[],
        target_num_gpus=1,
        tensor_parallel_strategy="PACK",
    )
    check_fits(reservations(spread), {"CPU": 32.0, "GPU": 4.0}, nodes)


def test_a_missing_custom_resource_is_refused():
    app = config(engine={"mode": "ssd", "draft_worker_resources": {"resources": {"draft_node": 1}}}, extra_modes=[])
    with pytest.raises(ValueError, match="reserves 1 draft_node .* has 0 free"):
        check_fits(reservations(app), {"CPU": 8.0}, [{"CPU": 8.0}])


def test_a_redeploy_counts_what_the_running_app_holds_as_free():
    """`ssd serve` on a cluster that already runs its app replaces that app: the old replicas'
    reservations (Ray's actor states) count as free, other applications' and actors' do not."""
    from types import SimpleNamespace

    from serve_app.placement import held_by_app

    actors = [
        SimpleNamespace(class_name="ServeReplica:ssd:Target", required_resources={"CPU": 2.0}),
        SimpleNamespace(class_name="ServeReplica:ssd:DraftPool", required_resources={"CPU": 1.0}),
        SimpleNamespace(class_name="ServeReplica:ssd:Ingress", required_resources=None),
        SimpleNamespace(class_name="ServeReplica:other:Target", required_resources={"CPU": 4.0}),
        SimpleNamespace(class_name="ServeController", required_resources={"CPU": 0.0}),
    ]
    assert held_by_app("ssd", actors) == {"CPU": 3.0}
    reserved = reservations(config(engine={"mode": "ssd"}, draft_pool_size=1, extra_modes=[]))
    assert cpus_needed(reserved) == 2
    with pytest.raises(ValueError, match="reserves 2 CPU"):
        check_fits(reserved, {"CPU": 0.0}, [{"CPU": 3.0}])  # the running app holds the cluster's 3 CPUs
    check_fits(reserved, held_by_app("ssd", actors), [{"CPU": 3.0}])
    # A tensor-parallel replica's placement group (named as the replica is) holds its resources
    # and its ranks'; the replica's own, inside bundle 0, are not counted twice.
    replica = "SERVE_REPLICA::ssd#Target#abc"
    grouped = [SimpleNamespace(class_name="ServeReplica:ssd:Target", name=replica, required_resources={"CPU": 1.0})]
    groups = [
        SimpleNamespace(name=replica, state="CREATED", bundles=[{"unit_resources": {"CPU": 1.0}}] * 2),
        SimpleNamespace(
            name="SERVE_REPLICA::other#Target#x", state="CREATED", bundles=[{"unit_resources": {"CPU": 4.0}}]
        ),
    ]
    assert held_by_app("ssd", grouped, groups) == {"CPU": 2.0}


def test_a_refused_deploy_on_a_joined_cluster_stops_nothing_there(monkeypatch):
    """A bug fixed: `ssd serve --ray-address ...` whose check refused the deploy went on to its
    shutdown, which stopped Serve on the joined cluster and the application running there."""
    import argparse

    from ray import serve

    import serve_app.cli as cli

    stopped = []
    monkeypatch.setattr(cli, "_start_ray", lambda *a: False)  # joined, not started
    monkeypatch.setattr(cli, "cluster_view", lambda app=None: ({"CPU": 0.0}, [{"CPU": 2.0}]))
    monkeypatch.setattr(serve, "shutdown", lambda: stopped.append("serve.shutdown"))
    monkeypatch.setattr(serve, "delete", lambda name: stopped.append(f"serve.delete {name}"))
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    with pytest.raises(ValueError, match="reserves 2 CPU"):
        cli.run(parser.parse_args(["--ray-address", "127.0.0.1:6379", "--mode", "ssd", "--extra-modes"]))
    assert stopped == []


@pytest.mark.parametrize("current, stopped", [("me", ["serve.delete ssd", "board removed"]), ("later", [])])
def test_exiting_on_a_joined_cluster_stops_only_its_own_deploy(monkeypatch, current, stopped):
    """On a joined cluster `ssd serve` deletes its application when it exits, unless a later
    `ssd serve` has replaced it since (then it is that one's); Serve itself stays."""
    import threading
    from types import SimpleNamespace

    from ray import serve

    import serve_app.cli as cli
    import serve_app.drain as drain

    calls = []
    monkeypatch.setattr(drain, "deployed_by", lambda app: current)
    monkeypatch.setattr(drain, "remove_board", lambda app: calls.append("board removed"))
    monkeypatch.setattr(serve, "shutdown", lambda: calls.append("serve.shutdown"))
    monkeypatch.setattr(serve, "delete", lambda name: calls.append(f"serve.delete {name}"))
    cli._shutdown(False, SimpleNamespace(draining=threading.Event()), "me")
    assert calls == stopped
