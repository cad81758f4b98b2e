"""Decoding speed at a real vocabulary size (`python -m benchmarks.vocab_speed`): what the host
path costs per round when every [K, V] distribution is 128256 entries wide.

The random pair of `benchmarks.payload` (a 4-layer x 64 Llama target and a draft of its first
layer, sharing embeddings and head) at --vocab, so that the rounds' vocabulary-sized work
(distributions, draws, what the draft pool carries and keeps, verification) is most of what is
measured, not the models. For each mode (engine defaults, one thread each, SSD's worker on its
own), temperature and batch size: one untimed generate, then --repeats timed ones of --max-tokens
per request from random prompt ids; tokens/s is the median. Writes --out as JSON.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.payload import MIN_VOCAB, build_pair
from ssd.bench.report import write_json

logger = logging.getLogger(__name__)


def measure(target: str, draft: str, args) -> list[dict]:
    import torch

    from ssd.core.sampling_params import SamplingParams
    from ssd.llm import LLM

    rows = []
    for mode in args.modes:
        with LLM(target, draft, mode=mode, k=args.k, num_threads=1, max_num_seqs=max(args.batch_sizes)) as llm:
            for temperature in args.temperatures:
                for batch in args.batch_sizes:
                    gen = torch.Generator().manual_seed(batch)
                    prompts = [
                        torch.randint(MIN_VOCAB, args.vocab, (16,), generator=gen).tolist() for _ in range(batch)
                    ]
                    params = SamplingParams(
                        temperature=temperature, max_tokens=args.max_tokens, ignore_eos=True, seed=1
                    )
                    llm.generate(prompts, params)  # warm-up: first shapes, the workers' first rounds
                    speeds = []
                    for _ in range(args.repeats):
                        started = time.perf_counter()
                        outputs = llm.generate(prompts, params)
                        speeds.append(sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - started))
                    row = {
                        "mode": mode,
                        "temperature": temperature,
                        "batch": batch,
                        "tokens_per_s": statistics.median(speeds),
                    }
                    rows.append({**row, "runs": [round(s, 1) for s in speeds]})
                    logger.info(
                        "%s T=%g b=%d: %.1f tokens/s (%s)",
                        mode,
                        temperature,
                        batch,
                        row["tokens_per_s"],
                        rows[-1]["runs"],
                    )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--modes", nargs="+", default=["sd", "ssd"])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--k", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="bench_results/vocab_speed.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with tempfile.TemporaryDirectory() as root:
        target, draft = build_pair(Path(root), args.vocab)
        rows = measure(target, draft, args)
    write_json(args.out, rows)


if __name__ == "__main__":
    main()
