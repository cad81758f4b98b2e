"""Autoscaling as configured, without a cluster: AppConfig's target_autoscaling (what it refuses,
with which message, and what it derives for the two deployments) and the draft pool's policy,
serve_app/pool_scaling.py, on Ray Serve's own AutoscalingContext. The served ramp is
tests/serving/test_serve_autoscaling.py."""

from __future__ import annotations

import pytest

pytest.importorskip("ray")

from ray.serve._private.common import DeploymentID, TimeStampedValue  # noqa: E402
from ray.serve.config import AutoscalingConfig, AutoscalingContext  # noqa: E402

from serve_app.app import build_app, parse_config  # noqa: E402
from serve_app.placement import reservations  # noqa: E402
from serve_app.pool_scaling import WANTED, follow_leases  # noqa: E402

SCALING = {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 4}


def settings(**app):
    return parse_config({"engine": {"mode": "ssd", "draft_workers": 2}, **app}).to_settings()


def test_the_targets_scale_and_the_pool_follows_at_the_targets_pace():
    s = settings(target_autoscaling={**SCALING, "downscale_delay_s": 7}, extra_modes=["ar", "auto"])
    assert s.target_autoscaling == {
        **SCALING,
        **{"upscale_delay_s": 30.0, "downscale_delay_s": 7.0, "look_back_period_s": 30.0, "metrics_interval_s": 10.0},
    }
    assert (s.target_replicas, s.target_replicas_max) == (1, 3)
    pool = s.draft_pool_autoscaling
    # Each target replica leases draft_workers (2) for each of its ssd and auto engines.
    assert (pool["min_replicas"], pool["max_replicas"], s.draft_pool_size) == (4, 12, 4)
    assert (pool["upscale_delay_s"], pool["downscale_delay_s"]) == (0.0, 7.0)
    AutoscalingConfig(**pool)  # Ray Serve takes both as they are
    AutoscalingConfig(**s.target_autoscaling)


def test_fixed_replicas_stay_fixed():
    s = settings(target_replicas=2)
    assert (s.target_autoscaling, s.draft_pool_autoscaling) == (None, None)
    assert (s.target_replicas, s.target_replicas_max, s.draft_pool_size) == (2, 2, 4)


def test_a_served_mode_without_workers_has_no_pool_to_scale():
    s = parse_config({"engine": {"mode": "sd"}, "target_autoscaling": SCALING}).to_settings()
    assert s.draft_pool_size == 0 and s.draft_pool_autoscaling is None and s.target_autoscaling is not None


@pytest.mark.parametrize(
    ("app", "message"),
    [
        ({"target_replicas": 2}, "target_replicas is set together with target_autoscaling"),
        ({"draft_pool_size": 4}, "draft_pool_size is set together with target_autoscaling"),
        ({"target_autoscaling": {**SCALING, "max_replicas": 0}}, "target_autoscaling.max_replicas"),
        ({"target_autoscaling": {**SCALING, "min_replicas": 4}}, "max_replicas (3) is below min_replicas (4)"),
        ({"target_autoscaling": {**SCALING, "target_ongoing": 4}}, "target_autoscaling.target_ongoing"),
        ({"target_autoscaling": {"max_replicas": 3}}, "target_autoscaling.target_ongoing_requests: Field required"),
    ],
)
def test_a_bad_autoscaling_setting_names_what_to_change(app, message):
    with pytest.raises(ValueError, match="invalid ssd-serve application config") as err:
        parse_config({"target_autoscaling": SCALING, **app})
    assert message in str(err.value)


def test_the_application_hands_serve_both_autoscaling_configs():
    ingress = build_app({"engine": {"mode": "ssd"}, "target_autoscaling": SCALING})._bound_deployment
    target = ingress.init_args[1]._bound_deployment  # Ingress(settings, target, model name)
    pool = target.init_args[1]._bound_deployment  # Target(settings, pool)
    scaling = target._deployment_config.autoscaling_config
    assert (scaling.min_replicas, scaling.max_replicas, scaling.target_ongoing_requests) == (1, 3, 4)
    scaling = pool._deployment_config.autoscaling_config
    assert (scaling.min_replicas, scaling.max_replicas) == (1, 3)
    assert scaling.policy.policy_function == "serve_app.pool_scaling.follow_leases"


def test_the_health_check_period_reaches_every_deployment():
    ingress = build_app({"engine": {"mode": "ssd"}, "health_check_period_s": 1.5})._bound_deployment
    target = ingress.init_args[1]._bound_deployment
    pool = target.init_args[1]._bound_deployment
    assert [d._deployment_config.health_check_period_s for d in (ingress, target, pool)] == [1.5] * 3
    assert ingress.init_args[0].retry_window_s == 20.0  # at least 20 s whatever the period
    assert parse_config({"health_check_period_s": 10}).to_settings().retry_window_s == 40.0


def test_a_local_cluster_counts_room_for_the_most_replicas():
    config = parse_config({"engine": {"mode": "ssd"}, "target_autoscaling": SCALING})
    at_start = {r.kind: r.count for r in reservations(config)}
    at_most = {r.kind: r.count for r in reservations(config, most=True)}
    assert sorted(at_start.values()) == [1, 1] and sorted(at_most.values()) == [3, 3]


def context(reports: dict[str, list[tuple[float, float]]], target: int = 2) -> AutoscalingContext:
    """The DraftPool's context as Serve's controller builds it, with each replica's WANTED series."""
    raw = {WANTED: {replica: [TimeStampedValue(t, v) for t, v in points] for replica, points in reports.items()}}
    return AutoscalingContext(
        deployment_id=DeploymentID("DraftPool", "app"),
        deployment_name="DraftPool",
        app_name="app",
        current_num_replicas=target,
        target_num_replicas=target,
        running_replicas=list(reports),
        total_num_requests=0.0,
        total_queued_requests=0.0,
        aggregated_metrics=None,
        raw_metrics=raw if reports else {},
        capacity_adjusted_min_replicas=1,
        capacity_adjusted_max_replicas=8,
        policy_state={},
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=10.0,
        config=None,
    )


def test_the_pool_asks_for_what_the_newest_report_says_the_targets_want():
    assert follow_leases(context({"a": [(1.0, 2.0), (5.0, 3.0)], "b": [(4.0, 5.0)]})) == (3, {})
    assert follow_leases(context({"a": [(1.0, 2.0)], "b": [(6.0, 1.0)]})) == (1, {})


def test_the_pool_keeps_its_size_until_a_replica_has_reported():
    assert follow_leases(context({}, target=3)) == (3, {})
    assert follow_leases(context({"a": []}, target=2)) == (2, {})
