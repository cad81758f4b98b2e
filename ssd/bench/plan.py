"""The flags of `ssd bench` and their validation into a `BenchPlan`."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

from ssd.bench.modes import MODES, SETTINGS, available_cpus


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `ssd bench` (also accepted by `python -m ssd.bench`)."""
    parser.add_argument(
        "--target", default=None, help="Target model (local directory or hub id). Default: the bundled demo target."
    )
    parser.add_argument(
        "--draft",
        default=None,
        help="Draft model with the target's vocabulary. Default: the bundled demo draft (only with the demo target).",
    )
    parser.add_argument(
        "--k",
        type=int,
        default=6,
        help="Speculation length K (draft tokens per round) for every speculative mode, hf-assisted included.",
    )
    parser.add_argument(
        "--num-prompts",
        type=int,
        default=8,
        help="Held-out code-completion prompts per run (cycled to fill a batch when fewer).",
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=128,
        help="Tokens generated per prompt (EOS ignored, so every run generates exactly this many).",
    )
    parser.add_argument("--temperatures", default="0,1", help="Comma-separated sampling temperatures; 0 = greedy.")
    parser.add_argument(
        "--settings",
        default="paper,machine",
        help="Comma-separated thread settings, from: "
        f"{', '.join(f'{s.name} ({s.description})' for s in SETTINGS.values())}.",
    )
    parser.add_argument(
        "--modes",
        default="ar,sd,ssd,ssd-uniform,hf-assisted,hf-assisted-default",
        help=f"Comma-separated decoding modes, from: {', '.join(MODES)}. `ar` is the baseline of the ratio column.",
    )
    parser.add_argument(
        "--batch-sizes",
        default="1",
        help="Comma-separated batch sizes (prompts decoded together); hf-assisted runs at batch size 1 only.",
    )
    parser.add_argument(
        "--out-dir", default="bench_results", help="Directory for bench.json and bench.png (created if missing)."
    )
    parser.add_argument(
        "--pair-stats-only",
        action="store_true",
        help="Only measure and print the pair stats (decode times, greedy acceptance).",
    )
    parser.add_argument(
        "--pair-reps",
        type=int,
        default=50,
        help="Timed repetitions of the single-token decode for the pair stats (median reported).",
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["auto", "float32", "float16", "bfloat16"],
        help="dtype of both models in every mode.",
    )
    parser.add_argument(
        "--draft-dtype",
        default=None,
        choices=["auto", "float32", "float16", "bfloat16"],
        help="dtype of the draft in every mode (default: --dtype); never changes the output's distribution, only "
        "acceptance and speed.",
    )
    parser.add_argument(
        "--device", default="cpu", help="torch device of both models in every mode (cpu, cuda, cuda:1, ...)."
    )
    parser.add_argument("--no-progress", action="store_true", help="Hide the progress bar.")
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="Base random seed: request i of repeat j is sampled with seed + j*n + i (n requests per run) in every "
        "mode.",
    )
    parser.add_argument(
        "--saguaro-c",
        default=None,
        help="Comma-separated Saguaro sampling constants C in [0, 1]: every SSD mode runs once per value (rows "
        "labelled C=...). Default: the engine's default only.",
    )
    parser.add_argument(
        "--ssd-budget",
        default=None,
        help="Comma-separated SSD cache budgets B >= 1: every SSD mode runs once per value with that fixed budget "
        "(rows labelled B=...; the adaptive budget is off in those rows). Default: the engine's default "
        "(adaptive, at most 16).",
    )
    parser.add_argument(
        "--draft-workers",
        default=None,
        help="Comma-separated numbers D >= 1 of draft workers sharing the speculation tree: every SSD mode runs once "
        "per value (rows labelled D=...; each worker builds ssd_budget branches, so the tree covers D times as "
        "many). Default: 1. With more workers than free cores the workers share cores, and the output says so.",
    )
    parser.add_argument(
        "--draft-transports",
        default=None,
        help="Comma-separated draft transports (shm, gloo, torch, grpc): every SSD mode runs once per value (rows "
        "labelled tr=...), to compare what each costs per round. Default: the engine's default (shm).",
    )
    parser.add_argument(
        "--draft-splits",
        default=None,
        help="Comma-separated ways D > 1 draft workers share the work (auto, outcomes, sequences; see draft_split): "
        "every SSD mode runs once per value (rows labelled split=...). Default: the engine's default (auto: the "
        "engine measures both and runs the faster).",
    )
    parser.add_argument(
        "--draft-worker-cpus",
        default=None,
        help="Comma-separated placements of the draft workers on this host's cores (shared, pinned; see "
        "draft_worker_cpus): every SSD mode runs once per value (rows labelled cpus=...). Default: the engine's "
        "default (shared: the OS places them).",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        default=None,
        help="Comma-separated tensor_parallel_size values: every mode of this engine runs once per value with the "
        "target split over that many ranks (rows labelled tp=...; the ranks share the setting's threads). Default: 1.",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="Run every mode this many times, interleaved (mode after mode, then again); report each figure and ratio "
        "as the median over repeats with its range.",
    )


