"""How long an engine takes to start, to give its first tokens and to close, and for SSD how
long a draft worker takes to be ready and to be replaced after a kill; each run in a fresh
interpreter (so every run pays the imports and the model loads a user's first call pays).

    python -m ssd.bench.startup [--modes ar sd ssd] [--draft-workers 1 2] [--repeats 3] \
        [--out bench_results/startup.json]

The demo pair (or --target/--draft). A row per mode and, for ssd, per D (draft_workers): the
median seconds of --repeats runs and their range, of
- start_s: `LLM(...)` until it returns;
- first_tokens_s: `LLM(...)` and the generation of its first 8 tokens (greedy, one prompt);
- worker_ready_s (ssd): a worker asked of the engine's provider until it is READY;
- replace_s (ssd): a worker killed (SIGKILL) mid-generation until its replacement is attached to
  the pool (replacements join at a round boundary; the engine generates meanwhile);
- close_s: `close()`.
The interpreter's own start and `from ssd import LLM` are left out (they are the same in every
mode). Prints one line per row and writes them as JSON.
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

# Run in a fresh interpreter: the seconds of each step, as one JSON line.
_ONE_RUN = """
import json, os, signal, sys, time
from ssd import LLM, SamplingParams
options = json.loads(sys.argv[1])
greedy = lambda n: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
start = time.perf_counter()
llm = LLM(**options)
row = {"start_s": time.perf_counter() - start}
llm.generate("def f(x):", greedy(8))
row["first_tokens_s"] = time.perf_counter() - start
pool = getattr(llm.engine.proposers.get("ssd"), "client", None)
if pool is not None and hasattr(pool, "provider"):
    asked = time.perf_counter()
    link = pool.provider.acquire()
    row["worker_ready_s"] = time.perf_counter() - asked
    pool.provider.discard(link, failed=False)
    replaced = pool.tally.replacements
    os.kill(pool.shards[0].link.process.pid, signal.SIGKILL)
    killed = time.perf_counter()
    while pool.tally.replacements == replaced and time.perf_counter() - killed < 120:
        llm.generate("def f(x):", greedy(4))
    row["replace_s"] = time.perf_counter() - killed
closing = time.perf_counter()
llm.close()
row["close_s"] = time.perf_counter() - closing
print(json.dumps(row))
"""
FIELDS = ("start_s", "first_tokens_s", "worker_ready_s", "replace_s", "close_s")


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
    for field in FIELDS:
        values = [r[field] for r in runs if field in r]
        if values:
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
            figures = ", ".join(
                "{} {:.2f} s ({:.2f}-{:.2f})".format(field.removesuffix("_s"), row[field], *row[f"{field}_range"])
                for field in FIELDS
                if field in row
            )
            logger.info("%s%s: %s", mode, f" D={d}" if d else "", figures)
    write_json(args.out, rows)


if __name__ == "__main__":
    main()
