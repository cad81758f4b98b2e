"""Running `ssd bench`: `run` (what `ssd bench` calls) turns the flags into a plan, starts one worker
per thread setting, gathers what they report and writes the results; `main` is
`python -m ssd.bench` (which also starts the workers, `--_worker SPEC`)."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from ssd.bench.modes import SETTINGS, available_cpus, variants
from ssd.bench.plan import BenchPlan, _plan, add_arguments
from ssd.bench.report import _aggregate, _ordered, format_pair_stats, new_results, write_results
from ssd.bench.worker import _spawn, worker_main

logger = logging.getLogger(__name__)


def _base_spec(plan: BenchPlan) -> dict:
    from ssd.model.demo_models import heldout_prompts

    return {
        "prompts": heldout_prompts(plan.num_prompts),
        "target": plan.target,
        "draft": plan.draft,
        "k": plan.k,
        "num_prompts": plan.num_prompts,
        "max_tokens": plan.max_tokens,
        "temperatures": plan.temperatures,
        "batch_sizes": plan.batch_sizes,
        "modes": plan.modes,
        "dtype": plan.dtype,
        "draft_dtype": plan.draft_dtype,
        "device": plan.device,
        "seed": plan.seed,
        "pair_reps": plan.pair_reps,
        "ssd_sweeps": plan.ssd_sweeps(),
        "tensor_parallel_sizes": plan.tensor_parallel_sizes,
        "repeats": plan.repeats,
        "log_level": logging.getLogger("ssd").getEffectiveLevel(),
    }


def run(args: argparse.Namespace) -> dict:
    """Run the bench as planned by `args` (see `add_arguments`); print the table, write
    out_dir/bench.json and out_dir/bench.png, and return what bench.json holds."""
    from tqdm import tqdm

    plan = _plan(args)
    settings = {name: SETTINGS[name].threads() for name in plan.settings}
    labels = [v.label for v in variants(plan.modes, plan.ssd_sweeps(), plan.tensor_parallel_sizes)]
    runs_per_setting = len(labels) * len(plan.temperatures) * len(plan.batch_sizes) * plan.repeats
    total = 1 + (0 if plan.pair_stats_only else runs_per_setting * len(settings))
    results = new_results(plan, args, settings)
    load = results["environment"]["load_average_at_start"]
    if load and load[0] > 0.5 * available_cpus():
        logger.warning(
            "load average %.2f on %d CPUs: other processes are running, timings will be noisy",
            load[0],
            available_cpus(),
        )
    if plan.draft_workers and "ssd" in plan.modes and max(plan.draft_workers) + 1 > available_cpus():
        logger.warning(
            "up to %d draft workers beside the target on %d CPUs: the draft workers share cores, so their trees "
            "grow slower than with a core each",
            max(plan.draft_workers),
            available_cpus(),
        )
    base = _base_spec(plan)
    results["config"]["prompts"] = base["prompts"]
    # One worker per setting; the pair stats (one thread) ride with the first one-thread setting,
    # which then runs first, or get a worker of their own.
    jobs = (
        [] if plan.pair_stats_only else [{"setting": s, "threads": t, "tasks": ["modes"]} for s, t in settings.items()]
    )
    if plan.draft is None:
        logger.warning("no draft model: pair stats skipped")
    else:
        host = next((job for job in jobs if job["threads"] == 1), None)
        if host is None:
            jobs.insert(0, {"setting": "pair-stats", "threads": 1, "tasks": ["pair_stats"]})
        else:
            jobs.remove(host)
            jobs.insert(0, {**host, "tasks": ["pair_stats", "modes"]})
    started = time.perf_counter()
    with tqdm(total=total, desc="bench", unit="run", disable=not plan.progress, leave=False) as bar:

        def on_event(event: dict) -> None:
            if event.get("event") == "started":
                # The worker's torch (a local build's version string carries its +cu/+cpu tag).
                results["environment"]["torch_version"] = event["torch_version"]
            elif event.get("event") == "pair_stats":
                results["pair_stats"] = event["pair_stats"]
                bar.update(1)
                tqdm.write(format_pair_stats(results["pair_stats"]), file=sys.stdout)
            elif event.get("event") == "record":
                r = event["record"]
                results["runs"].append(r)
                bar.set_postfix_str(
                    f"{r['setting']} T={r['temperature']:g} b={r['batch_size']} {r['mode']} #{r.get('repeat', 0) + 1}"
                )
                bar.update(1 if r.get("supported") else plan.repeats)

        if plan.draft is None:
            bar.update(1)
            tqdm.write(format_pair_stats(None), file=sys.stdout)
        for job in jobs:
            bar.set_postfix_str(f"{job['setting']}: starting")
            _spawn({**base, **job}, on_event)
    sys.stdout.flush()
    results["elapsed_s"] = round(time.perf_counter() - started, 2)
    results["runs"] = _ordered(
        _aggregate(results["runs"]),
        {"setting": plan.settings, "temperature": plan.temperatures, "batch_size": plan.batch_sizes, "mode": labels},
    )

    write_results(results, plan.out_dir)
    return results


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--_worker"]:
        return worker_main(argv[1])
    parser = argparse.ArgumentParser(prog="python -m ssd.bench", description="Benchmark decoding modes side by side.")
    parser.add_argument("--log-level", default="WARNING", help="Python logging level.")
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        run(args)
    except ValueError as err:
        logger.error("%s", err)
        return 2
    return 0
