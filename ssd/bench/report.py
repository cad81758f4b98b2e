"""What `ssd bench` reports: the layout of bench.json (environment, config, definitions, runs in
order with their ratio to `ar`), the text table and pair-stats summary, and bench.png."""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from ssd.bench.modes import MODES, SETTINGS, available_cpus
from ssd.bench.plan import BenchPlan
from ssd.bench.projection import format_projections, project_runs
from ssd.engine.autopilot import AUTO_MODES

logger = logging.getLogger(__name__)

JSON_VERSION = 1
DEFINITIONS = {
    "tokens_per_s": "generated tokens / wall time of the timed generate calls (after one untimed warm-up per mode)",
    "ratio_to_ar": "tokens_per_s / tokens_per_s of ar with the same setting, temperature, batch size "
    "and repeat (median over "
    "repeats)",
    "batch_spread": "10th-90th percentile over every batch of every repeat (at batch 1: over prompts) of "
    "batch_tokens_per_s (each batch's own tokens/s) and batch_ratio_to_sd (each batch's against sd's same "
    "batch: the same prompts and seeds); the table's p10-p90 column",
    "ratio_to_sd": "tokens_per_s / tokens_per_s of sd with the same setting, temperature, batch size "
    "and repeat (median over "
    "repeats)",
    "ratio_to_best": "tokens_per_s / the highest tokens_per_s of ar, sd and ssd (the modes auto chooses among) "
    "with the same setting, temperature, batch size and repeat (median over repeats)",
    "repeats": "timed runs of the mode, interleaved with the other modes; every figure in "
    "MEDIAN_FIELDS is the median over "
    "them",
    "range": "[min, max] over the repeats of each median figure",
    "per_repeat": "each median figure's values, in repeat order",
    "acceptance_rate": "accepted draft tokens / draft tokens offered (engine modes)",
    "decode_tokens_per_s": "engine modes: generated tokens / wall time of the engine's steps (prefill excluded)",
    "rounds": "sequence-rounds: one verification of one sequence (a step over b sequences counts b)",
    "mean_accepted_per_round": "accepted draft tokens / rounds (0..K)",
    "tokens_per_round": "generated tokens / rounds (after the max_tokens cut; accepted + 1 before it)",
    "draft_ms_per_round": "drafting time / rounds (hf-assisted: time in the candidate generator)",
    "verify_ms_per_round": "target verification time / rounds (not measured for hf-assisted)",
    "counters": "growth of the engine's integer metrics over the run (engine modes only)",
    "cache_hit_rate": "SSD: rows served from the speculation cache / all SSD rows (first rounds of a "
    "sequence are misses)",
    "target_exchange_ms": "SSD over a pool of draft workers: the median over the run's rounds of the target's "
    "own time in the pool's begin_round, resolve and reply (sending the round and its outcome, waiting for "
    "the replies it needs, merging them), its forwards excluded",
    "replies_awaited": "SSD over a pool: worker replies the target waited for, per round (mean)",
    "board_reads": "SSD over a pool on shm: rows per round whose hit the target read off its worker's board "
    "instead of awaiting a reply (mean)",
    "fraction_of_bound": "SSD: decode tokens/s over the Theorem 7 bound with p_hit = 1 (the tokens/s of the "
    "steps in which every row "
    "hit)",
    "ssd": "SSD live figures at the end of the run: fan-out, tree branches, a and r estimates, backup, b*, T_p",
    "projection": "not a measurement: SSD's tokens/s with the draft on its own device, from Theorem 7 and the "
    "batch-1 sd and ssd records' parts (ssd/bench/projection.py)",
}


# ---- bench.json ---------------------------------------------------------------------------------


