"""The application builder: `serve run serve_app.app:build_app key=value` or a Serve config file
(serve_config.yaml at the repository root) whose `args` is an AppConfig.

    Ingress (HTTP + gRPC) --handle--> Target x target_replicas --lease--> DraftPool x draft_pool_size

With target_autoscaling, Serve scales the targets on their ongoing requests and the pool follows
the workers the targets lease (serve_app/pool_scaling.py).

The target deployment holds the draft deployment's handle only so the pool is part of the same
application (deployed, scaled and torn down with it); per-round traffic goes over the data
plane to the workers it leases from the lease registry.
"""

from __future__ import annotations

from pydantic import ValidationError
from ray.serve import Application

from serve_app.config import AppConfig
from serve_app.deployments import DraftPoolDeployment, IngressDeployment, TargetDeployment
from serve_app.placement import draft_actor_options, target_actor_options, target_placement


def parse_config(args: dict | AppConfig | None) -> AppConfig:
    """Validate builder args; a bad key or value raises ValueError naming it."""
    if isinstance(args, AppConfig):
        return args
    try:
        return AppConfig.model_validate(args or {})
    except ValidationError as err:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'config'}: {e['msg']}" for e in err.errors(include_url=False)
        )
        raise ValueError(f"invalid ssd-serve application config: {problems}") from None


def build_app(args: dict | AppConfig | None = None) -> Application:
    config = parse_config(args)
    settings = config.to_settings()
    pool = None
    if settings.draft_pool_size:
        pool = DraftPoolDeployment.options(
            **_replicas(settings.draft_pool_size, settings.draft_pool_autoscaling),
            ray_actor_options=draft_actor_options(config),
            health_check_period_s=settings.health_check_period_s,
        ).bind(settings)
    target = TargetDeployment.options(
        **_replicas(settings.target_replicas, settings.target_autoscaling),
        ray_actor_options=target_actor_options(config),
        **target_placement(config),
        max_ongoing_requests=settings.target_max_ongoing,
        max_queued_requests=settings.target_max_queued,
        health_check_period_s=settings.health_check_period_s,
    ).bind(settings, pool)
    return IngressDeployment.options(
        ray_actor_options={"num_cpus": 0}, health_check_period_s=settings.health_check_period_s
    ).bind(settings, target)


def _replicas(fixed: int, autoscaling: dict | None) -> dict:
    """A deployment's replica options: a fixed count, or Serve's autoscaling_config."""
    return {"num_replicas": fixed} if autoscaling is None else {"autoscaling_config": autoscaling}
