"""Does a drafting process slow the target's verification? A controlled A/B.

    python -m benchmarks.contention [--device cuda] [--cycles 20] [--out bench_results/contention.json]

The layout is SSD's: the target in this process (one thread, the engine's packed lean runner),
its drafter in a worker process of its own started as the engine starts it. Only what the
drafter does while a verification runs changes between arms:
    alone      the drafter is idle, blocked in the kernel (it stops spinning SPIN_S after its
               last message, and the block starts later than that)
    drafting   the drafter builds a speculation tree for the whole verification, as in an SSD
               round (the round's announcement is sent just before the verification starts)
    spinning   the drafter finished a small tree before the verification and waits for the
               outcome (spinning for SPIN_S, then blocked), as when a tree is done early; the
               target busy-waits while the tree is built, so its core is as warm as in the
               other arms, where verifications follow each other at once
A verification is one forward of K+1 tokens of one sequence over a context of ~`context`
tokens, rolled back afterwards. Arms alternate in blocks, in a shuffled order per cycle, so the
machine's drift reaches every arm alike; each cycle gives a paired ratio per arm.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import random
import statistics
import sys
import time

from ssd.bench.report import add_pair_arguments, write_json

SLEEP_BEFORE_IDLE_S = 0.15  # > SPIN_S: the drafter is blocked, not spinning, in the idle arm


class _Rig:
    """The target's runner with a cached context and a draft worker process that has admitted it:
    what each arm of the A/B drives."""

    def __init__(self, spec: dict) -> None:
        import torch

        from ssd.core.config import EngineArgs
        from ssd.engine.proposers import resolve_provider
        from ssd.model.loader import load_model, load_tokenizer
        from ssd.model.runner import target_runner

        self.k = spec["k"]
        config = EngineArgs(
            target=spec["target"], draft=spec["draft"], mode="ssd", k=self.k, ssd_budget=spec["contention_budget"],
            dtype=spec["dtype"], draft_dtype=spec["draft_dtype"], device=spec["device"],
        ).to_config()  # fmt: skip
        tokenizer = load_tokenizer(spec["target"])
        self.runner = target_runner(
            load_model(spec["target"], spec["dtype"], spec["device"]), spec["device"], True, True
        )
        self.vocab = self.runner.vocab_size
        context: list[int] = []
        while len(context) < spec["contention_context"]:
            for p in spec["prompts"]:
                context.extend(tokenizer(p, add_special_tokens=False).input_ids)
        self.context = context[: spec["contention_context"]]
        self.cache = self.runner.new_cache()
        self.gen = torch.Generator().manual_seed(0)
        with torch.inference_mode():
            self.runner.forward(self.cache, torch.tensor([self.context[:-1]]))
        self.workers = resolve_provider(config, None)(config, self.vocab)  # forked worker processes
        self.link = self.workers.acquire()
        self.round_id = 0

    def admit(self) -> None:
        """A fresh drafter context (released first when held): every block starts alike."""
        from ssd.core.protocol import AdmitMsg, ReleaseMsg
        from ssd.core.sampling import SequenceSampling

        if self.round_id:
            self.link.release(ReleaseMsg([0]))
        self.link.admit(AdmitMsg([0], [self.context], [1], [SequenceSampling(1.0, 0, 1.0)]))

    def verify(self) -> float:
        """One verification of K+1 tokens over the context -> its seconds."""
        import torch

        tokens = torch.tensor([[self.context[-1]] + torch.randint(256, (self.k,), generator=self.gen).tolist()])
        t0 = time.perf_counter()
        with torch.inference_mode():
            self.runner.forward(self.cache, tokens)
        elapsed = time.perf_counter() - t0
        self.cache.drop_last(torch.tensor([self.k + 1]))
        return elapsed

    def drafted_round(self, fanout: list[int], settle_s: float) -> float:
        """Announce a round, optionally wait, verify, then send a missing outcome and read the
        reply (a miss: the drafter does not begin a predicted round) -> the verification's seconds."""
        import torch

        from ssd.core.protocol import BeginRoundMsg, ResolveMsg

        self.round_id += 1
        spec_tokens = torch.randint(256, (1, self.k), generator=self.gen)
        self.link.begin_round(BeginRoundMsg(self.round_id, [0], spec_tokens, torch.tensor([self.k]), fanout))
        # Busy, not asleep: a core that idled for milliseconds starts the verification slower
        # (its clock and caches), which would be charged to the drafter.
        until = time.perf_counter() + settle_s
        while time.perf_counter() < until:
            pass
        elapsed = self.verify()
        self.link.resolve(ResolveMsg(self.round_id, [0], torch.tensor([0]), torch.tensor([self.vocab - 1]), False))
        self.link.reply(30.0)
        return elapsed

    def close(self) -> None:
        self.workers.discard(self.link, failed=False)
        self.workers.close()