def _split(text: str, name: str) -> list[str]:
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    if not items:
        raise ValueError(f"--{name} must list at least one value")
    return list(dict.fromkeys(items))


@dataclass(frozen=True)
class BenchPlan:
    target: str
    draft: str | None
    k: int
    num_prompts: int
    max_tokens: int
    temperatures: list[float]
    settings: list[str]
    modes: list[str]
    batch_sizes: list[int]
    out_dir: Path
    pair_stats_only: bool
    pair_reps: int
    dtype: str
    draft_dtype: str
    device: str
    progress: bool
    seed: int
    saguaro_c: list[float] | None = None  # SSD variants to run (None: the engine's default)
    ssd_budgets: list[int] | None = None
    draft_workers: list[int] | None = None
    draft_transports: list[str] | None = None
    draft_splits: list[str] | None = None
    draft_worker_cpus: list[str] | None = None
    tensor_parallel_sizes: list[int] | None = None
    repeats: int = 1

    def ssd_sweeps(self) -> dict[str, list]:
        """The SSD options swept (modes.SWEEP_TAGS' keys), each with its values."""
        swept = {
            "saguaro_c": self.saguaro_c,
            "ssd_budget": self.ssd_budgets,
            "draft_workers": self.draft_workers,
            "draft_transport": self.draft_transports,
            "draft_split": self.draft_splits,
            "draft_worker_cpus": self.draft_worker_cpus,
        }
        return {key: values for key, values in swept.items() if values}


def demo_pair() -> tuple[str, str]:
    """(target, draft) directories of the bundled demo pair; a clear error if they are missing."""
    from ssd.core.config import DEMO_MODELS_DIR

    target, draft = str(DEMO_MODELS_DIR / "target"), str(DEMO_MODELS_DIR / "draft")
    missing = [p for p in (target, draft) if not Path(p).exists()]
    if missing:
        raise ValueError(
            f"the bundled demo pair is missing ({', '.join(missing)}): run `ssd build-demo-models` first, or "
            "pass --target/--draft"
        )
    return target, draft


def _plan(args: argparse.Namespace) -> BenchPlan:
    """The flags, validated (ValueError naming the flag), as a BenchPlan."""
    get = lambda name, default=None: getattr(args, name, default)  # noqa: E731 (the CLI may omit optional flags)
    target, draft = _models(get)
    temperatures, batch_sizes, settings, modes = _grid(get)
    if draft is None and any(MODES[m].needs_draft for m in modes):
        raise ValueError(
            f"modes {[m for m in modes if MODES[m].needs_draft]} need a draft model: pass --draft or use --modes ar"
        )
    saguaro_c, budgets = _ssd_values(get("saguaro_c"), get("ssd_budget"))
    workers = _integers(get("draft_workers"), "draft-workers", 1, 64) if get("draft_workers") is not None else None
    transports = _names(get("draft_transports"), "draft-transports", ("shm", "gloo", "torch", "grpc"))
    placements = _names(get("draft_worker_cpus"), "draft-worker-cpus", ("shared", "pinned"))
    most = max(workers or [1])
    if "pinned" in (placements or []) and most >= available_cpus():
        raise ValueError(
            f"--draft-worker-cpus pinned gives each of up to {most} draft workers a core and the target one, "
            f"{most + 1} in all; this machine has {available_cpus()}: lower --draft-workers or leave out pinned"
        )
    k, num_prompts, max_tokens, reps = get("k", 6), get("num_prompts", 8), get("max_tokens", 128), get("pair_reps", 50)
    repeats = get("repeats", 1)
    counts = {"k": k, "num-prompts": num_prompts, "max-tokens": max_tokens, "pair-reps": reps, "repeats": repeats}
    for name, value in counts.items():
        if value < 1:
            raise ValueError(f"--{name} must be >= 1, got {value}")
    return BenchPlan(
        target=str(target),
        draft=None if draft is None else str(draft),
        k=k,
        num_prompts=num_prompts,
        max_tokens=max_tokens,
        temperatures=temperatures,
        settings=settings,
        modes=modes,
        batch_sizes=batch_sizes,
        out_dir=Path(get("out_dir", "bench_results")),
        pair_stats_only=bool(get("pair_stats_only", False)),
        pair_reps=reps,
        dtype=get("dtype", "float32"),
        draft_dtype=get("draft_dtype", None) or get("dtype", "float32"),
        device=get("device", "cpu"),
        progress=not get("no_progress", False),
        seed=get("seed", 0) or 0,
        saguaro_c=saguaro_c,
        ssd_budgets=budgets,
        draft_workers=workers,
        draft_transports=transports,
        draft_splits=_names(get("draft_splits"), "draft-splits", ("auto", "outcomes", "sequences")),
        draft_worker_cpus=placements,
        tensor_parallel_sizes=_tp_sizes(get("tensor_parallel_size")),
        repeats=repeats,
    )


