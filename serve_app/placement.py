"""What a deployment reserves from Ray, and whether the cluster can give it, checked before
deploying.

Serve places a replica only where its reservation fits, and a replica that never fits waits
forever: `/health` answers 503 and only Ray's scheduler log says why. So `ssd serve` adds up the
reservations (target replicas x tensor-parallel ranks, the draft pool), compares them with the
cluster it started or joined, and refuses to deploy what cannot be placed, naming the numbers and
the flags that change them. A cluster `ssd serve` starts itself is given enough logical CPUs for
the reservations (Ray's CPUs are a scheduling count, not cores: on a 2-core machine the draft
workers and the target share the cores whatever Ray is told).

A target replica with tensor_parallel_size t reserves a placement group of t bundles, one per
rank, of target_num_cpus CPUs and target_num_gpus GPUs each, placed by tensor_parallel_strategy
(STRICT_PACK, one node, by default): the replica is rank 0 in bundle 0, and starts ranks 1..t-1
as actors in the others (actors/tp_ranks.py).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

from serve_app.config import AppConfig

logger = logging.getLogger(__name__)

# Flags that change each kind of reservation, for the messages.
_TARGET_FLAGS = (
    "--target-replicas, --target-num-cpus, --target-num-gpus, --tensor-parallel-size, --tensor-parallel-strategy"
)
_DRAFT_FLAGS = "--draft-pool-size, --draft-workers, --draft-worker-resources"


@dataclass(frozen=True)
class Reservation:
    """`count` actors of one kind, each reserving `each` (Ray resource name -> amount)."""

    kind: str
    count: int
    each: dict[str, float] = field(default_factory=dict)
    flags: str = ""

    def total(self, resource: str) -> float:
        return self.count * self.each.get(resource, 0.0)


def target_actor_options(config: AppConfig) -> dict:
    """A target replica's ray_actor_options: its CPUs and GPUs (those of rank 0, where t > 1)."""
    return {"num_cpus": config.target_num_cpus, "num_gpus": config.target_num_gpus}


def target_placement(config: AppConfig) -> dict:
    """The target deployment's placement-group options: none for one rank, one bundle per rank
    (the replica's own resources fit bundle 0, as Serve requires) for t > 1."""
    ranks = config.engine.tensor_parallel_size
    if ranks == 1:
        return {}
    bundle = _ray_resources(target_actor_options(config))
    return {
        "placement_group_bundles": [dict(bundle) for _ in range(ranks)],
        "placement_group_strategy": config.tensor_parallel_strategy,
    }


def draft_actor_options(config: AppConfig) -> dict:
    """A draft pool replica's ray_actor_options (engine.draft_worker_resources; one CPU by default)."""
    return dict(config.engine.draft_worker_resources or {"num_cpus": 1})


def reservations(config: AppConfig, most: bool = False) -> list[Reservation]:
    """Every actor the application reserves resources for (the ingress reserves none): at start, or
    with `most` at the most its autoscaling may reach. A replica's ranks under STRICT_PACK are one
    reservation (they must share a node); under the other strategies each rank is one, since Ray
    may place them apart."""
    settings = config.to_settings()
    replicas = settings.target_replicas_max if most else settings.target_replicas
    pool = settings.draft_pool_size
    if most and settings.draft_pool_autoscaling:
        pool = settings.draft_pool_autoscaling["max_replicas"]
    ranks = config.engine.tensor_parallel_size
    rank = _ray_resources(target_actor_options(config))
    if ranks == 1 or config.tensor_parallel_strategy == "STRICT_PACK":
        kind = f"target replicas ({ranks} tensor-parallel rank(s) each)"
        target = Reservation(kind, replicas, {k: v * ranks for k, v in rank.items()}, _TARGET_FLAGS)
    else:
        kind = f"target ranks ({replicas} replica(s) x {ranks}, {config.tensor_parallel_strategy})"
        target = Reservation(kind, replicas * ranks, rank, _TARGET_FLAGS)
    out = [target]
    if pool:
        out.append(Reservation("draft workers", pool, _ray_resources(draft_actor_options(config)), _DRAFT_FLAGS))
    return out


