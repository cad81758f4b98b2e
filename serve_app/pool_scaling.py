"""The draft pool follows its targets: the Serve autoscaling policy of the DraftPool deployment.

Each pool replica reports, as a Serve custom autoscaling metric, how many draft workers the
lease registry's lessees want (LeaseTable.demand: the workers leased, plus the ones a target asked
for and is still waiting on). The policy asks for that many replicas; Serve applies the bounds
(min_replicas, max_replicas, derived from the targets' own in serve_app/config.py) and the delays.
So a target that starts leases its workers, finds none free, keeps asking, and the pool grows by
what it asked for; a target that is scaled down releases its leases as it closes, and the pool
shrinks after the targets' downscale delay.

Why a deployment policy over the registry's figure, and not an application-level policy that
reads the Target deployment's replica count: Ray 2.60 documents application-level policies as
under development, and the registry's figure is what the pool must hold whatever asks for it (a
target replaced after a crash, one still starting, an engine for each of ssd and auto).

Serve pickles this module by value into its controller: it imports nothing of the project.
"""

from __future__ import annotations

# The custom metric each DraftPool replica reports (DraftPoolDeployment.record_autoscaling_stats).
WANTED = "draft_workers_wanted"


def lessees(app_name: str) -> str:
    """The prefix of the lessee names of one application's targets (actors.leased_workers), by which
    its pool counts what they want: two applications of one model pair share the registry's
    workers, and each pool follows its own targets."""
    return f"{app_name}/"


def follow_leases(ctx) -> tuple[int, dict]:
    """ctx: ray.serve.config.AutoscalingContext of the DraftPool deployment -> (replicas wanted,
    policy state). Every replica reports the same registry figure, so the newest report of any
    replica is the answer; with none yet (replicas starting), keep the current target."""
    series = (ctx.raw_metrics or {}).get(WANTED, {})
    newest = [points[-1] for points in series.values() if points]
    if not newest:
        return ctx.target_num_replicas, {}
    return int(max(newest, key=lambda p: p.timestamp).value), {}
