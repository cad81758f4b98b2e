"""What share of a real round the penalties' and bias' processing takes, in the engine.

    python -m benchmarks.processing_share [--batch 1 8] [--k 4 6] [--vocab 128256] [--out FILE.json]
    (default FILE: bench_results/processing_share.json)

The demo pair (or --target/--draft; or with --vocab V, a random tiny Llama pair of that
vocabulary, as benchmarks.payload builds it, whose round is mostly its [b, n, V] passes) in sd,
T=0, a batch of short code prompts, 96 tokens each, frequency and presence penalty 0.5 and
repetition penalty 1.1. The processing's entry points (the engine's builds, Adjustments'
apply, advanced, speculated, committed, branched and min_p_filtered, and the draft forms'
(DraftAdjustments' and HostDraftAdjustments') of, apply, advanced and min_p_filtered) are
wrapped with timers for the run (outermost calls only, so nothing counts twice) and the share is
their time over the generate call's wall time; median of --repeats runs after a warm-up. The
timers add ~1 us a call. Prints one line per row and writes them as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import logging
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.payload import build_pair
from ssd.bench.report import add_pair_arguments, write_json
from ssd.core.sampling_params import SamplingParams
from ssd.llm import LLM
from ssd.processing import adjustments, draft_adjustments, host_draft_adjustments, round_adjustments

logger = logging.getLogger(__name__)

PROMPTS = ("def fib(n):", "import numpy as np\n", "class Stack:", "# Sort a list", "for i in range(10):", "x = [",
           "def main():\n", "The quick brown")  # fmt: skip
METHODS = ("apply", "advanced", "speculated", "committed", "branched", "min_p_filtered")
DRAFT_METHODS = ("of", "apply", "advanced", "min_p_filtered")  # the draft forms'


class _Timers:
    def __init__(self) -> None:
        self.seconds, self._depth = 0.0, 0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            self._depth += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self.seconds += time.perf_counter() - start

        return timed


@contextlib.contextmanager
def _timed_processing(timers: _Timers):
    entries = [(adjustments.Adjustments, m) for m in METHODS]
    forms = (draft_adjustments.DraftAdjustments, host_draft_adjustments.HostDraftAdjustments)
    entries += [(form, m) for form in forms for m in DRAFT_METHODS]
    entries.append((round_adjustments, "build"))
    # As stored (a classmethod stays one when restored), and wrapped as looked up (bound to its class).
    originals = [(owner, name, inspect.getattr_static(owner, name)) for owner, name in entries]
    for owner, name in entries:
        setattr(owner, name, timers.wrap(getattr(owner, name)))
    try:
        yield
    finally:
        for owner, name, fn in originals:
            setattr(owner, name, fn)


def measure(llm: LLM, batch: int, k: int, repeats: int) -> dict:
    params = SamplingParams(
        temperature=0.0, max_tokens=96, frequency_penalty=0.5, presence_penalty=0.5, repetition_penalty=1.1
    )
    prompts = list((PROMPTS * batch)[:batch])
    llm.generate(prompts, params)  # warm-up
    shares, walls = [], []
    for _ in range(repeats):
        timers = _Timers()
        with _timed_processing(timers):
            start = time.perf_counter()
            llm.generate(prompts, params)
            wall = time.perf_counter() - start
        shares.append(timers.seconds / wall)
        walls.append(wall)
    return {"batch": batch, "k": k, "wall_s": statistics.median(walls), "share": statistics.median(shares)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_pair_arguments(parser)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--k", type=int, nargs="+", default=[4, 6])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vocab", type=int, help="A random tiny Llama pair of this vocabulary instead of a pair.")
    parser.add_argument("--out", default="bench_results/processing_share.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        pair = build_pair(Path(tmp), args.vocab) if args.vocab else (args.target, args.draft)
        for k in args.k:
            with LLM(*pair, mode="sd", k=k) as llm:
                rows += [{**measure(llm, b, k, args.repeats), "vocab": llm.engine.vocab_size} for b in args.batch]
    for row in rows:
        logger.info(
            "V=%d, batch %d, K=%d: processing %.1f%% of %.2f s",
            row["vocab"], row["batch"], row["k"], 100 * row["share"], row["wall_s"],
        )  # fmt: skip
    write_json(args.out, rows)


if __name__ == "__main__":
    main()