def _ray_resources(options: Mapping) -> dict[str, float]:
    """Ray actor options -> the resources they reserve, by Ray's names."""
    out = {"CPU": float(options.get("num_cpus", 1)), "GPU": float(options.get("num_gpus", 0) or 0)}
    if options.get("memory"):
        out["memory"] = float(options["memory"])
    out.update({name: float(amount) for name, amount in (options.get("resources") or {}).items()})
    return {name: amount for name, amount in out.items() if amount}


def cpus_needed(reserved: list[Reservation]) -> float:
    return sum(r.total("CPU") for r in reserved)


def check_fits(reserved: list[Reservation], free: Mapping[str, float], nodes: list[Mapping[str, float]]) -> None:
    """ValueError naming the numbers and the flags when the reservations cannot be placed:
    free: the cluster's free resources (Ray's names); nodes: each alive node's total resources.
    Each resource's sum must fit what is free, and each actor must fit on one node (necessary,
    not sufficient: Ray still packs them)."""
    names = sorted({name for r in reserved for name in r.each})
    for name in names:
        needed = sum(r.total(name) for r in reserved)
        if needed > free.get(name, 0.0) + 1e-9:
            parts = " + ".join(f"{r.kind} {r.count} x {r.each.get(name, 0):g}" for r in reserved if r.total(name))
            flags = "; ".join(r.flags for r in reserved if r.total(name))
            raise ValueError(
                f"the deployment reserves {needed:g} {name} ({parts}) but the Ray cluster has {free.get(name, 0.0):g} "
                f"free: nothing would be placed beyond that and /health would answer 503. Reserve less ({flags}) "
                "or add nodes"
            )
    for r in reserved:
        if r.count and not any(all(node.get(k, 0.0) + 1e-9 >= v for k, v in r.each.items()) for node in nodes):
            wants = ", ".join(f"{v:g} {k}" for k, v in sorted(r.each.items()))
            raise ValueError(
                f"each one of the {r.kind} reserves {wants} on one node, and no node of the Ray cluster has that "
                f"much: reserve less ({r.flags}) or add a larger node"
            )


def cluster_view(app: str | None = None) -> tuple[dict[str, float], list[dict[str, float]]]:
    """(free resources, each alive node's total resources) of the cluster ray.init attached to.
    app: a Serve application this deploy replaces (a redeploy of `ssd serve` to a cluster that
    runs it): what its replicas hold counts as free, since Serve stops them to place the new."""
    import ray

    nodes = [dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")]
    free = dict(ray.available_resources())
    if app is not None:
        for name, amount in _held_by(app).items():
            free[name] = free.get(name, 0.0) + amount
    return free, nodes


def held_by_app(app: str, actors, groups=()) -> dict[str, float]:
    """What the replicas of Serve application `app` hold, from Ray's actor states (class name
    'ServeReplica:<app>:<deployment>', required_resources by Ray's names) and placement-group
    states (a tensor-parallel replica's group is named as the replica is, 'SERVE_REPLICA::<app>#...';
    its bundles hold the replica's own resources and its ranks')."""
    held: dict[str, float] = {}

    def add(resources) -> None:
        for name, amount in (resources or {}).items():
            held[name] = held.get(name, 0.0) + float(amount)

    grouped = set()
    for group in groups:
        if group.name.startswith(f"SERVE_REPLICA::{app}#") and group.state == "CREATED":
            grouped.add(group.name)
            for bundle in group.bundles or []:
                add(bundle.get("unit_resources"))
    for actor in actors:
        if actor.class_name.startswith(f"ServeReplica:{app}:") and getattr(actor, "name", None) not in grouped:
            add(actor.required_resources)
    return held


def _held_by(app: str) -> dict[str, float]:
    from ray.util.state import list_actors, list_placement_groups
    from ray.util.state.exception import RayStateApiException

    try:  # 10000: the most Ray's state API answers unless its server is configured for more
        actors = list_actors(
            filters=[("state", "=", "ALIVE")], detail=True, limit=10_000, timeout=5, raise_on_missing_output=False
        )
        groups = list_placement_groups(
            filters=[("state", "=", "CREATED")], detail=True, limit=10_000, timeout=5, raise_on_missing_output=False
        )
    # The state API is served by the cluster's dashboard: without one, or unreachable, it fails
    # with its own error, a connection error (OSError) or a bad address (ValueError).
    except (RayStateApiException, OSError, ValueError) as err:
        logger.warning(
            "cannot list the cluster's actors (%s): the fit check counts a running %r application as used", err, app
        )
        return {}
    return held_by_app(app, actors, groups)
