"""Payload at real vocabulary sizes: what the draft pool's data plane carries per round, and what
a draft worker keeps (`python -m benchmarks.payload`).

A random tiny pair of the given vocabulary (default 128256, Llama 3's) is built in a temporary
directory: a Llama target and a draft made of its first layer (same embeddings and head, so the
two agree often, as a trained pair would). For every transport x sampling x batch size, one
engine (`LLM(mode="ssd")`, its own worker processes) generates from random prompt token ids,
and the figures come from `llm.metrics()["ssd"]`, i.e. from counters, not formulas:
- bytes per row and round each way: the frames the pool sent to and received from its workers
  (`wire_bytes_sent` / `wire_bytes_received`, ssd/transport/wire.py `WireCounts`), round
  messages only, over the rows the rounds verified; one-off messages (ADMIT, JOIN, READY,
  RELEASE) apart;
- the branch probabilities a worker kept in its largest round (`drafter_branch_probs_bytes`),
  beside what dense rows would take, b x N x K x V x 4 bytes (float32; greedy and top-k rows are
  kept sparse: S values and token ids per distribution), and the worker's peak RSS.
Every row of every round carries a speculation from the worker (`ssd_backup="neural"`: a miss
is drafted just in time by the worker, not by the target's n-gram backup), and trees are built
to depth K (`ssd_reproducible`), so the figures do not depend on timing.

This module imports neither Ray nor, at import time, torch or transformers.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

# Round messages each way (MsgType names); everything else is sent once per sequence or session.
ROUND_TO_WORKERS = ("BEGIN_ROUND", "PREDICT", "RESOLVE", "NEURAL_BACKUP")
ROUND_FROM_WORKERS = ("REPLY", "NEURAL_BACKUP_REPLY")
MB = 1_000_000  # decimal, as the README quotes sizes
# Prompt ids are drawn from [MIN_VOCAB, vocab): above the demo tokenizer's 258 ids (bytes, EOS,
# PAD), so no prompt holds a special token.
MIN_VOCAB = 300


@dataclass(frozen=True)
class Sampling:
    name: str
    temperature: float
    top_k: bool = False  # filter with the plan's top_k (the reply then carries the support only)


SAMPLINGS = {"greedy": Sampling("greedy", 0.0), "top-k": Sampling("top-k", 1.0, True), "dense": Sampling("dense", 1.0)}


@dataclass(frozen=True)
class PayloadPlan:
    vocab: int = 128256
    transports: tuple[str, ...] = ("shm", "torch", "grpc")
    samplings: tuple[str, ...] = ("greedy", "top-k", "dense")
    batch_sizes: tuple[int, ...] = (1, 4)
    k: int = 6
    budget: int = 16  # branches per worker and row (N)
    top_k: int = 50
    draft_workers: int = 1
    max_tokens: int = 32
    prompt_tokens: int = 16
    seed: int = 0


@dataclass
class PayloadResult:
    transport: str
    sampling: str
    batch: int
    row_rounds: int  # rows verified, summed over rounds
    to_workers_per_row: float  # round-message bytes per row and round, target -> workers
    from_workers_per_row: float  # workers -> target
    dense_row_bytes: int  # K x V x 4: one row's distributions sent dense
    once_bytes: int  # ADMIT, JOIN, READY, RELEASE: per sequence or session, not per round
    branch_probs_bytes: int  # measured: the largest round's branch probabilities in one worker
    branch_probs_dense: int  # b x N x K x V x 4: the same branches kept dense
    worker_peak_rss_bytes: int
    hit_rate: float
    seconds: float  # the case's wall time: engine and worker start, generation, close
    sent_by_type: dict[str, int] = field(default_factory=dict)
    received_by_type: dict[str, int] = field(default_factory=dict)


def build_pair(root: Path, vocab: int, seed: int = 0) -> tuple[str, str]:
    """A random Llama target (4 layers x 64) and a draft of its first layer, with the demo
    tokenizer (prompts are token ids; ids past its 258 tokens decode to nothing, which the
    measurement does not need); -> (target dir, draft dir)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from ssd.model.demo_models import EOS_ID, PAD_ID, build_tokenizer

    if vocab <= MIN_VOCAB:
        raise ValueError(f"vocab={vocab}: choose a vocabulary above {MIN_VOCAB} (prompt ids are drawn above it)")
    torch.manual_seed(seed)
    shape = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=EOS_ID,
        bos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    target = AutoModelForCausalLM.from_config(LlamaConfig(num_hidden_layers=4, **shape))
    draft = AutoModelForCausalLM.from_config(LlamaConfig(num_hidden_layers=1, **shape))
    draft.load_state_dict(
        target.state_dict(), strict=False
    )  # layer 0, norm, embeddings; the rest is the target's alone
    paths = []
    for name, model in (("target", target), ("draft", draft)):
        model.save_pretrained(root / name)
        build_tokenizer().save_pretrained(root / name)
        paths.append(str(root / name))
    return paths[0], paths[1]


