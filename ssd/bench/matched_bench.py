"""The acceptance-matched pair (matched_pair.py) through the engine
(`python -m ssd.bench.matched_bench`).

Builds the pair at the given shapes (default Llama-3.1-8B / Llama-3.2-1B, bfloat16 on a GPU;
`--target-shape small-target --draft-shape small-draft` runs on a CPU in minutes) and reports:
- the draft's greedy acceptance along the target's greedy path (teacher forcing, as `ssd bench`'s
  pair stats), by position in a round of K: the rate at each position among rounds that reached
  it, and the share of rounds accepting more than that many;
- for every mode and temperature at batch 1 (one prompt after another): tokens/s (wall, and of the
  engine's steps alone), acceptance, tokens per round, draft and verify ms per round, SSD's hit
  rate;
- the projection for the draft on its own device (projection.py) at each temperature with sd and
  ssd, labelled as a projection, with its inputs.
The target is handed to the engine in memory and the draft saved for SSD's workers, as
real_shapes.py does. Writes --out as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from ssd.bench.matched_pair import (
    DEFAULT_SCALE,
    PairSpec,
    build_matched_pair,
    perturbation_rms,
    shared_map,
    successor_path,
)
from ssd.bench.projection import format_projection, project
from ssd.bench.real_shapes import SHAPES, save_for_engine
from ssd.core.threads import set_process_threads

SMALL_SHAPES = {  # CPU-sized, the draft's hidden size still the default rank: the acceptance of the real shapes
    "small-target": dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2),
    "small-draft": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2),
}  # fmt: skip
ALL_SHAPES = {**SHAPES, **SMALL_SHAPES}


def acceptance_by_position(matches: list[list[bool]], n: int, k: int) -> dict:
    """Greedy SD rounds of K along each path of draft-equals-target flags (n tokens each) ->
    the rate at each position among rounds reaching it, the share of rounds accepting more than i
    at position i, and tokens per round."""
    offered, accepted, rounds = [0] * k, [0] * k, 0
    for row in matches:
        p = 0
        while p < n:
            m = 0
            while m < k and row[p + m]:
                offered[m], accepted[m], m = offered[m] + 1, accepted[m] + 1, m + 1
            if m < k:
                offered[m] += 1
            rounds, p = rounds + 1, p + m + 1
    return {
        "rate_at_position": [round(a / o, 4) if o else None for a, o in zip(accepted, offered)],
        "share_of_rounds_beyond": [round(a / rounds, 4) for a in accepted],
        "tokens_per_round": round(n * len(matches) / rounds, 4),
        "positions": n * len(matches),
    }


def greedy_positions(target, draft, prompts: list[list[int]], n: int, k: int) -> dict:
    from ssd.bench.pair_stats import _greedy_matches

    matches = [_greedy_matches(target, draft, ids, n + k, target.device) for ids in prompts]
    flat = [m for row in matches for m in row[:n]]
    return {"acceptance": round(sum(flat) / len(flat), 4), **acceptance_by_position(matches, n, k)}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_mode(engine, prompts: list[list[int]], tokens: int, temperature: float, device: str) -> dict:
    """The prompts one after another (batch 1) after a warm-up request (it captures the graphs)
    -> the record of the timed requests, in `ssd bench`'s field names."""
    from ssd.core.sampling_params import SamplingParams

    def finish(batch: list[list[int]], max_tokens: int) -> None:
        ids = {engine.add_request(p, SamplingParams(temperature=temperature, max_tokens=max_tokens,
                                                    ignore_eos=True, seed=i)) for i, p in enumerate(batch)}  # fmt: skip
        while ids:
            ids -= {o.request_id for o in engine.step() if o.finished}

    finish(prompts[:1], min(tokens, 32))
    before = engine.engine_metrics()
    _sync(device)
    started = time.perf_counter()
    finish(prompts, tokens)
    _sync(device)
    wall = time.perf_counter() - started
    return _record(before, engine.engine_metrics(), wall)


