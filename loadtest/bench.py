"""Load benchmark: the speculation modes (auto, ssd, sd, plain decoding: ar) at several
concurrent user counts, against a running server (in another terminal: `make serve` serves auto
and ar; `.venv/bin/ssd serve --extra-modes sd ar` auto, sd and ar; a config file with
`extra_modes: [ssd, sd, ar]` all four, docs/serving.md). --modes defaults to every mode the
server serves (its /v1/models card lists them); a mode named there that it does not serve is
refused before the first run.

    python -m loadtest.bench --users 1,4,16 --duration 30 --modes auto,ssd,sd,ar

Each (mode, users) cell is one headless Locust run of loadtest/locustfile.py in which every
request asks for that speculation mode (greedy, the prompt mix, 75% streamed). Reported per cell:
generated tokens per second over the run (sum of the TOKENS events / duration), requests per
second, and p50/p99 of end-to-end latency and time to first token (ms). Prints a table and
writes bench_results/loadtest_bench.json.

With `--repeats N` every user count runs its modes N times, interleaved (auto, sd, auto, sd, ...)
so that a slow spell of a shared machine falls on every mode alike; each cell is then the median
of its N runs, with the range of tokens/s (`tok_per_s_min`, `tok_per_s_max`) and every run kept
under `runs`.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from loadtest.served_modes import pick_modes, served_modes

LOCUSTFILE = Path(__file__).with_name("locustfile.py")


def run_cell(
    host: str, mode: str, users: int, duration: int, model: str, api_key: str, workdir: Path, think_ms: float = 200.0
) -> dict:
    prefix = workdir / f"{mode}_{users}"
    cmd = [
        sys.executable,
        "-m",
        "locust",
        "-f",
        str(LOCUSTFILE),
        "--host",
        host,
        "--headless",
        "-u",
        str(users),
        "-r",
        str(users),
        "-t",
        f"{duration}s",
        "--stop-timeout",
        "60",
        "--csv",
        str(prefix),
        "--only-summary",
        "--spec-modes",
        mode,
        "--model",
        model,
        "--api-key",
        api_key,
        "--think-ms",
        str(think_ms),
    ]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=duration + 300)
    with open(f"{prefix}_stats.csv") as f:
        rows = list(csv.DictReader(f))

    def typed(kind: str) -> list[dict]:
        return [r for r in rows if r["Type"] == kind]

    def percentile(kind: str, column: str) -> float:
        (row,) = typed(kind)  # the locustfile names its own events by mode only: one row per cell
        return float(row[column])

    posts = typed("POST")
    failures = sum(int(r["Failure Count"]) for r in posts)
    tokens = sum(float(r["Average Response Time"]) * int(r["Request Count"]) for r in typed("TOKENS"))
    requests = sum(int(r["Request Count"]) for r in posts)
    return {
        "mode": mode,
        "users": users,
        "requests": requests,
        "failures": failures,
        "tok_per_s": tokens / duration,
        "req_per_s": requests / duration,
        "e2e_p50_ms": percentile("E2E", "50%"),
        "e2e_p99_ms": percentile("E2E", "99%"),
        "ttft_p50_ms": percentile("TTFT", "50%"),
        "ttft_p99_ms": percentile("TTFT", "99%"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="ssd-demo")
    parser.add_argument("--api-key", default="")
    parser.add_argument("--modes", default="", help="Comma-separated; default: every mode the server serves.")
    parser.add_argument("--users", default="1,4,16")
    parser.add_argument("--duration", type=int, default=30, help="Seconds per cell.")
    parser.add_argument(
        "--think-ms", type=float, default=200.0, help="Each user's pause between requests: uniform 0 to this (ms)."
    )
    parser.add_argument("--out", default="bench_results/loadtest_bench.json")
    parser.add_argument(
        "--repeats", type=int, default=1, help="Runs of each cell, interleaved across modes; a cell is their median."
    )
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    try:
        modes = pick_modes(args.modes, served_modes(args.host, args.model, args.api_key), args.host)
    except ValueError as err:
        parser.error(str(err))
    args.modes = ",".join(modes)  # as run, in the JSON written
    cells = []
    with tempfile.TemporaryDirectory() as tmp:
        for users in [int(u) for u in args.users.split(",")]:
            runs: dict[str, list[dict]] = {mode: [] for mode in modes}
            for _ in range(args.repeats):
                for mode in modes:
                    run = run_cell(
                        args.host, mode, users, args.duration, args.model, args.api_key, Path(tmp), args.think_ms
                    )
                    runs[mode].append(run)
                    _report("run " if args.repeats > 1 else "", run)
            if args.repeats > 1:
                for mode in modes:
                    cells.append(median_cell(runs[mode]))
                    _report("median ", cells[-1])
            else:
                cells.extend(r for mode in modes for r in runs[mode])
    write_cells(args, cells)
    return 0


def median_cell(runs: list[dict]) -> dict:
    """A cell from repeated runs: the median of every figure, the range of tokens/s, the runs."""
    figures = [k for k in runs[0] if k not in ("mode", "users")]
    cell = {"mode": runs[0]["mode"], "users": runs[0]["users"]}
    cell.update({k: statistics.median(r[k] for r in runs) for k in figures})
    cell["failures"] = sum(r["failures"] for r in runs)
    cell["tok_per_s_min"] = min(r["tok_per_s"] for r in runs)
    cell["tok_per_s_max"] = max(r["tok_per_s"] for r in runs)
    cell["runs"] = runs
    return cell


def _report(label: str, cell: dict) -> None:
    spread = f" ({cell['tok_per_s_min']:.1f}-{cell['tok_per_s_max']:.1f})" if "runs" in cell else ""
    sys.stdout.write(
        f"{label}{cell['mode']:4s} users {cell['users']:3d}: {cell['tok_per_s']:7.1f} tok/s{spread}  "
        f"{cell['req_per_s']:5.2f} req/s  "
        f"E2E p50/p99 {cell['e2e_p50_ms']:6.0f}/{cell['e2e_p99_ms']:6.0f} ms  "
        f"TTFT p50/p99 {cell['ttft_p50_ms']:5.0f}/{cell['ttft_p99_ms']:5.0f} ms  failures "
        f"{cell['failures']}\n"
    )
    sys.stdout.flush()


def write_cells(args: argparse.Namespace, cells: list[dict]) -> None:
    """The command's arguments and cells as JSON at args.out (its folder made)."""
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "cells": cells}, indent=2))


if __name__ == "__main__":
    sys.exit(main())
