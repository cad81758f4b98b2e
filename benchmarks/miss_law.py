"""Does the fitted miss law predict what more draft workers buy? (`python -m benchmarks.miss_law`)

With D draft workers the round's tree covers D times `ssd_budget` branches, so each outcome j has a
larger fan-out F_j, and the hit rate should rise as the miss law 1 - p_hit(F) = m F^(-r) says.
This command runs the same prompts with D = 1, 2, 4 (one engine each, `LLM(mode="ssd")` with
its own worker processes), collects every sequence-round's (F at the real outcome, whether the
outcome was in the tree) from `llm.metrics()["ssd"]["miss_law_counts"]`, fits (m, r) on D = 1
alone, and compares each D's observed in-tree rate with the law's prediction at that D's
fan-outs: mean over its sequence-rounds of p_hit(F). The paper's law (m = 1) is fitted the same
way beside it.

The engines run with `ssd_reproducible` (trees always reach depth K, fixed budget and fan-out) and
the neural backup, so which outcomes are in the tree depends on the models, the prompts and the
seeds, never on how many cores the workers share: a 2-core machine measures the hit rate of D = 4
as it would be with a core per worker (not its speed). At temperature 0 every D sees the same
outcomes (the drafts are the draft model's greedy path whatever the tree), so the comparison is
paired; at temperature 1 each D samples its own.

"In the tree" is the miss law's event (the pool's `covered`): counted over the rounds that had a
tree, a request's first round included. It differs from `cache_hit_rate`, which counts every row
the engine verified (a request's first speculation is drafted just in time and counts as a miss).

This module imports neither Ray nor, at import time, torch or transformers.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

TOLERANCE = 0.03  # the goal: observed in-tree rate within this of the law's prediction


@dataclass(frozen=True)
class MissLawPlan:
    target: str | None = None  # default: the bundled demo pair
    draft: str | None = None
    workers: tuple[int, ...] = (1, 2, 4)
    temperatures: tuple[float, ...] = (0.0, 1.0)
    budget: int = 16  # ssd_budget: branches per worker and row
    k: int = 6
    num_prompts: int = 32
    batch: int = 8  # requests decoded together
    max_tokens: int = 128
    draft_dtype: str = "bfloat16"
    seed: int = 0


@dataclass
class DRun:
    temperature: float
    workers: int
    fanout: list[int]  # the round's fan-out over outcomes 0..K (fixed: ssd_reproducible)
    counts: dict[int, dict[int, list[int]]]  # outcome j -> {F there -> [sequence-rounds, in the tree]}
    ranks: dict[int, dict[int, int]]  # outcome j -> {bonus token's rank (RANK_DEPTH: or beyond) -> sequence-rounds}
    cache_hit_rate: float
    tokens_per_round: float
    seconds: float
    rounds: int = 0  # sequence-rounds with a tree
    observed: float = 0.0  # in-tree rate
    # In-tree rate predicted from the smallest D's run, by: the law fitted on its ranks (the
    # engine's own fit); the same law, one per outcome j; the paper's law (m = 1) fitted on its
    # ranks; the law fitted on its hits and misses only (no ranks); its ranks' empirical law.
    predicted: dict[str, float] = field(default_factory=dict)


PREDICTORS = ("law", "law per outcome", "paper's law", "hits only", "empirical")


def run_engine(
    plan: MissLawPlan, target: str, draft: str, temperature: float, workers: int, prompts: list[str]
) -> DRun:
    from ssd.core.sampling_params import SamplingParams
    from ssd.llm import LLM

    params = [
        SamplingParams(temperature=temperature, max_tokens=plan.max_tokens, ignore_eos=True, seed=plan.seed + i)
        for i in range(len(prompts))
    ]
    started = time.perf_counter()
    with LLM(
        target,
        draft,
        mode="ssd",
        k=plan.k,
        ssd_budget=plan.budget,
        ssd_backup="neural",
        ssd_reproducible=True,
        draft_workers=workers,
        max_num_seqs=plan.batch,
        num_threads=1,
        draft_num_threads=1,
        draft_dtype=plan.draft_dtype,
        seed=plan.seed,
    ) as llm:
        llm.generate(prompts, params)
        metrics = llm.metrics()
    ssd = metrics["ssd"]
    counts = {int(j): {int(f): list(n) for f, n in c.items()} for j, c in ssd["miss_law_counts"].items()}
    ranks = {int(j): {int(x): n for x, n in c.items()} for j, c in ssd["miss_law_ranks"].items()}
    return DRun(
        temperature,
        workers,
        list(ssd["fanout"]),
        counts,
        ranks,
        float(metrics.get("cache_hit_rate") or 0.0),
        float(metrics.get("tokens_per_round") or 0.0),
        round(time.perf_counter() - started, 1),
    )


def _tensors(rows: list[tuple[float, float, float]]):
    import torch

    lo, hi, weight = zip(*rows) if rows else ((), (), ())
    return (
        torch.tensor(lo, dtype=torch.float64),
        torch.tensor(hi, dtype=torch.float64),
        torch.tensor(weight, dtype=torch.float64),
    )


def fit_ranks(ranks: dict[int, dict[int, int]], cap: int, intercept: bool = True) -> tuple[float, float]:
    """(m, r) of the miss law from outcome j -> {rank -> sequence-rounds} (fit_miss_law), ranks
    censored at `cap`: the law is fitted over the fan-outs 1..cap it is asked about, and for those
    a rank of cap or more is a miss like any other."""
    from ssd.drafting.saguaro import fit_miss_law, rank_interval

    rows = [(*rank_interval(x, cap), n) for c in ranks.values() for x, n in c.items()]
    return fit_miss_law(*_tensors(rows), intercept=intercept)


def fit_hits(counts: dict[int, dict[int, list[int]]]) -> tuple[float, float]:
    """(m, r) from hits and misses alone: outcome j -> {F -> [sequence-rounds, in the tree]}."""
    from ssd.drafting.saguaro import fit_miss_law, hit_interval

    rows = [
        (*hit_interval(f, hit), w)
        for c in counts.values()
        for f, (n, t) in c.items()
        for hit, w in ((True, t), (False, n - t))
    ]
    return fit_miss_law(*_tensors(rows))


def predicted_rate(counts: dict[int, dict[int, list[int]]], p_hit) -> float:
    """Mean over the sequence-rounds of p_hit(j, F): p_hit is a function of outcome and fan-out."""
    total = sum(n for c in counts.values() for n, _ in c.values())
    return sum(n * p_hit(j, f) for j, c in counts.items() for f, (n, _) in c.items()) / max(total, 1)


def _law(m: float, r: float):
    import torch

    from ssd.drafting.saguaro import miss_law_hit_rate

    return lambda j, f: float(miss_law_hit_rate(torch.tensor([f]), m, r)[0])


def predictors(base: DRun, cap: int) -> dict[str, object]:
    """What each predictor of PREDICTORS makes of the base run (ranks censored at cap): p_hit(j, F)."""
    per_outcome = {j: fit_ranks({j: c}, cap) for j, c in base.ranks.items()}
    pooled = fit_ranks(base.ranks, cap)

    def empirical(j: int, f: int) -> float:
        c = base.ranks.get(j) or {x: n for row in base.ranks.values() for x, n in row.items()}
        return sum(n for x, n in c.items() if x < f) / max(sum(c.values()), 1)

    return {
        "law": _law(*pooled),
        "law per outcome": lambda j, f: _law(*per_outcome.get(j, pooled))(j, f),
        "paper's law": _law(*fit_ranks(base.ranks, cap, intercept=False)),
        "hits only": _law(*fit_hits(base.counts)),
        "empirical": empirical,
    }


def widest(run: DRun) -> int:
    """The widest fan-out the run had at a real outcome."""
    return max((f for c in run.counts.values() for f in c), default=1)


def analyse(runs: list[DRun]) -> dict[float, dict]:
    """Per temperature: each run's observed in-tree rate and its predictions from the smallest
    D's run (filled in), and the fits: the law is fitted on the base run's ranks censored at the
    predicted run's widest fan-out (the range it is asked about; the demo pair's 258-token
    vocabulary bends the rank distribution's tail below a power law, so a fit that also chased
    ranks no tree reaches would be worse where trees do reach)."""
    out = {}
    for t in dict.fromkeys(r.temperature for r in runs):
        at_t = [r for r in runs if r.temperature == t]
        base = min(at_t, key=lambda r: r.workers)
        fits = {}
        for r in at_t:
            r.rounds = sum(n for c in r.counts.values() for n, _ in c.values())
            r.observed = sum(h for c in r.counts.values() for _, h in c.values()) / max(r.rounds, 1)
            cap = widest(r)
            r.predicted = {name: predicted_rate(r.counts, law) for name, law in predictors(base, cap).items()}
            fits[r.workers] = {
                "rank_cap": cap,
                "law": fit_ranks(base.ranks, cap),
                "paper_r": fit_ranks(base.ranks, cap, intercept=False)[1],
            }
        out[t] = {
            "fitted_at_workers": base.workers,
            "hits_only": fit_hits(base.counts),
            "by_workers": fits,
            "within_tolerance": all(abs(r.observed - r.predicted["law"]) <= TOLERANCE for r in at_t),
        }
    return out


def format_report(runs: list[DRun], fits: dict[float, dict]) -> str:
    lines = []
    for t, fit in fits.items():
        m_h, r_h = fit["hits_only"]
        lines.append(
            f"T={t:g}: predictions from the run with D={fit['fitted_at_workers']}; the law 1 - p_hit(F) = m F^-r "
            f"fitted on its ranks censored at the predicted run's widest fan-out (on its hits only: "
            f"{m_h:.2f} F^-{r_h:.3f})"
        )
        head = [
            "D",
            "fan-out",
            "seq-rounds",
            "in tree",
            "m",
            "r",
            *PREDICTORS,
            "law - in tree",
            "cache hit rate",
            "tokens/round",
            "s",
        ]
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "---|" * len(head))
        for r in (r for r in runs if r.temperature == t):
            m, r_ = fit["by_workers"][r.workers]["law"]
            cells = [
                str(r.workers),
                str(r.fanout),
                str(r.rounds),
                f"{r.observed:.3f}",
                f"{m:.2f}",
                f"{r_:.3f}",
                *(f"{r.predicted[name]:.3f}" for name in PREDICTORS),
                f"{r.predicted['law'] - r.observed:+.3f}",
                f"{r.cache_hit_rate:.3f}",
                f"{r.tokens_per_round:.2f}",
                f"{r.seconds:.0f}",
            ]
            lines.append("| " + " | ".join(cells) + " |")
        verdict = "within" if fit["within_tolerance"] else "NOT within"
        lines.append(f"in-tree rate {verdict} {TOLERANCE} of the law's prediction at every D\n")
    return "\n".join(lines)


def measure(plan: MissLawPlan, progress=None) -> list[DRun]:
    from ssd.bench.plan import demo_pair
    from ssd.model.demo_models import heldout_prompts

    target, draft = (plan.target, plan.draft) if plan.target is not None else demo_pair()
    if draft is None:
        raise ValueError("--target was given without --draft: SSD needs a draft model")
    prompts = heldout_prompts(plan.num_prompts)
    runs = []
    for t in plan.temperatures:
        for d in plan.workers:
            runs.append(run_engine(plan, target, draft, t, d, prompts))
            if progress is not None:
                progress(runs[-1])
    return runs


def load_runs(path: str) -> tuple[dict, list[DRun]]:
    """The plan and runs of a JSON file this command wrote (its own fits are recomputed)."""
    doc = json.loads(Path(path).read_text())
    runs = []
    for r in doc["runs"]:
        counts = {int(j): {int(f): list(n) for f, n in c.items()} for j, c in r["counts"].items()}
        ranks = {int(j): {int(x): n for x, n in c.items()} for j, c in r["ranks"].items()}
        runs.append(
            DRun(
                r["temperature"],
                r["workers"],
                r["fanout"],
                counts,
                ranks,
                r["cache_hit_rate"],
                r["tokens_per_round"],
                r["seconds"],
            )
        )
    return doc["plan"], runs


def parse_plan(argv: list[str] | None = None) -> tuple[MissLawPlan, str | None, str | None]:
    from benchmarks.payload import csv_of

    p = argparse.ArgumentParser(prog="python -m benchmarks.miss_law", description=__doc__.split("\n\n")[0])
    d = MissLawPlan()
    p.add_argument("--target", default=None, help="target model directory (default: the bundled demo target)")
    p.add_argument("--draft", default=None, help="draft model directory (with --target)")
    p.add_argument(
        "--workers", type=csv_of(int), default=d.workers, help="D values, comma-separated; the smallest is fitted"
    )
    p.add_argument("--temperatures", type=csv_of(float), default=d.temperatures, help="comma-separated")
    p.add_argument("--budget", type=int, default=d.budget, help="ssd_budget: branches per worker and row")
    p.add_argument("--k", type=int, default=d.k, help="speculation length K")
    p.add_argument("--num-prompts", type=int, default=d.num_prompts, help="held-out prompts (requests) per run")
    p.add_argument("--batch", type=int, default=d.batch, help="requests decoded together (max_num_seqs)")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="tokens generated per request")
    p.add_argument("--draft-dtype", default=d.draft_dtype, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--out", default=None, help="write the runs and fits as JSON here")
    p.add_argument(
        "--report",
        default=None,
        metavar="JSON",
        help="run nothing: print the report of the runs in this file (written by --out)",
    )
    args = p.parse_args(argv)
    if len(args.workers) < 2 or min(args.workers) < 1:
        p.error(
            f"--workers {args.workers}: give at least two D values >= 1 (the smallest is fitted, the others predicted)"
        )
    if any(t < 0 for t in args.temperatures):
        p.error(f"--temperatures {args.temperatures}: temperatures must be >= 0")
    if args.draft is not None and args.target is None:
        p.error("--draft was given without --target: pass both, or neither for the demo pair")
    out, report = args.out, args.report
    fields = {name: value for name, value in vars(args).items() if name not in ("out", "report")}
    fields["workers"] = tuple(sorted(set(fields["workers"])))
    return MissLawPlan(**fields), out, report


def main(argv: list[str] | None = None) -> int:
    plan, out, report = parse_plan(argv)
    if report is not None:
        saved, runs = load_runs(report)
        plan = MissLawPlan(
            **{**saved, "workers": tuple(saved["workers"]), "temperatures": tuple(saved["temperatures"])}
        )
    else:
        runs = measure(
            plan,
            progress=lambda r: _say(sys.stderr, f"T={r.temperature:g} D={r.workers}: {r.seconds:.0f} s"),
        )
    fits = analyse(runs)
    _say(
        sys.stdout,
        f"K {plan.k}, B {plan.budget} branches per worker, {plan.num_prompts} prompts x {plan.max_tokens} tokens, "
        f"batch {plan.batch}, seed {plan.seed}, ssd_reproducible, neural backup",
    )
    _say(sys.stdout, format_report(runs, fits))
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        doc = {
            "plan": asdict(plan),
            "tolerance": TOLERANCE,
            "fits": {str(t): f for t, f in fits.items()},
            "runs": [asdict(r) for r in runs],
        }
        Path(out).write_text(json.dumps(doc, indent=2) + "\n")
    return 0 if all(f["within_tolerance"] for f in fits.values()) else 1


def _say(stream, text: str) -> None:
    stream.write(text + "\n")
    stream.flush()


if __name__ == "__main__":
    sys.exit(main())