def _record(before: dict, after: dict, wall: float) -> dict:
    grew = lambda key: after.get(key, 0) - before.get(key, 0)  # noqa: E731
    rounds, generated = grew("rounds"), grew("generated_tokens")
    per_round = lambda key: (after[key] * after["rounds"] - before[key] * before["rounds"]) / max(rounds, 1)  # noqa: E731
    ssd_rounds = grew("cache_hits") + grew("backup_neural_rounds") + grew("backup_fast_rounds")
    gauges, earlier = after.get("ssd", {}), before["rounds_by_mode"]
    return {
        "batch_size": 1,
        "supported": True,
        "tokens_per_s": round(generated / wall, 3),
        "decode_tokens_per_s": round(generated / grew("step_seconds_total"), 3),
        "acceptance_rate": round(grew("accepted_tokens") / grew("draft_tokens"), 4) if grew("draft_tokens") else None,
        "tokens_per_round": round(generated / max(rounds, 1), 4),
        "draft_ms_per_round": round(per_round("draft_ms_per_round"), 4),
        "verify_ms_per_round": round(per_round("verify_ms_per_round"), 4),
        "cache_hit_rate": round(grew("cache_hits") / ssd_rounds, 4) if ssd_rounds else None,
        "target_exchange_ms": gauges.get("target_exchange_ms"),
        "counters": {"hit_steps": grew("hit_steps"), "hit_step_tokens": grew("hit_step_tokens")},
        "rounds_by_mode": {m: n - earlier.get(m, 0) for m, n in after["rounds_by_mode"].items()},
        "ssd": gauges,
    }


def measure_modes(args, root: Path, target, draft, prompts: list[list[int]]) -> list[dict]:
    """Every mode at every temperature, one engine per mode."""
    from ssd.core.config import EngineArgs
    from ssd.engine.factory import engines_over
    from ssd.model.demo_models import build_tokenizer
    from ssd.model.loader import LoadedPair

    rows = []
    for mode in args.modes.split(","):
        config = EngineArgs(
            target=str(root / "target"), draft=str(root / "draft"), mode=mode, k=args.k, dtype=args.dtype,
            device=args.device, max_num_seqs=1, ssd_autobudget=False, enforce_eager=args.enforce_eager,
            num_threads=args.threads,
        ).to_config()  # fmt: skip
        in_process_draft = draft if mode in ("sd", "auto") else None
        pair = LoadedPair(target, in_process_draft, build_tokenizer(), args.positions)
        engine = engines_over(pair, {mode: config})[mode]
        try:
            for temperature in args.temperatures:
                row = {"mode": mode, "temperature": temperature, "setting": args.device}
                row.update(run_mode(engine, prompts, args.tokens, temperature, args.device))
                rows.append(row)
                sys.stdout.write(format_row(row) + "\n")
        finally:
            engine.close()
    return rows


def format_row(r: dict) -> str:
    def fmt(key: str, spec: str = ".2f") -> str:
        return "-" if r.get(key) is None else format(r[key], spec)

    return (
        f"T={r['temperature']:g} {r['mode']}: {r['tokens_per_s']:.1f} tok/s (steps alone "
        f"{r['decode_tokens_per_s']:.1f}); acceptance {fmt('acceptance_rate')}, {fmt('tokens_per_round')} "
        f"tokens/round, draft {fmt('draft_ms_per_round')} ms/round, verify {fmt('verify_ms_per_round')} ms/round, "
        f"hit {fmt('cache_hit_rate')}"
    )


def projections(rows: list[dict], k: int) -> list[dict]:
    out = []
    for temperature in dict.fromkeys(r["temperature"] for r in rows):
        by_mode = {r["mode"]: r for r in rows if r["temperature"] == temperature}
        row = project(by_mode["sd"], by_mode["ssd"], k) if {"sd", "ssd"} <= set(by_mode) else None
        if row is not None:
            out.append({"temperature": temperature, **row})
    return out