def _contention(spec: dict) -> dict:
    from ssd.drafting.saguaro import uniform_fanout
    from ssd.transport.shm_channel import SPIN_S

    assert SLEEP_BEFORE_IDLE_S > SPIN_S
    k, budget, reps, cycles = spec["k"], spec["contention_budget"], spec["contention_reps"], spec["contention_cycles"]
    rig = _Rig(spec)
    try:
        arms = {
            "alone": rig.verify,
            "drafting": lambda: rig.drafted_round(uniform_fanout(budget, k), 0.0),
            "spinning": lambda: rig.drafted_round(uniform_fanout(k + 1, k), spec["contention_settle_ms"] / 1000),
        }
        rig.admit()
        for arm in arms.values():  # warm-up
            arm()
        times, per_cycle = _run_arms(rig, arms, reps, cycles)
    finally:
        rig.close()
    ratios = {name: [c / a for c, a in zip(per_cycle[name], per_cycle["alone"])] for name in arms if name != "alone"}
    return {
        "k": k,
        "budget": budget,
        "context_tokens": len(rig.context),
        "reps_per_block": reps,
        "cycles": cycles,
        "verify_ms_median": {name: round(1000 * statistics.median(t), 4) for name, t in times.items()},
        "verify_ms_range": {name: [round(1000 * min(t), 4), round(1000 * max(t), 4)] for name, t in times.items()},
        "ratio_to_alone_median": {name: round(statistics.median(r), 4) for name, r in ratios.items()},
        "ratio_to_alone_range": {name: [round(min(r), 4), round(max(r), 4)] for name, r in ratios.items()},
    }


def _run_arms(rig: _Rig, arms: dict, reps: int, cycles: int) -> tuple[dict, dict]:
    """Every arm `reps` times per block, the arms in a shuffled order per cycle -> (every time per
    arm, each block's median per arm)."""
    times: dict[str, list[float]] = {name: [] for name in arms}
    per_cycle: dict[str, list[float]] = {name: [] for name in arms}
    shuffle = random.Random(0)
    for _ in range(cycles):
        order = list(arms)
        shuffle.shuffle(order)
        for name in order:
            rig.admit()
            time.sleep(SLEEP_BEFORE_IDLE_S)
            block = [arms[name]() for _ in range(reps)]
            times[name].extend(block)
            per_cycle[name].append(statistics.median(block))
    return times, per_cycle


def format_contention(stats: dict) -> str:
    lines = [
        f"contention A/B (target verification of K+1 = {stats['k'] + 1} tokens over {stats['context_tokens']} tokens, "
        f"1 thread; {stats['cycles']} cycles x {stats['reps_per_block']} verifications per arm; drafter tree B = "
        f"{stats['budget']}):"
    ]
    for name, ms in stats["verify_ms_median"].items():
        line = f"  {name:<9} {ms:7.3f} ms"
        if name in stats["ratio_to_alone_median"]:
            lo, hi = stats["ratio_to_alone_range"][name]
            line += f"   x{stats['ratio_to_alone_median'][name]:.3f} of alone (cycles: {lo:.3f}-{hi:.3f})"
        lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """The A/B in this process with one thread (the drafter's worker process inherits it), as a
    draft worker and its target run SSD's round; prints it and writes --out as JSON."""
    dtypes = ["auto", "float32", "float16", "bfloat16"]
    parser = argparse.ArgumentParser(prog="python -m benchmarks.contention", description=__doc__.split("\n\n")[0])
    add_pair_arguments(parser)
    parser.add_argument("--k", type=int, default=6, help="Draft tokens per round: a verification is K+1 tokens.")
    parser.add_argument("--budget", type=int, default=16, help="Branches of the drafter's tree (ssd_budget).")
    parser.add_argument(
        "--cycles", type=int, default=20, help="Cycles (each runs every arm for a block of --reps, in shuffled order)."
    )
    parser.add_argument("--reps", type=int, default=10, help="Verifications per arm and block.")
    parser.add_argument("--context", type=int, default=128, help="Tokens of context the verification runs over.")
    parser.add_argument("--settle-ms", type=float, default=15, help="Spinning arm: ms between the tree and the verify.")
    parser.add_argument("--dtype", default="float32", choices=dtypes, help="dtype of both models.")
    parser.add_argument("--draft-dtype", default=None, choices=dtypes, help="dtype of the draft (default: --dtype).")
    parser.add_argument("--device", default="cpu", help="torch device of both models (cpu, cuda, cuda:1, ...).")
    parser.add_argument("--log-level", default="WARNING", help="Python logging level.")
    parser.add_argument("--out", default="bench_results/contention.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if (args.target is None) != (args.draft is None):
        parser.error("pass both --target and --draft, or neither for the demo pair")
    for name, value in {"k": args.k, "budget": args.budget, "cycles": args.cycles, "reps": args.reps}.items():
        if value < 1:
            parser.error(f"--{name} must be >= 1, got {value}")
    # One thread, fixed before torch builds its pool, for the target here and the drafter's
    # worker process it starts (which inherits the environment).
    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    import torch
    import transformers

    from ssd.bench.plan import demo_pair
    from ssd.model.demo_models import heldout_prompts

    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    target, draft = (args.target, args.draft) if args.target else demo_pair()
    spec = {
        "prompts": heldout_prompts(8),
        "target": target,
        "draft": draft,
        "k": args.k,
        "dtype": args.dtype,
        "draft_dtype": args.draft_dtype or args.dtype,
        "device": args.device,
        "contention_budget": args.budget,
        "contention_reps": args.reps,
        "contention_cycles": args.cycles,
        "contention_context": args.context,
        "contention_settle_ms": args.settle_ms,
    }
    started = time.perf_counter()
    stats = _contention(spec)
    sys.stdout.write(format_contention(stats) + "\n")
    environment = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch_version": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    config = {k: v for k, v in spec.items() if k != "prompts"}
    doc = {"config": config, "environment": environment, "elapsed_s": round(time.perf_counter() - started, 2)}
    write_json(args.out, {**doc, "contention": stats})
    return 0


if __name__ == "__main__":
    sys.exit(main())
