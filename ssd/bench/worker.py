"""The bench worker: one child process per thread setting, and the parent's side of it.

Thread budgets must be fixed before torch builds its thread pool, so every setting runs in its own
child process (`python -m ssd.bench --_worker SPEC`) with OMP_NUM_THREADS set. The child
(`worker_main`) runs its tasks (pair stats, timed runs of every mode) and talks back over a private
copy of stdout in JSON lines: `started`, then `pair_stats` / `record` events, then `done` or
`error`. The parent (`_spawn`) passes the spec in a temporary file, relays the events and kills the
child whenever it stops early; the child exits when the parent goes away.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ssd.bench.modes import MODES, BatchCounters, BenchContext, variants
from ssd.bench.pair_stats import _pair_stats

logger = logging.getLogger(__name__)


# ---- the child: timed runs of the modes ---------------------------------------------------------


def _prompt_requests(num_prompts: int, batch_size: int) -> int:
    """Requests per run: at least num_prompts and one full batch, rounded up to whole batches."""
    n = max(num_prompts, batch_size)
    return -(-n // batch_size) * batch_size


def _run_modes(spec: dict, emit: Callable[[dict], None]) -> None:
    """Build every variant's runner (one warm-up generation each), then run the timed grid
    `repeats` times, interleaved: variant after variant within a repeat, so slow drift of the
    machine spreads over every variant alike instead of favouring the one measured first."""
    import gc
    from dataclasses import replace

    prompts = spec["prompts"]
    ctx = BenchContext(
        target=spec["target"],
        draft=spec["draft"],
        k=spec["k"],
        dtype=spec["dtype"],
        draft_dtype=spec["draft_dtype"],
        device=spec["device"],
        num_threads=spec["threads"],
        max_batch_size=max(spec["batch_sizes"]),
        seed=spec["seed"],
    )
    max_tokens, seed = spec["max_tokens"], spec["seed"]
    runners: dict[str, object] = {}
    todo = variants(spec["modes"], spec.get("ssd_sweeps"), spec.get("tensor_parallel_sizes"))
    try:
        for v in todo:
            if any(MODES[v.mode].supports(b) for b in spec["batch_sizes"]):
                logger.info("[%s] building %s", spec["setting"], v.label)
                runners[v.label] = MODES[v.mode].build(
                    replace(ctx, ssd_options=v.ssd_options, engine_options=v.engine_options)
                )
                # Warm-up: one generation, not timed (first-call allocations, lazy inits).
                runners[v.label].generate(prompts[:1], [seed], spec["temperatures"][0], max_tokens)
        for repeat in range(spec.get("repeats", 1)):
            for temperature in spec["temperatures"]:
                for batch_size in spec["batch_sizes"]:
                    for v in todo:
                        record = {
                            "setting": spec["setting"],
                            "threads": spec["threads"],
                            "mode": v.label,
                            **v.record,
                            "temperature": temperature,
                            "batch_size": batch_size,
                            "repeat": repeat,
                        }
                        runner = runners.get(v.label)
                        if runner is None or not MODES[v.mode].supports(batch_size):
                            if repeat == 0:
                                emit(
                                    {
                                        "event": "record",
                                        "record": {
                                            **record,
                                            "supported": False,
                                            "reason": MODES[v.mode].unsupported_reason,
                                        },
                                    }
                                )
                            continue
                        summary = _timed(runner, prompts, batch_size, seed, repeat, temperature, max_tokens)
                        emit({"event": "record", "record": {**record, **summary}})
    finally:
        for runner in runners.values():
            runner.close()
        runners.clear()
        gc.collect()


def _timed(
    runner, prompts: list[str], batch_size: int, seed: int, repeat: int, temperature: float, max_tokens: int
) -> dict:
    """One timed run of a runner over the prompts, in batches of batch_size. Request i of repeat
    j has seed seed + j n + i: every mode of a repeat samples with the same seeds, and each
    repeat samples new continuations (at T > 0 one continuation's acceptance is a noisy draw,
    so the median over repeats averages over them)."""
    n = _prompt_requests(len(prompts), batch_size)
    requests = [prompts[i % len(prompts)] for i in range(n)]
    totals: list[BatchCounters] = []
    walls: list[float] = []
    for start in range(0, n, batch_size):
        seeds = [seed + repeat * n + i for i in range(start, start + batch_size)]
        t0 = time.perf_counter()
        totals.append(runner.generate(requests[start : start + batch_size], seeds, temperature, max_tokens))
        walls.append(time.perf_counter() - t0)
    summary = _summarize(totals, sum(walls), n)
    # Each batch's own tokens/s (at batch 1, each prompt's): the report's spread over prompts.
    summary["batch_tokens_per_s"] = [round(t.generated_tokens / w, 3) if w > 0 else None for t, w in zip(totals, walls)]
    if hasattr(os, "getloadavg"):  # other processes skew timings on a small machine
        summary["load_average_1min"] = round(os.getloadavg()[0], 2)
    return summary


def _sum_or_none(values: list) -> float | None:
    return None if any(v is None for v in values) else sum(values)


def _summarize(totals: list[BatchCounters], wall: float, num_requests: int) -> dict:
    generated = sum(t.generated_tokens for t in totals)
    rounds = _sum_or_none([t.rounds for t in totals])
    accepted = _sum_or_none([t.accepted_tokens for t in totals])
    draft_s = _sum_or_none([t.draft_seconds for t in totals])
    verify_s = _sum_or_none([t.verify_seconds for t in totals])
    counters: dict[str, int] = {}
    for t in totals:
        for key, value in t.counters.items():
            counters[key] = counters.get(key, 0) + value
    gauges = totals[-1].gauges if totals else {}
    step_s = _sum_or_none([t.step_seconds for t in totals])
    hit_step_s = _sum_or_none([t.hit_step_seconds for t in totals])
    hit_tokens = counters.get("hit_step_tokens", 0)
    # Theorem 7 with p_hit = 1 at the measured E_hit and T_p: every step as fast and as
    # productive as the run's steps in which every row hit. Both sides count engine steps only
    # (prefill and the bench's own overhead excluded), so the fraction is what misses cost.
    bound = hit_tokens / hit_step_s if hit_step_s and hit_tokens else None
    ssd_rounds = sum(counters.get(k, 0) for k in ("cache_hits", "backup_neural_rounds", "backup_fast_rounds"))
    per_round = lambda x: None if x is None or not rounds else round(x / rounds, 4)  # noqa: E731
    ms_per_round = lambda s: None if s is None or not rounds else round(1000 * s / rounds, 4)  # noqa: E731
    return {
        "supported": True,
        "num_requests": num_requests,
        "generated_tokens": generated,
        "wall_s": round(wall, 4),
        "tokens_per_s": round(generated / wall, 3) if wall > 0 else None,
        "rounds": rounds,
        "accepted_tokens": accepted,
        "mean_accepted_per_round": per_round(accepted),
        "acceptance_rate": round(accepted / counters["draft_tokens"], 4)
        if accepted is not None and counters.get("draft_tokens")
        else None,
        "tokens_per_round": per_round(generated),
        # Engine modes: tokens per second of the engine's steps alone (prefill excluded).
        "decode_tokens_per_s": round(generated / step_s, 3) if step_s else None,
        "draft_ms_per_round": ms_per_round(draft_s),
        "verify_ms_per_round": ms_per_round(verify_s),
        "counters": counters,
        **(
            {
                "cache_hit_rate": round(counters.get("cache_hits", 0) / ssd_rounds, 4) if ssd_rounds else None,
                "target_exchange_ms": gauges.get("target_exchange_ms"),
                "replies_awaited": gauges.get("replies_awaited"),
                "board_reads": gauges.get("board_reads"),
                "ssd": gauges,
                "upper_bound_tokens_per_s": round(bound, 3) if bound else None,
                "fraction_of_bound": round(generated / step_s / bound, 4) if bound and step_s else None,
            }
            if gauges
            else {}
        ),
    }


# ---- the child: process and protocol ------------------------------------------------------------


def _watch_parent() -> None:
    """Exit when the parent goes away (it holds our stdin open; EOF means it is gone)."""

    def watch() -> None:
        try:
            while os.read(0, 4096):  # raw fd: no buffered-reader lock to trip over at shutdown
                pass
        except OSError:
            pass
        os._exit(3)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def worker_main(spec_path: str) -> int:
    # The protocol gets a private copy of stdout; anything else printing to stdout goes to stderr.
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    spec = json.loads(Path(spec_path).read_text())
    logging.basicConfig(
        level=spec.get("log_level", logging.WARNING),
        format=f"%(asctime)s %(levelname)s [bench worker {spec['setting']}] %(name)s: %(message)s",
    )
    _watch_parent()

    def emit(event: dict) -> None:
        proto.write(json.dumps(event) + "\n")

    try:
        import torch

        from ssd.core.threads import set_process_threads

        set_process_threads(spec["threads"])
        try:
            import transformers

            transformers.logging.set_verbosity_error()
        except Exception:  # noqa: BLE001 (quieter logs are a nicety)
            pass
        emit({"event": "started", "torch_threads": torch.get_num_threads(), "torch_version": torch.__version__})
        for task in spec["tasks"]:
            if task == "pair_stats":
                emit({"event": "pair_stats", "pair_stats": _pair_stats(spec)})
            elif task == "modes":
                _run_modes(spec, emit)
            else:
                raise ValueError(f"unknown worker task {task!r}")
        emit({"event": "done"})
        return 0
    except BaseException as err:  # noqa: BLE001 (reported to the parent, then re-raised as exit code)
        import traceback

        emit({"event": "error", "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()})
        return 1
    finally:
        proto.flush()


# ---- the parent ---------------------------------------------------------------------------------


def _spawn(spec: dict, on_event: Callable[[dict], None]) -> None:
    """Run one worker with its thread budget in the environment; kill it if we stop early."""
    threads = str(spec["threads"])
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, OPENBLAS_NUM_THREADS=threads, TOKENIZERS_PARALLELISM="false"
    )
    package_root = str(Path(__file__).resolve().parents[2])  # the directory holding ssd/
    env["PYTHONPATH"] = os.pathsep.join([package_root, *filter(None, [env.get("PYTHONPATH")])])
    with tempfile.TemporaryDirectory(prefix="ssd-bench-") as tmp:
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        _run_worker([sys.executable, "-m", "ssd.bench", "--_worker", str(spec_path)], env, spec, on_event)


def _run_worker(cmd: list[str], env: dict, spec: dict, on_event: Callable[[dict], None]) -> None:
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
    error = None
    try:
        for line in proc.stdout:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                logger.debug("worker output: %s", line.rstrip())
                continue
            if event.get("event") == "error":
                error = event
            elif event.get("event") == "started":
                logger.info(
                    "worker %s: torch %s, %d threads", spec["setting"], event["torch_version"], event["torch_threads"]
                )
                if event["torch_threads"] != spec["threads"]:
                    logger.warning(
                        "worker %s asked for %d threads but torch uses %d",
                        spec["setting"],
                        spec["threads"],
                        event["torch_threads"],
                    )
                on_event(event)
            else:
                on_event(event)
        rc = proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()
    if error is not None:
        logger.debug("worker traceback:\n%s", error.get("traceback", ""))
        raise RuntimeError(f"bench worker ({spec['setting']}: {', '.join(spec['tasks'])}) failed: {error['error']}")
    if rc != 0:
        raise RuntimeError(f"bench worker ({spec['setting']}: {', '.join(spec['tasks'])}) exited with status {rc}")