def new_results(plan: BenchPlan, args: argparse.Namespace, settings: dict[str, int]) -> dict:
    """What bench.json holds before any worker reports (`settings`: name -> threads)."""
    return {
        "version": JSON_VERSION,
        "environment": _environment(plan, args),
        "config": {
            "k": plan.k,
            "num_prompts": plan.num_prompts,
            "max_tokens": plan.max_tokens,
            "temperatures": plan.temperatures,
            "batch_sizes": plan.batch_sizes,
            "modes": {m: MODES[m].description for m in plan.modes},
            "settings": {s: {"threads": t, "description": SETTINGS[s].description} for s, t in settings.items()},
            "seed": plan.seed,
            "dtype": plan.dtype,
            "draft_dtype": plan.draft_dtype,
            "device": plan.device,
            "saguaro_c": plan.saguaro_c,
            "ssd_budgets": plan.ssd_budgets,
            "repeats": plan.repeats,
        },
        "definitions": DEFINITIONS,
        "pair_stats": None,
        "runs": [],
    }


def _environment(plan: BenchPlan, args: argparse.Namespace) -> dict:
    from importlib import metadata

    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    plain_args = {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, type(None)))}
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch_version": version("torch"),
        "transformers_version": version("transformers"),
        "cpu_count": os.cpu_count(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
        "available_cpus": available_cpus(),
        "args": plain_args,
        "target": plan.target,
        "draft": plan.draft,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _ordered(records: list[dict], order: dict[str, list] | None = None) -> list[dict]:
    """Records grouped by setting, temperature, batch size, then mode, each in the order given
    (default: first seen)."""
    fields = ("setting", "temperature", "batch_size", "mode")
    order = order or {}
    rank = {
        f: {v: i for i, v in enumerate(dict.fromkeys([*order.get(f, []), *(r[f] for r in records)]))} for f in fields
    }
    return sorted(records, key=lambda r: tuple(rank[f][r[f]] for f in fields))


def _add_ratios(records: list[dict]) -> None:
    """ratio_to_ar and ratio_to_sd of every record, against the baseline run of the same setting,
    temperature, batch size and repeat (paired: both measured minutes apart at most)."""

    def key(r: dict) -> tuple:
        return r["setting"], r["temperature"], r["batch_size"], r.get("repeat", 0)

    for base, field in (("ar", "ratio_to_ar"), ("sd", "ratio_to_sd")):
        baseline = {key(r): r for r in records if r["mode"] == base and r.get("supported")}
        for r in records:
            ref = baseline.get(key(r), {})
            tps = r.get("tokens_per_s")
            r[field] = round(tps / ref["tokens_per_s"], 4) if r.get("supported") and tps and ref else None
            if field == "ratio_to_sd" and r.get("supported") and ref:
                r["batch_ratio_to_sd"] = _paired_ratios(r.get("batch_tokens_per_s"), ref.get("batch_tokens_per_s"))
    best: dict[tuple, float] = {}
    for r in records:
        if r.get("base_mode", r["mode"]) in AUTO_MODES and r.get("supported") and r.get("tokens_per_s"):
            best[key(r)] = max(best.get(key(r), 0.0), r["tokens_per_s"])
    for r in records:
        ref, tps = best.get(key(r)), r.get("tokens_per_s")
        r["ratio_to_best"] = round(tps / ref, 4) if r.get("supported") and tps and ref else None


def _paired_ratios(mine: list | None, base: list | None) -> list[float] | None:
    """Batch by batch (the same prompts and seeds in both runs): mine / base."""
    if not mine or not base or len(mine) != len(base) or not all(mine) or not all(base):
        return None
    return [round(a / b, 4) for a, b in zip(mine, base)]


def _spread(runs: list[dict], name: str) -> list[float] | None:
    """[10th, 90th] percentile of a per-batch list over every batch of every repeat."""
    values = [v for r in runs for v in (r.get(name) or [])]
    if len(values) < 2:
        return None
    deciles = statistics.quantiles(values, n=10, method="inclusive")
    return [round(deciles[0], 4), round(deciles[-1], 4)]


# Figures reported as the median over repeats, with their range.
MEDIAN_FIELDS = (
    "tokens_per_s",
    "ratio_to_ar",
    "ratio_to_sd",
    "ratio_to_best",
    "decode_tokens_per_s",
    "mean_accepted_per_round",
    "acceptance_rate",
    "tokens_per_round",
    "draft_ms_per_round",
    "verify_ms_per_round",
    "cache_hit_rate",
    "target_exchange_ms",
    "replies_awaited",
    "board_reads",
    "upper_bound_tokens_per_s",
    "fraction_of_bound",
    "wall_s",
)


def _aggregate(records: list[dict]) -> list[dict]:
    """One record per setting, temperature, batch size and mode: the run whose tokens/s is the
    median (its counters and live figures), with every figure of MEDIAN_FIELDS replaced by its
    median over the repeats, `range` [min, max] and `per_repeat` (values in repeat order)."""
    _add_ratios(records)
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["setting"], r["temperature"], r["batch_size"], r["mode"]), []).append(r)
    out = []
    for runs in groups.values():
        runs = sorted(runs, key=lambda r: r.get("repeat", 0))
        if not runs[0].get("supported"):
            out.append({k: v for k, v in runs[0].items() if k != "repeat"})
            continue
        middle = sorted(runs, key=lambda r: r["tokens_per_s"] or 0.0)[(len(runs) - 1) // 2]
        agg = {k: v for k, v in middle.items() if k != "repeat"}
        agg["repeats"] = len(runs)
        agg["range"], agg["per_repeat"] = {}, {}
        for name in MEDIAN_FIELDS:
            values = [r.get(name) for r in runs]
            if any(v is None for v in values):
                continue
            agg[name] = round(statistics.median(values), 4)
            agg["range"][name] = [min(values), max(values)]
            agg["per_repeat"][name] = values
        agg["batch_spread"] = {
            name: spread for name in ("batch_tokens_per_s", "batch_ratio_to_sd") if (spread := _spread(runs, name))
        }
        out.append(agg)
    return out


def write_results(results: dict, out_dir: Path) -> None:
    """Write out_dir/bench.json and, when there are runs, out_dir/bench.png and the table on stdout."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "bench.json"
    png_path = out_dir / "bench.png"
    results["files"] = {"json": str(json_path), "png": None}
    if results["runs"]:
        write_plot(results, png_path)
        results["files"]["png"] = str(png_path)
        sys.stdout.write(format_table(results["runs"]) + "\n")
        projections = project_runs(results["runs"], results["config"]["k"])
        if projections:
            results["projection"] = projections
            sys.stdout.write(format_projections(projections) + "\n")
    json_path.write_text(json.dumps(results, indent=2) + "\n")
    logger.info(
        "wrote %s%s in %.1f s", json_path, f" and {png_path}" if results["files"]["png"] else "", results["elapsed_s"]
    )


# ---- text and plot ------------------------------------------------------------------------------


def _fmt(value, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def format_pair_stats(stats: dict | None) -> str:
    if not stats:
        return "pair stats: skipped (no draft model)"
    return "\n".join(
        [
            f"pair stats (1 thread, {stats['context_tokens']}-token context, median of {stats['reps']}):",
            f"  decode ms/token, Hugging Face forward: target {stats['target_decode_ms']:.3f}, draft "
            f"{stats['draft_decode_ms']:.3f}"
            f" (target/draft {stats['target_to_draft_ratio']:.2f}x)",
            f"  decode ms/token, engine forward (lean, packed target): target {stats['target_decode_ms_engine']:.3f},"
            f" draft {stats['draft_decode_ms_engine']:.3f} (target/draft {stats['target_to_draft_ratio_engine']:.2f}x)",
            f"  greedy per-token acceptance {stats['greedy_acceptance']:.3f} over "
            f"{stats['acceptance_positions']} positions"
            f" (per prompt: {', '.join(f'{a:.2f}' for a in stats['greedy_acceptance_per_prompt'])})",
            f"  greedy SD along the target's path, K={stats['k']}: "
            f"{stats['greedy_sd_mean_accepted_per_round']:.2f} accepted,"
            f" {stats['greedy_sd_tokens_per_round']:.2f} tokens per round (i.i.d. model: "
            f"{stats['iid_tokens_per_round']:.2f})",
        ]
    )


def _range(r: dict, name: str, spec: str) -> str:
    lo_hi = r.get("range", {}).get(name)
    return "-" if not lo_hi else f"{format(lo_hi[0], spec)}-{format(lo_hi[1], spec)}"


def _spread_cell(r: dict, name: str) -> str:
    lo_hi = r.get("batch_spread", {}).get(name)
    return "-" if not lo_hi else f"{lo_hi[0]:.2f}-{lo_hi[1]:.2f}"


def format_table(records: list[dict]) -> str:
    """One line per record; with repeats, tok/s and the ratios are medians and a range column
    follows each."""
    ranged = any(r.get("repeats", 1) > 1 for r in records)
    auto = any(r["mode"] == "auto" for r in records)  # then auto's ratio to the best mode, paired per repeat
    # x sd's spread over batches (at batch 1, over prompts), when there are several
    spread = any("batch_ratio_to_sd" in r.get("batch_spread", {}) for r in records)
    columns = [  # (header, cell of a supported record)
        ("setting", lambda r: r["setting"]),
        ("thr", lambda r: str(r["threads"])),
        ("T", lambda r: f"{r['temperature']:g}"),
        ("batch", lambda r: str(r["batch_size"])),
        ("mode", lambda r: r["mode"]),
        ("tok/s", lambda r: _fmt(r["tokens_per_s"], ".1f")),
        *([("range", lambda r: _range(r, "tokens_per_s", ".0f"))] if ranged else []),
        ("x ar", lambda r: _fmt(r.get("ratio_to_ar"), ".2f")),
        ("x sd", lambda r: _fmt(r.get("ratio_to_sd"), ".2f")),
        *([("range", lambda r: _range(r, "ratio_to_sd", ".2f"))] if ranged else []),
        *([("p10-p90", lambda r: _spread_cell(r, "batch_ratio_to_sd"))] if spread else []),
        *([("x best", lambda r: _fmt(r.get("ratio_to_best"), ".2f"))] if auto else []),
        *([("range", lambda r: _range(r, "ratio_to_best", ".2f"))] if auto and ranged else []),
        ("decode tok/s", lambda r: _fmt(r.get("decode_tokens_per_s"), ".1f")),
        ("acc rate", lambda r: _fmt(r.get("acceptance_rate"))),
        ("tok/round", lambda r: _fmt(r["tokens_per_round"])),
        ("draft ms/rd", lambda r: _fmt(r["draft_ms_per_round"])),
        ("verify ms/rd", lambda r: _fmt(r["verify_ms_per_round"])),
        ("hit", lambda r: _fmt(r.get("cache_hit_rate"), ".2f")),
        ("xchg ms", lambda r: _fmt(r.get("target_exchange_ms"), ".2f")),
        ("replies", lambda r: _fmt(r.get("replies_awaited"), ".2f")),
        ("board", lambda r: _fmt(r.get("board_reads"), ".2f")),
        ("of bound", lambda r: _fmt(r.get("fraction_of_bound"), ".0%")),
    ]
    headers = [h for h, _ in columns]
    rows = []
    for r in records:
        if r.get("supported"):
            rows.append([cell(r) for _, cell in columns])
        else:
            rows.append([cell(r) for _, cell in columns[:5]] + ["unsupported"] + [""] * (len(columns) - 6))
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
    left = {0, 4}  # text columns

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    out = [line(headers), "  ".join("-" * w for w in widths)]
    previous = None
    for r, cells in zip(records, rows):
        group = (r["setting"], r["temperature"], r["batch_size"])
        if previous is not None and group != previous:
            out.append("")
        previous = group
        out.append(line(cells).rstrip())
    return "\n".join(out)


def write_plot(results: dict, path: Path) -> None:
    """Grouped bars of tokens/s (median over repeats, whiskers: the range): one panel per setting
    x temperature, groups = batch sizes, bars = modes and their SSD variants (labelled with the
    ratio to ar and, for SSD, the cache hit rate)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    runs = results["runs"]
    settings = list(dict.fromkeys(r["setting"] for r in runs))
    temperatures = list(dict.fromkeys(r["temperature"] for r in runs))
    modes = list(dict.fromkeys(r["mode"] for r in runs))
    batches = list(dict.fromkeys(r["batch_size"] for r in runs))
    index = {(r["setting"], r["temperature"], r["batch_size"], r["mode"]): r for r in runs}
    panel_width = max(4.2, 0.5 * len(modes) * len(batches))
    fig = Figure(figsize=(panel_width * len(temperatures) + 1, 3.6 * len(settings) + 0.6), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(settings), len(temperatures), squeeze=False)
    width = 0.8 / max(len(modes), 1)
    colors = [f"C{i}" for i in range(10)]
    for i, setting in enumerate(settings):
        for j, temperature in enumerate(temperatures):
            ax = axes[i][j]
            for m, mode in enumerate(modes):
                xs, heights, labels, errors = [], [], [], []
                for b, batch in enumerate(batches):
                    r = index.get((setting, temperature, batch, mode))
                    x = b + (m - (len(modes) - 1) / 2) * width
                    if r is None or not r.get("supported") or not r.get("tokens_per_s"):
                        ax.text(x, 0, "n/a", ha="center", va="bottom", fontsize=7, rotation=90)
                        continue
                    xs.append(x)
                    heights.append(r["tokens_per_s"])
                    lo, hi = r.get("range", {}).get("tokens_per_s", [r["tokens_per_s"]] * 2)
                    errors.append((r["tokens_per_s"] - lo, hi - r["tokens_per_s"]))
                    label = f"{r['ratio_to_ar']:.2f}x" if r.get("ratio_to_ar") else ""
                    if r.get("cache_hit_rate") is not None:
                        label += f"\nhit {r['cache_hit_rate']:.2f}"
                    labels.append(label)
                yerr = list(zip(*errors)) if errors and any(e != (0, 0) for e in errors) else None
                bars = ax.bar(xs, heights, width, yerr=yerr, capsize=2, label=mode, color=colors[m % len(colors)])
                ax.bar_label(bars, labels=labels, fontsize=6, padding=1)
            threads = results["config"]["settings"].get(setting, {}).get("threads")
            ax.set_title(f"{setting} ({threads} thread{'s' if threads != 1 else ''}), T={temperature:g}", fontsize=9)
            ax.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
            ax.set_xlim(-0.5, len(batches) - 0.5)
            ax.set_ylabel("tokens/s")
            ax.margins(y=0.15)
    axes[0][0].legend(fontsize=7, ncols=2 if len(modes) > 6 else 1)
    cfg = results["config"]
    repeats = f", median of {cfg['repeats']} interleaved repeats" if cfg.get("repeats", 1) > 1 else ""
    fig.suptitle(
        f"ssd bench: K={cfg['k']}, {cfg['num_prompts']} prompts x {cfg['max_tokens']} tokens{repeats}", fontsize=10
    )
    fig.savefig(path, dpi=110)


def write_json(path: str | Path, doc) -> Path:
    """Write a bench command's results as indented JSON (making its folder) and log where."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    logger.info("wrote %s", out)
    return out


def add_pair_arguments(parser: argparse.ArgumentParser) -> None:
    """--target and --draft, as every bench command that runs a model pair takes them."""
    parser.add_argument("--target", help="Target model directory (default: the demo pair's).")
    parser.add_argument("--draft", help="Draft model directory (default: the demo pair's).")
