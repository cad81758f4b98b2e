"""`ssd bench`: decoding modes side by side on the same held-out prompts.

What one run measures (see `run`):
- pair stats (1 thread): single-token decode time of target and draft with a KV cache of a
  ~128-token context, their ratio, and the draft's greedy per-token acceptance along the target's
  greedy path (teacher forcing) on held-out prompts;
- for every setting (thread budget) x temperature x batch size x mode: tokens/s after one warm-up
  generation per mode, mean accepted tokens per round, tokens per round, draft/verify time per
  round, and the ratio of tokens/s to `ar` in the same setting/temperature/batch size.

Thread budgets must be fixed before torch builds its thread pool, so every setting runs in its own
child process (`python -m ssd.bench --_worker SPEC`) with OMP_NUM_THREADS set; children talk back
over a private pipe in JSON lines and are killed whenever the parent stops early.

Modes are data: `MODES` maps a name to how to build a runner for it (`register_mode`). An engine
mode is one line: `register_mode(BenchMode("ssd", "...", build=engine_mode("ssd")))`.

This package imports neither torch nor transformers at import time (the CLI imports it to build
its parser); the heavy imports happen inside the worker.

Layout, one role per module:
- `modes`: thread settings, the mode registry, and the runners (this engine, Hugging Face
  assisted generation);
- `plan`: the flags (`add_arguments`) and their validation into a `BenchPlan`;
- `pair_stats`: the pair stats measurement;
- `worker`: the child process (timed runs of the modes, its JSON-lines protocol) and the parent's
  side of it;
- `report`: bench.json's layout, ratios and order of the runs, the table, bench.png;
- `cli`: `run` (plan, workers, results) and `main` (`python -m ssd.bench`, see `__main__`).

Commands of their own, each what a user runs to size a deployment:
- `startup` (`python -m ssd.bench.startup`): how long an engine takes to start, to give its first
  tokens and to close, and a draft worker to be ready and to be replaced;
- `real_shapes` (`python -m ssd.bench.real_shapes`): speed at Llama-3.1-8B / 3.2-1B shapes on a
  GPU against the bandwidth bound;
- `matched_pair` and `matched_bench` (`python -m ssd.bench.matched_bench`): a pair at those shapes
  whose acceptance is real, through the engine;
- `projection`: what a draft on its own device would give (bench.json's `projection`, and
  matched_bench's).

One-off investigations (pack time, processing share and cost, vocabulary speed, grammar cost,
contention, payload, the miss law across D, constrained requests, tensor-parallel memory) are not
part of this package: they are scripts in the repository's top-level `benchmarks/`, which import
`ssd` and are never imported by it.
"""

from ssd.bench.cli import main, run
from ssd.bench.modes import (
    MODES,
    SETTINGS,
    BatchCounters,
    BenchContext,
    BenchMode,
    BenchSetting,
    EngineRunner,
    HFAssistedRunner,
    ModeRunner,
    available_cpus,
    engine_mode,
    register_mode,
)
from ssd.bench.pair_stats import PAIR_CONTEXT_TOKENS
from ssd.bench.plan import BenchPlan, add_arguments
from ssd.bench.report import (  # noqa: F401 (not public; reached as bench._add_ratios by the tests)
    DEFINITIONS,
    JSON_VERSION,
    _add_ratios,
    _aggregate,
    _ordered,
    format_pair_stats,
    format_table,
    write_plot,
)
from ssd.bench.worker import worker_main

__all__ = [
    "add_arguments",
    "run",
    "main",
    "worker_main",
    "MODES",
    "SETTINGS",
    "BatchCounters",
    "BenchContext",
    "BenchMode",
    "BenchSetting",
    "BenchPlan",
    "EngineRunner",
    "HFAssistedRunner",
    "ModeRunner",
    "available_cpus",
    "engine_mode",
    "register_mode",
    "format_pair_stats",
    "format_table",
    "write_plot",
    "DEFINITIONS",
    "JSON_VERSION",
    "PAIR_CONTEXT_TOKENS",
]