def run_case(
    target: str, draft: str, plan: PayloadPlan, transport: str, sampling: Sampling, batch: int
) -> PayloadResult:
    """One engine, one generate() of `batch` requests, its counters."""
    import torch

    from ssd.core.sampling_params import SamplingParams
    from ssd.llm import LLM

    gen = torch.Generator().manual_seed(plan.seed)
    prompts = [
        torch.randint(MIN_VOCAB, plan.vocab, (plan.prompt_tokens,), generator=gen).tolist() for _ in range(batch)
    ]
    top_k = plan.top_k if sampling.top_k else 0
    params = [
        SamplingParams(
            temperature=sampling.temperature,
            top_k=top_k,
            max_tokens=plan.max_tokens,
            ignore_eos=True,
            seed=plan.seed + i,
        )
        for i in range(batch)
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
        draft_workers=plan.draft_workers,
        draft_transport=transport,
        max_num_seqs=batch,
        num_threads=1,
        draft_num_threads=1,
        seed=plan.seed,
    ) as llm:
        llm.generate(prompts, params)
        metrics = llm.metrics()
    seconds = time.perf_counter() - started
    ssd = metrics["ssd"]
    sent, received = ssd["wire_bytes_sent"], ssd["wire_bytes_received"]
    rows = max(metrics["rounds"], 1)
    per_round = sum(sent.get(t, 0) for t in ROUND_TO_WORKERS), sum(received.get(t, 0) for t in ROUND_FROM_WORKERS)
    return PayloadResult(
        transport=transport,
        sampling=sampling.name,
        batch=batch,
        row_rounds=metrics["rounds"],
        to_workers_per_row=per_round[0] / rows,
        from_workers_per_row=per_round[1] / rows,
        dense_row_bytes=plan.k * plan.vocab * 4,
        once_bytes=sum(sent.values()) + sum(received.values()) - sum(per_round),
        branch_probs_bytes=ssd["drafter_branch_probs_bytes"],
        branch_probs_dense=batch * plan.budget * plan.k * plan.vocab * 4,
        worker_peak_rss_bytes=ssd["drafter_peak_rss_bytes"],
        hit_rate=metrics.get("cache_hit_rate", 0.0),
        seconds=round(seconds, 2),
        sent_by_type=dict(sent),
        received_by_type=dict(received),
    )


def measure(plan: PayloadPlan, progress=None) -> list[PayloadResult]:
    """Every transport x sampling x batch size of the plan, on one pair built for it."""
    unknown = [s for s in plan.samplings if s not in SAMPLINGS]
    if unknown:
        raise ValueError(f"unknown sampling {unknown[0]!r}: choose from {', '.join(SAMPLINGS)}")
    results = []
    with tempfile.TemporaryDirectory(prefix="ssd-payload-") as root:
        target, draft = build_pair(Path(root), plan.vocab, plan.seed)
        for transport in plan.transports:
            for name in plan.samplings:
                for batch in plan.batch_sizes:
                    results.append(run_case(target, draft, plan, transport, SAMPLINGS[name], batch))
                    if progress is not None:
                        progress(results[-1])
    return results