def _models(get) -> tuple[str, str | None]:
    """--target and --draft, the demo pair when neither is given."""
    target, draft = get("target"), get("draft")
    if target is None:
        if draft is not None:
            raise ValueError("--draft was given without --target: pass --target too (or neither for the demo pair)")
        target, draft = demo_pair()
    return target, draft


def _grid(get) -> tuple[list[float], list[int], list[str], list[str]]:
    """--temperatures, --batch-sizes, --settings and --modes, validated."""
    try:
        temperatures = [float(t) for t in _split(get("temperatures", "0,1"), "temperatures")]
        batch_sizes = [int(b) for b in _split(get("batch_sizes", "1"), "batch-sizes")]
    except ValueError as err:
        raise ValueError(f"--temperatures takes numbers and --batch-sizes integers, comma-separated: {err}") from None
    if any(not math.isfinite(t) or t < 0 for t in temperatures):
        raise ValueError(f"temperatures must be finite and >= 0, got {temperatures}")
    if any(b < 1 for b in batch_sizes):
        raise ValueError(f"batch sizes must be >= 1, got {batch_sizes}")
    settings = _split(get("settings", "paper,machine"), "settings")
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown:
        raise ValueError(f"unknown setting(s) {unknown}: choose from {list(SETTINGS)}")
    modes = _split(get("modes", "ar,sd,hf-assisted"), "modes")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"unknown mode(s) {unknown}: choose from {list(MODES)}")
    return temperatures, batch_sizes, settings, modes


def _names(value: str | None, flag: str, allowed: tuple[str, ...]) -> list[str] | None:
    """A comma-separated flag of names as a list (None when not given), each one of `allowed`."""
    if value is None:
        return None
    names = _split(value, flag)
    unknown = [n for n in names if n not in allowed]
    if unknown:
        raise ValueError(f"--{flag}: unknown {unknown}; choose from {', '.join(allowed)}")
    return names


def _ssd_values(saguaro_c: str | None, budgets: str | None) -> tuple[list[float] | None, list[int] | None]:
    """--saguaro-c and --ssd-budget as lists (None when not given), validated."""
    cs = bs = None
    if saguaro_c is not None:
        try:
            cs = [float(c) for c in _split(saguaro_c, "saguaro-c")]
        except ValueError as err:
            raise ValueError(f"--saguaro-c takes comma-separated numbers in [0, 1]: {err}") from None
        if any(not 0.0 <= c <= 1.0 for c in cs):
            raise ValueError(f"--saguaro-c values must be in [0, 1], got {cs}")
    if budgets is not None:
        try:
            bs = [int(b) for b in _split(budgets, "ssd-budget")]
        except ValueError as err:
            raise ValueError(f"--ssd-budget takes comma-separated integers >= 1: {err}") from None
        if any(b < 1 for b in bs):
            raise ValueError(f"--ssd-budget values must be >= 1, got {bs}")
    return cs, bs


def _tp_sizes(sizes: str | None) -> list[int] | None:
    """--tensor-parallel-size as a list (None when not given), validated."""
    return None if sizes is None else _integers(sizes, "tensor-parallel-size", 1, 64)


def _integers(text: str, flag: str, low: int, high: int) -> list[int]:
    """A flag's comma-separated integers, each in [low, high]; ValueError naming the flag."""
    try:
        values = [int(v) for v in _split(text, flag)]
    except ValueError as err:
        raise ValueError(f"--{flag} takes comma-separated integers in [{low}, {high}]: {err}") from None
    if any(not low <= v <= high for v in values):
        raise ValueError(f"--{flag} values must be in [{low}, {high}], got {values}")
    return values
