"""Speculation under what real clients send: acceptance, tokens per round and ssd/sd with a JSON
schema, with penalties and with neither, at temperature 0 and 1.

    python -m benchmarks.constrained [--requests 8] [--max-tokens 96] [--out bench_results/constrained.json]

The demo pair (or --target/--draft), K = 4, every request of a batch alike; ssd runs its drafter
in-process with a fixed budget (`--ssd-budget`), so the figures compare the speculations, not
this machine's core count. Output ends at EOS (a schema's text is complete then), so the
throughput is the batch's output tokens over its wall time. Prints one line per row and writes
the rows as JSON.
"""

from __future__ import annotations

import argparse
import logging
import time

from ssd.bench.report import add_pair_arguments, write_json
from ssd.core.sampling_params import SamplingParams
from ssd.llm import LLM
from ssd.processing.structured import StructuredOutputs

logger = logging.getLogger(__name__)

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"enum": [1, 2, 3]},
        "name": {"type": "string", "maxLength": 12},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["id", "name", "tags", "ok"],
    "additionalProperties": False,
}
FIELDS = {
    "none": {},
    "json_schema": {"structured_outputs": StructuredOutputs(json=SCHEMA)},
    "penalties": {"frequency_penalty": 0.5, "presence_penalty": 0.5, "repetition_penalty": 1.1},
}
PROMPTS = {"none": "def add(a, b):\n", "json_schema": "Answer:", "penalties": "def add(a, b):\n"}


def run_rows(llm: LLM, mode: str, requests: int, max_tokens: int) -> list[dict]:
    rows = []
    for fields, extra in FIELDS.items():
        for temperature in (0.0, 1.0):
            params = [
                SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=i, **extra) for i in range(requests)
            ]
            llm.generate(PROMPTS[fields], params[:1])  # warm: compiles the grammar, fills caches
            started = time.perf_counter()
            outs = llm.generate([PROMPTS[fields]] * requests, params)
            seconds = time.perf_counter() - started
            drafted = sum(o.metrics["draft_tokens"] for o in outs)
            rows.append(
                {
                    "mode": mode,
                    "fields": fields,
                    "temperature": temperature,
                    "tokens_per_s": sum(len(o.token_ids) for o in outs) / seconds,
                    "tokens_per_round": sum(o.metrics["tokens_per_round"] for o in outs) / requests,
                    "acceptance": sum(o.metrics["accepted_tokens"] for o in outs) / max(drafted, 1),
                    "cache_hit_rate": sum(o.metrics.get("cache_hit_rate", 0.0) for o in outs) / requests,
                }
            )
            logger.info("%s", {k: round(v, 3) if isinstance(v, float) else v for k, v in rows[-1].items()})
    return rows


def ratios(rows: list[dict]) -> list[dict]:
    """ssd/sd throughput per (fields, temperature)."""
    by = {(r["mode"], r["fields"], r["temperature"]): r["tokens_per_s"] for r in rows}
    return [
        {"fields": f, "temperature": t, "ssd_over_sd": by[("ssd", f, t)] / by[("sd", f, t)]}
        for (mode, f, t) in by
        if mode == "ssd"
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_pair_arguments(parser)
    parser.add_argument("--requests", type=int, default=8, help="Requests per batch.")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--ssd-budget", type=int, default=12)
    parser.add_argument("--out", default="bench_results/constrained.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    pair = (args.target, args.draft) if args.target else ()
    engines = {
        "sd": dict(mode="sd", k=4),
        "ssd": dict(mode="ssd", k=4, draft_transport="inprocess", ssd_budget=args.ssd_budget, ssd_autobudget=False),
    }
    rows = []
    for mode, engine in engines.items():
        with LLM(*pair, max_num_seqs=args.requests, **engine) as llm:
            rows += run_rows(llm, mode, args.requests, args.max_tokens)
    for ratio in ratios(rows):
        logger.info("ssd/sd %-11s T=%.0f: %.2f", ratio["fields"], ratio["temperature"], ratio["ssd_over_sd"])
    write_json(args.out, {"rows": rows, "ratios": ratios(rows)})


if __name__ == "__main__":
    main()