HEADERS = (
    "transport",
    "sampling",
    "b",
    "row-rounds",
    "to workers B/row/rd",
    "from workers B/row/rd",
    "dense row (KxVx4)",
    "branch probs MB",
    "dense b*N*K*V*4 MB",
    "worker peak RSS MB",
    "hit rate",
    "s",
)


def table_row(r: PayloadResult) -> list[str]:
    return [
        r.transport,
        r.sampling,
        str(r.batch),
        str(r.row_rounds),
        f"{r.to_workers_per_row:,.0f}",
        f"{r.from_workers_per_row:,.0f}",
        f"{r.dense_row_bytes:,}",
        f"{r.branch_probs_bytes / MB:.1f}",
        f"{r.branch_probs_dense / MB:.1f}",
        f"{r.worker_peak_rss_bytes / MB:.0f}",
        f"{r.hit_rate:.2f}",
        f"{r.seconds:.1f}",
    ]


def format_table(results: list[PayloadResult]) -> str:
    lines = ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    lines += ["| " + " | ".join(table_row(r)) + " |" for r in results]
    return "\n".join(lines)


def csv_of(kind):
    """An argparse type: comma-separated values of `kind`, as a tuple."""
    return lambda text: tuple(kind(x) for x in text.split(",") if x)


def parse_plan(argv: list[str] | None = None) -> tuple[PayloadPlan, str | None]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.payload", description=__doc__.split("\n\n")[0])
    d = PayloadPlan()
    p.add_argument("--vocab", type=int, default=d.vocab, help="vocabulary size of the random pair")
    p.add_argument(
        "--transports", type=csv_of(str), default=d.transports, help="draft_transport values, comma-separated"
    )
    p.add_argument(
        "--samplings", type=csv_of(str), default=d.samplings, help=f"comma-separated, of: {', '.join(SAMPLINGS)}"
    )
    p.add_argument("--batch-sizes", type=csv_of(int), default=d.batch_sizes, help="comma-separated")
    p.add_argument("--k", type=int, default=d.k, help="speculation length K")
    p.add_argument("--budget", type=int, default=d.budget, help="branches per worker and row (ssd_budget, fixed)")
    p.add_argument("--top-k", type=int, default=d.top_k, help="top_k of the top-k sampling")
    p.add_argument("--draft-workers", type=int, default=d.draft_workers, help="D")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="tokens generated per request")
    p.add_argument("--prompt-tokens", type=int, default=d.prompt_tokens, help="random prompt token ids per request")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    unknown = [s for s in args.samplings if s not in SAMPLINGS]
    if unknown:
        p.error(f"--samplings: unknown {unknown[0]!r}; choose from {', '.join(SAMPLINGS)}")
    if args.vocab <= MIN_VOCAB:
        p.error(f"--vocab {args.vocab}: choose a vocabulary above {MIN_VOCAB} (prompt ids are drawn above it)")
    out = args.out
    fields = {name: value for name, value in vars(args).items() if name != "out"}
    return PayloadPlan(**fields), out


def main(argv: list[str] | None = None) -> int:
    plan, out = parse_plan(argv)
    results = measure(plan, progress=lambda r: sys.stderr.write(" | ".join(table_row(r)) + "\n"))
    sys.stdout.write(
        f"vocab {plan.vocab}, K {plan.k}, N {plan.budget} branches per worker, D {plan.draft_workers}, "
        f"{plan.max_tokens} tokens per request; bytes are wire.py frames, per row and round\n"
    )
    sys.stdout.write(format_table(results) + "\n")
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(
            json.dumps({"plan": asdict(plan), "results": [asdict(r) for r in results]}, indent=2) + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
