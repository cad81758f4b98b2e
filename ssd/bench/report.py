"""What `ssd bench` reports: the layout of bench.json (environment, config, definitions, runs in
order with their ratio to `ar`), the text table and pair-stats summary, and bench.png."""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import time
from pathlib import Path

from ssd.bench.modes import MODES, SETTINGS, available_cpus
from ssd.bench.plan import BenchPlan

logger = logging.getLogger(__name__)

JSON_VERSION = 1
DEFINITIONS = {
    "tokens_per_s": "generated tokens / wall time of the timed generate calls (after one untimed warm-up per mode)",
    "ratio_to_ar": "tokens_per_s / tokens_per_s of ar with the same setting, temperature and batch size",
    "decode_tokens_per_s": "engine modes: generated tokens / wall time of the engine's steps (prefill excluded)",
    "rounds": "sequence-rounds: one verification of one sequence (a step over b sequences counts b)",
    "mean_accepted_per_round": "accepted draft tokens / rounds (0..K)",
    "tokens_per_round": "generated tokens / rounds (after the max_tokens cut; accepted + 1 before it)",
    "draft_ms_per_round": "drafting time / rounds (hf-assisted: time in the candidate generator)",
    "verify_ms_per_round": "target verification time / rounds (not measured for hf-assisted)",
    "counters": "growth of the engine's integer metrics over the run (engine modes only)",
    "cache_hit_rate": "SSD: rows served from the speculation cache / all SSD rows (first rounds of a sequence are misses)",
    "fraction_of_bound": "SSD: decode tokens/s over the Theorem 7 bound with p_hit = 1 (the tokens/s of the steps in which every row hit)",
    "ssd": "SSD live figures at the end of the run: fan-out, budget, a and r estimates, backup, b*, T_p",
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
    rank = {f: {v: i for i, v in enumerate(dict.fromkeys([*order.get(f, []), *(r[f] for r in records)]))} for f in fields}
    return sorted(records, key=lambda r: tuple(rank[f][r[f]] for f in fields))


def _add_ratios(records: list[dict]) -> None:
    baseline = {
        (r["setting"], r["temperature"], r["batch_size"]): r["tokens_per_s"]
        for r in records
        if r["mode"] == "ar" and r.get("supported")
    }
    for r in records:
        ar = baseline.get((r["setting"], r["temperature"], r["batch_size"]))
        tps = r.get("tokens_per_s")
        r["ratio_to_ar"] = round(tps / ar, 4) if r.get("supported") and tps and ar else None


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
    json_path.write_text(json.dumps(results, indent=2) + "\n")
    logger.info("wrote %s%s in %.1f s", json_path, f" and {png_path}" if results["files"]["png"] else "", results["elapsed_s"])


# ---- text and plot ------------------------------------------------------------------------------


def _fmt(value, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def format_pair_stats(stats: dict | None) -> str:
    if not stats:
        return "pair stats: skipped (no draft model)"
    return "\n".join(
        [
            f"pair stats (1 thread, {stats['context_tokens']}-token context, median of {stats['reps']}):",
            f"  decode ms/token: target {stats['target_decode_ms']:.3f}, draft {stats['draft_decode_ms']:.3f}, draft/target {stats['draft_to_target_ratio']:.3f}",
            f"  greedy per-token acceptance {stats['greedy_acceptance']:.3f} over {stats['acceptance_positions']} positions"
            f" (per prompt: {', '.join(f'{a:.2f}' for a in stats['greedy_acceptance_per_prompt'])})",
            f"  greedy SD along the target's path, K={stats['k']}: {stats['greedy_sd_mean_accepted_per_round']:.2f} accepted,"
            f" {stats['greedy_sd_tokens_per_round']:.2f} tokens per round (i.i.d. model: {stats['iid_tokens_per_round']:.2f})",
        ]
    )


def format_table(records: list[dict]) -> str:
    headers = ["setting", "thr", "T", "batch", "mode", "tok/s", "x ar", "decode tok/s", "acc/round", "tok/round", "draft ms/rd", "verify ms/rd", "hit", "of bound"]
    rows = []
    for r in records:
        if not r.get("supported"):
            cells = [r["setting"], str(r["threads"]), f"{r['temperature']:g}", str(r["batch_size"]), r["mode"], "unsupported", "", "", "", "", "", "", "", ""]
        else:
            cells = [
                r["setting"],
                str(r["threads"]),
                f"{r['temperature']:g}",
                str(r["batch_size"]),
                r["mode"],
                _fmt(r["tokens_per_s"], ".1f"),
                _fmt(r.get("ratio_to_ar"), ".2f"),
                _fmt(r.get("decode_tokens_per_s"), ".1f"),
                _fmt(r["mean_accepted_per_round"]),
                _fmt(r["tokens_per_round"]),
                _fmt(r["draft_ms_per_round"]),
                _fmt(r["verify_ms_per_round"]),
                _fmt(r.get("cache_hit_rate"), ".2f"),
                _fmt(r.get("fraction_of_bound"), ".0%"),
            ]
        rows.append(cells)
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
    left = {0, 4}  # text columns
    line = lambda cells: "  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
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
    """Grouped bars of tokens/s: one panel per setting x temperature, groups = batch sizes,
    bars = modes (labelled with the ratio to ar)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    runs = results["runs"]
    settings = list(dict.fromkeys(r["setting"] for r in runs))
    temperatures = list(dict.fromkeys(r["temperature"] for r in runs))
    modes = list(dict.fromkeys(r["mode"] for r in runs))
    batches = list(dict.fromkeys(r["batch_size"] for r in runs))
    index = {(r["setting"], r["temperature"], r["batch_size"], r["mode"]): r for r in runs}
    fig = Figure(figsize=(4.2 * len(temperatures) + 1, 3.4 * len(settings) + 0.6), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(settings), len(temperatures), squeeze=False)
    width = 0.8 / max(len(modes), 1)
    colors = [f"C{i}" for i in range(10)]
    for i, setting in enumerate(settings):
        for j, temperature in enumerate(temperatures):
            ax = axes[i][j]
            for m, mode in enumerate(modes):
                xs, heights, labels = [], [], []
                for b, batch in enumerate(batches):
                    r = index.get((setting, temperature, batch, mode))
                    x = b + (m - (len(modes) - 1) / 2) * width
                    if r is None or not r.get("supported") or not r.get("tokens_per_s"):
                        ax.text(x, 0, "n/a", ha="center", va="bottom", fontsize=7, rotation=90)
                        continue
                    xs.append(x)
                    heights.append(r["tokens_per_s"])
                    labels.append(f"{r['ratio_to_ar']:.2f}x" if r.get("ratio_to_ar") else "")
                bars = ax.bar(xs, heights, width, label=mode, color=colors[m % len(colors)])
                ax.bar_label(bars, labels=labels, fontsize=7, padding=1)
            threads = results["config"]["settings"].get(setting, {}).get("threads")
            ax.set_title(f"{setting} ({threads} thread{'s' if threads != 1 else ''}), T={temperature:g}", fontsize=9)
            ax.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
            ax.set_xlim(-0.5, len(batches) - 0.5)
            ax.set_ylabel("tokens/s")
            ax.margins(y=0.15)
    axes[0][0].legend(fontsize=8)
    cfg = results["config"]
    fig.suptitle(f"ssd bench: K={cfg['k']}, {cfg['num_prompts']} prompts x {cfg['max_tokens']} tokens", fontsize=10)
    fig.savefig(path, dpi=110)
