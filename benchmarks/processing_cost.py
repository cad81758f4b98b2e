"""What a request's penalties and bias cost per round on the host, beside what sampling costs anyway.

    python -m benchmarks.processing_cost [--vocab 258 128256] [--out bench_results/processing_cost.json]

Rows carry frequency and presence penalty 0.5, repetition penalty 1.1, a bias on 10 tokens and a
history of 200 prompt and 300 output tokens that grows by 3 tokens a round; K = 6; one thread.
Per vocabulary V and batch b (1, 8), what an SD round's processing costs the engine:
- `carry_ms`: Adjustments.committed, the round's first position carried over from the last
  round's verification (2 drafts accepted and a bonus token: what most rounds do,
  ssd/processing/round_adjustments.py);
- `build_ms`: adjustments.build for the first position instead, each row's tracked tokens
  kept between rounds (TrackedHistory: the round folds in its 3 new tokens): what a round does
  when the batch gained a row or the carried table grew too wide;
- `sd_draft_ms`: the SD draft's K positions in the draft's form on the host (draft_form once, then
  apply on [b, 1, V] and advanced per position);
- `verify_extend_ms`: Adjustments.speculated, the first position's adjustments extended with
  the K drafts for verification;
- `verify_apply_ms`: Adjustments.apply to the [b, K+1, V] verification logits;
- `round_ms`: carry, draft, extend and apply together, what a penalised SD round spends on
  processing;
- `sampling_ms`: process_logits on the same logits without any processing (the round's sampling
  cost with no processors, for scale);
- `tree_ms`: an SSD drafter's (ssd/drafting/tree_adjustments.py, on the draft side): the fork's
  processing of the [b, K+1, V] glue logits and the branches' (12 a row) over K depths.
Random logits: the cost does not depend on the values. Each apply adjusts in place where the
engine's does (in_place: draft steps, tree depths, a verification without raw logprobs), so the
logits drift from repeat to repeat; the glue's apply copies, as the drafter's does.
"""

from __future__ import annotations

import argparse
import logging
import time

import torch

from ssd.bench.report import write_json
from ssd.core.sampling import BatchSampling, SequenceSampling, process_logits
from ssd.drafting.tree_adjustments import ForkAdjustments
from ssd.processing.adjustments import Adjustments, build
from ssd.processing.draft_adjustments import draft_form
from ssd.processing.request import Processing
from ssd.processing.tracked import TrackedHistory

logger = logging.getLogger(__name__)

K = 6
BRANCHES = 12  # a row's branches in the tree (an SSD budget of 12)
PROCESSING = dict(frequency_penalty=0.5, presence_penalty=0.5, repetition_penalty=1.1)


def _ms(fn, repeats: int) -> float:
    """Median wall time of fn() in milliseconds, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def _rows(batch: int, vocab: int, gen: torch.Generator) -> list[tuple[SequenceSampling, list[int]]]:
    bias = {int(t): 1.0 for t in torch.randint(vocab, (10,), generator=gen)}
    processing = Processing(
        PROCESSING["repetition_penalty"], PROCESSING["frequency_penalty"], PROCESSING["presence_penalty"],
        logit_bias=bias, stop_token_ids=(0,),
    )  # fmt: skip
    sampling = SequenceSampling(1.0, 0, 1.0, output_from=200, processing=processing)
    return [(sampling, torch.randint(vocab, (500,), generator=gen).tolist()) for _ in range(batch)]


def measure(vocab: int, batch: int, repeats: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    rows = _rows(batch, vocab, gen)
    table = [(s.processing, t[: s.output_from], t[s.output_from :]) for s, t in rows]
    histories = [TrackedHistory() for _ in table]
    drafted = torch.randint(vocab, (batch, K), generator=gen)
    logits = torch.randn(batch, K + 1, vocab, generator=gen)
    plain = BatchSampling.of([s for s, _ in rows])
    none = drafted[:, :0]

    def built() -> Adjustments:  # a round later: each output 3 tokens longer
        for _, _, output in table:
            output.extend(torch.randint(vocab, (3,), generator=gen).tolist())
        return build(table, none, vocab, histories=histories)

    def sd_draft(first: Adjustments) -> None:  # as SDProposer.propose: in the draft's form
        step = draft_form(first, torch.device("cpu"))
        for i in range(K):
            step.apply(logits[:, i : i + 1], in_place=True)
            if i < K - 1:
                step = step.advanced(drafted[:, i])

    start = built()
    every = start.speculated(drafted)
    accepted, bonus = torch.full((batch,), 2), drafted[:, 3]
    cand = torch.randint(vocab, (batch, BRANCHES), generator=gen)
    outcome = torch.randint(K + 1, (batch, BRANCHES), generator=gen)
    branch_logits = torch.randn(batch * BRANCHES, 1, vocab, generator=gen)

    def tree() -> None:
        rnd = ForkAdjustments(rows, drafted, vocab)
        rnd.glue(logits, None)
        branches = rnd.tree(cand, outcome, plain)
        for _ in range(K):
            branches.adjust.apply(branch_logits, in_place=True)
            branches.advance(cand)

    out = {
        "vocab": vocab,
        "batch": batch,
        "carry_ms": _ms(lambda: every.committed(accepted, bonus), repeats),
        "build_ms": _ms(built, repeats),
        "sd_draft_ms": _ms(lambda: sd_draft(start), repeats),
        "verify_extend_ms": _ms(lambda: start.speculated(drafted), repeats),
        "verify_apply_ms": _ms(lambda: every.apply(logits, in_place=True), repeats),
    }
    out["round_ms"] = out["carry_ms"] + out["sd_draft_ms"] + out["verify_extend_ms"] + out["verify_apply_ms"]
    out["sampling_ms"] = _ms(lambda: process_logits(logits, plain), repeats)
    out["tree_ms"] = _ms(tree, max(3, repeats // 4))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[258, 128256], help="vocabulary sizes")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="batch sizes")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per figure (the median is kept)")
    parser.add_argument("--out", default="bench_results/processing_cost.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)
    rows = [measure(v, b, args.repeats) for v in args.vocab for b in args.batch]
    for row in rows:
        logger.info("%s", {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})
    write_json(args.out, rows)


if __name__ == "__main__":
    main()
