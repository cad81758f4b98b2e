"""Does a drafting process slow the target's verification? A controlled A/B (`ssd bench --contention`).

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

import random
import statistics
import time

SLEEP_BEFORE_IDLE_S = 0.15  # > SPIN_S: the drafter is blocked, not spinning, in the idle arm


def _contention(spec: dict) -> dict:
    import torch

    from ssd.config import EngineArgs
    from ssd.drafting.saguaro import uniform_fanout
    from ssd.model.loader import load_model, load_tokenizer
    from ssd.model.runner import target_runner
    from ssd.transport.draft_process import ProcessClient
    from ssd.transport.messages import AdmitMsg, BeginRoundMsg, ReleaseMsg, ResolveMsg
    from ssd.transport.shm_channel import SPIN_S

    assert SLEEP_BEFORE_IDLE_S > SPIN_S
    k, budget, reps, cycles = spec["k"], spec["contention_budget"], spec["contention_reps"], spec["contention_cycles"]
    config = EngineArgs(
        target=spec["target"],
        draft=spec["draft"],
        mode="ssd",
        k=k,
        ssd_budget=budget,
        dtype=spec["dtype"],
        draft_dtype=spec["draft_dtype"],
        device=spec["device"],
    ).to_config()
    tokenizer = load_tokenizer(spec["target"])
    model = load_model(spec["target"], spec["dtype"], spec["device"])
    runner = target_runner(model, spec["device"], True, True)
    vocab = runner.vocab_size
    context: list[int] = []
    while len(context) < spec["contention_context"]:
        for p in spec["prompts"]:
            context.extend(tokenizer(p, add_special_tokens=False).input_ids)
    context = context[: spec["contention_context"]]
    cache = runner.new_cache()
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        runner.forward(cache, torch.tensor([context[:-1]]))
    client = ProcessClient.spawn(config, vocab)
    round_id = 0
    try:

        def admit() -> None:
            client.admit(AdmitMsg([0], [context], [1], [1.0], [0], [1.0]))

        def verify() -> float:
            tokens = torch.tensor([[context[-1]] + torch.randint(256, (k,), generator=gen).tolist()])
            t0 = time.perf_counter()
            with torch.inference_mode():
                runner.forward(cache, tokens)
            elapsed = time.perf_counter() - t0
            cache.drop_last(torch.tensor([k + 1]))
            return elapsed

        def drafted_round(fanout: list[int], settle_s: float) -> float:
            """Announce a round, optionally wait, verify, then send a missing outcome and read
            the reply (a miss: the drafter does not begin a predicted round)."""
            nonlocal round_id
            round_id += 1
            spec_tokens = torch.randint(256, (1, k), generator=gen)
            client.begin_round(BeginRoundMsg(round_id, [0], spec_tokens, torch.tensor([k]), fanout))
            # Busy, not asleep: a core that idled for milliseconds starts the verification
            # slower (its clock and caches), which would be charged to the drafter.
            until = time.perf_counter() + settle_s
            while time.perf_counter() < until:
                pass
            elapsed = verify()
            outcome = ResolveMsg(round_id, [0], torch.tensor([0]), torch.tensor([vocab - 1]), False)
            client.resolve(outcome)
            client.reply(outcome, 30.0)
            return elapsed

        arms = {
            "alone": lambda: verify(),
            "drafting": lambda: drafted_round(uniform_fanout(budget, k), 0.0),
            "spinning": lambda: drafted_round(uniform_fanout(k + 1, k), spec["contention_settle_ms"] / 1000),
        }
        admit()
        for arm in arms.values():  # warm-up
            arm()
        times: dict[str, list[float]] = {name: [] for name in arms}
        per_cycle: dict[str, list[float]] = {name: [] for name in arms}
        shuffle = random.Random(0)
        for _ in range(cycles):
            order = list(arms)
            shuffle.shuffle(order)
            for name in order:
                client.release(ReleaseMsg([0]))  # a fresh drafter context per block: every block alike
                admit()
                time.sleep(SLEEP_BEFORE_IDLE_S)
                block = [arms[name]() for _ in range(reps)]
                times[name].extend(block)
                per_cycle[name].append(statistics.median(block))
    finally:
        client.close()
    ratios = {name: [c / a for c, a in zip(per_cycle[name], per_cycle["alone"])] for name in arms if name != "alone"}
    return {
        "k": k,
        "budget": budget,
        "context_tokens": len(context),
        "reps_per_block": reps,
        "cycles": cycles,
        "verify_ms_median": {name: round(1000 * statistics.median(t), 4) for name, t in times.items()},
        "verify_ms_range": {name: [round(1000 * min(t), 4), round(1000 * max(t), 4)] for name, t in times.items()},
        "ratio_to_alone_median": {name: round(statistics.median(r), 4) for name, r in ratios.items()},
        "ratio_to_alone_range": {name: [round(min(r), 4), round(max(r), 4)] for name, r in ratios.items()},
    }


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
