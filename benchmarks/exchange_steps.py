"""Where the target's time in a draft pool's exchange goes (`python -m benchmarks.exchange_steps`):
each step of the pool's round on the target's thread (ssd/transport/pool_client.py and the board
reads it calls), timed in place while an SSD engine with D draft workers generates: wall time and
the thread's CPU time, medians per call, next to the engine's own `target_exchange_ms`, and the
round's key (board_key) timed again alone in a loop, on the last round's message.

Why in place: the steps run between the target's forwards, which have just evicted the caches, so
the same calls in a loop alone take a fraction of the time. A step whose CPU time is its wall
time spends the target's own work; one whose wall time is larger waits (for a reply, or for the
core).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
import timeit
from collections import defaultdict
from contextlib import contextmanager

# What is timed: (module or class, attribute) of the steps on the target's side of a round.
STEPS = {
    "ssd.transport.pool_client.PoolClient": ("begin_round", "resolve", "reply", "_grid", "_announce", "_merged"),
    "ssd.transport.pool_client": ("read_hits", "on_boards", "merge_shards"),
    "ssd.core.protocol.BeginRoundMsg": ("board_key",),
}


def _owner(path: str):
    import importlib

    module, _, cls = path.rpartition(".")
    if cls[0].isupper():
        return getattr(importlib.import_module(module), cls)
    return importlib.import_module(path)


@contextmanager
def timed_steps(times: dict[str, list[tuple[float, float]]], last: dict[str, tuple] | None = None):
    """Wrap every step of STEPS to append (wall s, CPU s) per call to times[name] (and keep each
    step's latest arguments in last[name]); undone on exit."""
    originals = []
    for path, names in STEPS.items():
        owner = _owner(path)
        for name in names:
            original = getattr(owner, name)
            originals.append((owner, name, original))

            def wrapped(*args, _f=original, _name=name, **kwargs):
                if last is not None:
                    last[_name] = args
                wall, cpu = time.perf_counter(), time.thread_time()
                try:
                    return _f(*args, **kwargs)
                finally:
                    times[_name].append((time.perf_counter() - wall, time.thread_time() - cpu))

            setattr(owner, name, functools.wraps(original)(wrapped))
    try:
        yield
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)


def measure(target: str | None, draft: str | None, workers: int, temperature: float, prompts: list[str],
            max_tokens: int, k: int) -> dict:  # fmt: skip
    """One engine of `workers` draft workers (outcomes split), warmed up, then timed over `prompts`
    one at a time (batch 1)."""
    from ssd import LLM, SamplingParams

    times: dict[str, list[tuple[float, float]]] = defaultdict(list)
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=1)
    with LLM(target, draft, mode="ssd", draft_workers=workers, draft_split="outcomes", k=k) as llm:
        llm.generate(prompts[:1], params)
        last: dict[str, tuple] = {}
        with timed_steps(times, last):
            for prompt in prompts:
                llm.generate([prompt], params)
        ssd = llm.metrics()["ssd"]
    # The same call alone, in a loop with warm caches: what the in-place figures compare to.
    alone_ms = None
    if "board_key" in last:
        (msg,) = last["board_key"]
        alone_ms = round(1e3 * min(timeit.repeat(msg.board_key, number=200, repeat=5)) / 200, 4)
    steps = {
        name: {
            "calls": len(v),
            "wall_ms": round(1e3 * statistics.median(w for w, _ in v), 4),
            "cpu_ms": round(1e3 * statistics.median(c for _, c in v), 4),
            "wall_mean_ms": round(1e3 * statistics.fmean(w for w, _ in v), 4),
        }
        for name, v in times.items()
    }
    return {
        "draft_workers": workers,
        "temperature": temperature,
        "target_exchange_ms": ssd["target_exchange_ms"],
        "board_reads": ssd["board_reads"],
        "steps": steps,
        "board_key_alone_ms": alone_ms,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.exchange_steps", description=__doc__.split("\n")[0])
    parser.add_argument("--target", default=None, help="Target model directory (default: the demo pair's).")
    parser.add_argument("--draft", default=None, help="Draft model directory (default: the demo pair's).")
    parser.add_argument("--workers", default="1,8", help="Comma-separated numbers D of draft workers.")
    parser.add_argument("--temperatures", default="0", help="Comma-separated sampling temperatures.")
    parser.add_argument("--num-prompts", type=int, default=8, help="Held-out demo prompts, generated one at a time.")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=6, help="Speculation length K.")
    parser.add_argument("--out", default=None, help="Also write the figures to this JSON file.")
    args = parser.parse_args(argv)
    from ssd.model.demo_models import heldout_prompts

    prompts = heldout_prompts(args.num_prompts)
    runs = [
        measure(args.target, args.draft, int(d), float(t), prompts, args.max_tokens, args.k)
        for t in args.temperatures.split(",")
        for d in args.workers.split(",")
    ]
    for run in runs:
        sys.stdout.write(
            f"D={run['draft_workers']} T={run['temperature']:g}: target exchange {run['target_exchange_ms']} ms, "
            f"board reads {run['board_reads']} a round\n"
        )
        if run["board_key_alone_ms"] is not None:
            sys.stdout.write(f"  board_key alone, in a loop: {run['board_key_alone_ms']:.4f} ms\n")
        for name, s in run["steps"].items():
            sys.stdout.write(
                f"  {name:13s} calls {s['calls']:5d}  wall {s['wall_ms']:.3f} ms  cpu {s['cpu_ms']:.3f} ms  "
                f"(mean wall {s['wall_mean_ms']:.3f})\n"
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(runs, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
