"""How long an engine takes to start and to close: `LLM(...)` and `close()`, each in a fresh
interpreter (so every run pays the imports and the model loads a user's first call pays).

    python -m ssd.bench.startup [--modes ar sd ssd] [--draft-workers 1 2] [--repeats 3] \
        [--out bench_results/startup.json]

The demo pair (or --target/--draft). A row per mode and, for ssd, per D (draft_workers): the
median seconds of --repeats runs and their range. The interpreter's own start and `import ssd`
are left out (they are the same in every mode). Prints one line per row and writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import sys

from ssd.bench.report import add_pair_arguments, write_json

logger = logging.getLogger(__name__)

# Run in a fresh interpreter: the seconds of LLM(...) and of close(), as one JSON line.
_ONE_RUN = """
import json, sys, time
from ssd import LLM
options = json.loads(sys.argv[1])
start = time.perf_counter()
llm = LLM(**options)
built = time.perf_counter()
llm.close()
print(json.dumps({"start_s": built - start, "close_s": time.perf_counter() - built}))
"""


def one_run(options: dict) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", _ONE_RUN, json.dumps(options)], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"LLM({options}) failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(options: dict, repeats: int) -> dict:
    runs = [one_run(options) for _ in range(repeats)]
    row = {"mode": options["mode"], "draft_workers": options.get("draft_workers", 0), "repeats": repeats}
    for field in ("start_s", "close_s"):
        values = [r[field] for r in runs]
        row[field], row[f"{field}_range"] = statistics.median(values), [min(values), max(values)]
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_pair_arguments(parser)
    parser.add_argument("--modes", nargs="+", default=["ar", "sd", "ssd"], choices=["ar", "sd", "ssd", "auto"])
    parser.add_argument("--draft-workers", type=int, nargs="+", default=[1, 2], help="D values for ssd and auto.")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="bench_results/startup.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rows = []
    for mode in args.modes:
        pool = args.draft_workers if mode in ("ssd", "auto") else [0]
        for d in pool:
            options = {"target": args.target, "draft": args.draft, "mode": mode, **({"draft_workers": d} if d else {})}
            row = measure(options, args.repeats)
            rows.append(row)
            logger.info(
                "%s%s: start %.2f s (%.2f-%.2f), close %.2f s (%.2f-%.2f)",
                mode, f" D={d}" if d else "", row["start_s"], *row["start_s_range"],
                row["close_s"], *row["close_s_range"],
            )  # fmt: skip
    write_json(args.out, rows)


if __name__ == "__main__":
    main()
