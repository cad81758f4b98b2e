"""A tensor-parallel target's ranks 1..t-1 as Ray actors, in the placement group Serve reserved for
the replica.

A served target replica with t ranks is deployed with t placement-group bundles (one per rank;
serve_app/placement.py): Serve starts the replica, which is rank 0, in bundle 0, and `RayRanks`
starts rank r as a `TensorParallelRank` actor in bundle r. Ray then decides where each rank runs
(one node by default, the strategy being the Serve config's), every rank's GPUs are the ones its
bundle reserved (so each rank sees its own device as cuda:0), and the ranks' lifetime is Ray's:
the actors are owned by the replica's process, so they die with it however it ends, and Serve
replaces a replica whose health check finds a rank gone.

The rank's work is ssd's own `run_rank`, the same function a child-process rank runs; the actor
only gives it a process and an address.
"""

from __future__ import annotations

import logging

import ray
from ray.exceptions import RayError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ssd.model.tp_launch import describe_ended, run_rank

logger = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 10.0  # for the ranks to return after STOP before they are killed


@ray.remote(max_restarts=0)
class TensorParallelRank:
    """One rank of a tensor-parallel target: runs rank 0's steps until STOP (one call of run)."""

    def run(self, spec: dict) -> None:
        logging.getLogger("ssd").setLevel(spec["log_level"])
        run_rank(spec, ray.util.get_node_ip_address())


class RankActors:
    """Ranks 1..t-1 as actors (ssd.model.tp_launch's RankGroup). Each rank's `run` call is pending
    for as long as the rank runs, so a finished call is a rank that ended: how, ray.get says."""

    def __init__(self, spec: dict, resources: dict, group) -> None:
        self.actors: dict[int, ray.actor.ActorHandle] = {}
        self.calls: dict[int, ray.ObjectRef] = {}
        try:
            for rank in range(1, spec["world"]):
                actor = TensorParallelRank.options(
                    **resources,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank),
                ).remote()
                self.actors[rank] = actor
                self.calls[rank] = actor.run.remote({**spec, "rank": rank})
        except BaseException:
            self.close(kill=True)
            raise

    def poll(self) -> dict[int, str]:
        ended = {}
        done, _ = ray.wait(list(self.calls.values()), num_returns=len(self.calls), timeout=0)
        for rank, call in self.calls.items():
            if call in done:
                ended[rank] = _how_it_ended(call)
        return ended

    def describe(self) -> str:
        return describe_ended(self.poll())

    def close(self, kill: bool) -> None:
        if not kill and self.calls:
            ray.wait(list(self.calls.values()), num_returns=len(self.calls), timeout=CLOSE_TIMEOUT_S)
        for actor in self.actors.values():
            ray.kill(actor, no_restart=True)  # after run returned, an actor would still hold its bundle


def _how_it_ended(call: ray.ObjectRef) -> str:
    try:
        ray.get(call, timeout=0)
    except RayError as err:  # the actor died (its process killed, its node lost) or run raised
        first = (str(err).strip().splitlines() or [""])[0]
        return f"ended: {type(err).__name__}: {first}"
    return "returned"


class RayRanks:
    """The launcher a served target replica passes its engine (ssd.model.tp_launch's
    RankLauncher): each rank an actor reserving `resources` (Ray actor options: num_cpus,
    num_gpus) in bundle r of the placement group the calling replica runs in."""

    one_device_each = True  # Ray gives each actor only its bundle's GPUs, so each sees cuda:0

    def __init__(self, resources: dict) -> None:
        self.resources = dict(resources)
        self.host = ray.util.get_node_ip_address()
        self.group = ray.util.get_current_placement_group()
        if self.group is None:
            raise ValueError(
                "a tensor-parallel target replica runs its ranks in the placement group Serve reserves for it; "
                "this process runs in none: deploy it with placement_group_bundles (serve_app.app does)"
            )

    def start(self, spec: dict) -> RankActors:
        return RankActors(spec, self.resources, self.group)