def run(args) -> dict:
    from ssd.model.demo_models import build_tokenizer, heldout_prompts

    dtype = getattr(torch, args.dtype)
    spec = PairSpec(scale=args.scale, rank=args.rank, logit_scale=args.logit_scale, seed=args.seed)
    started = time.perf_counter()
    target, draft = build_matched_pair(ALL_SHAPES[args.target_shape], ALL_SHAPES[args.draft_shape], spec,
                                       args.vocab_size, args.device, dtype, args.positions)  # fmt: skip
    _, previous = shared_map(args.vocab_size, 1, spec.seed)  # the first successor map alone (any rank gives it)
    probe = successor_path(previous[0], torch.tensor([1, 2]), 64)
    tokenizer = build_tokenizer()
    prompts = [tokenizer(p, add_special_tokens=False).input_ids for p in heldout_prompts(args.num_prompts)]
    out = {"args": vars(args), "build_s": round(time.perf_counter() - started, 1),
           "perturbation_rms": {"target": round(perturbation_rms(target, probe), 3),
                                "draft": round(perturbation_rms(draft, probe), 3)},
           "greedy": greedy_positions(target, draft, prompts, args.tokens, args.k)}  # fmt: skip
    sys.stdout.write(format_header(args, out) + "\n")
    with tempfile.TemporaryDirectory(prefix="ssd-matched-pair-") as root:
        save_for_engine(Path(root), target, draft)
        out["runs"] = measure_modes(args, Path(root), target, draft, prompts)
    out["projection"] = projections(out["runs"], args.k)
    if out["projection"]:
        sys.stdout.write("projection, not a measurement (ssd/bench/projection.py, Theorem 7; batch 1):\n")
        for row in out["projection"]:
            sys.stdout.write(format_projection(row, f"T={row['temperature']:g} ssd") + "\n")
    return out


def format_header(args, out: dict) -> str:
    g = out["greedy"]
    rates = " ".join("-" if r is None else f"{r:.2f}" for r in g["rate_at_position"])
    shares = " ".join(f"{s:.2f}" for s in g["share_of_rounds_beyond"])
    return (
        f"matched pair {args.target_shape} / {args.draft_shape}, vocabulary {args.vocab_size}, scale {args.scale:g} "
        f"(perturbation RMS: target {out['perturbation_rms']['target']:.2f}, draft "
        f"{out['perturbation_rms']['draft']:.2f}), built in {out['build_s']:.0f} s\n"
        f"greedy acceptance along the target's path: {g['acceptance']:.3f} over {g['positions']} positions; "
        f"K={args.k}, {g['tokens_per_round']:.2f} tokens/round\n"
        f"  by position, among rounds reaching it: {rates}\n"
        f"  share of rounds accepting more than i:  {shares}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ssd.bench.matched_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--target-shape", default="llama-3.1-8b", choices=sorted(ALL_SHAPES))
    parser.add_argument("--draft-shape", default="llama-3.2-1b", choices=sorted(ALL_SHAPES))
    parser.add_argument("--vocab-size", type=int, default=128256)
    parser.add_argument("--scale", type=float, default=DEFAULT_SCALE, help="Layers' perturbation (matched_pair.py).")
    parser.add_argument("--rank", type=int, default=PairSpec.rank)
    parser.add_argument("--logit-scale", type=float, default=PairSpec.logit_scale)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modes", default="ar,sd,ssd,auto", help="Comma-separated engine modes.")
    parser.add_argument("--temperatures", default="0,1", help="Comma-separated.")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="Default: bfloat16 on a GPU, float32 on a CPU.")
    parser.add_argument("--k", type=int, default=6)
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128, help="Tokens decoded per prompt.")
    parser.add_argument("--enforce-eager", action="store_true", help="Run without CUDA graphs.")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: 1 on a CPU).")
    parser.add_argument("--out", default="bench_results/matched_pair.json")
    args = parser.parse_args(argv)
    args.temperatures = [float(t) for t in args.temperatures.split(",")]
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    if args.threads is None and args.device == "cpu":
        args.threads = 1  # tiny forwards: more threads only wait on each other, and on SSD's worker
    set_process_threads(args.threads)
    args.positions = 4 * (128 + args.tokens + args.k + 8)  # held-out prompts are 128 bytes
    out = run(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
