"""Host time of a reply on the wire at a real vocabulary (`python -m benchmarks.pack_time`): how
long framing (the worker's side) and unframing (the target's) one REPLY takes per row, for each
form a row's draft distributions travel in (ssd/transport/reply_probs.py pack_probs).

Rows: greedy, marked by the drafter (what a drafter sends: tokens only, no distributions),
one-hot found by scanning (a reply that does not mark its greedy rows), top-50 support, dense.
Median of --repeats frames of a batch of --batch rows, divided by the batch. One thread, as a
draft worker runs.

--round: instead, the microseconds of the three frames every SSD round sends at batch --batch
(the announcement BEGIN_ROUND, the outcome RESOLVE, and a REPLY of greedy rows), framed and
unframed, median of --repeats; at batch 1 they sit on the round's critical path.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def _replies(vocab: int, k: int, b: int):
    import torch

    from ssd.core.protocol import SpeculationReply

    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(vocab, (b, k), generator=gen)
    one_hot = torch.zeros(b, k, vocab)
    one_hot.scatter_(-1, tokens.unsqueeze(-1), 1.0)
    top50 = torch.zeros(b, k, vocab)
    values, ids = torch.rand(b, k, 50, generator=gen), torch.randint(vocab, (b, k, 50), generator=gen)
    top50.scatter_(-1, ids, values)
    top50 /= top50.sum(-1, keepdim=True)
    dense = torch.softmax(torch.randn(b, k, vocab, generator=gen), -1)
    hit, num_draft = torch.ones(b, dtype=torch.bool), torch.full((b,), k)

    def reply(probs, greedy=None):
        return SpeculationReply(1, list(range(b)), hit, tokens, probs, num_draft, greedy=greedy)

    return {
        "greedy, marked by the drafter": reply(None, torch.ones(b, dtype=torch.bool)),
        "one-hot, scanned": reply(one_hot),
        "top-50": reply(top50),
        "dense": reply(dense),
    }


def measure(vocab: int, k: int, batch: int, repeats: int) -> dict[str, tuple[float, float]]:
    """form -> (frame ms per row, unframe ms per row), medians over repeats."""
    import torch

    from ssd.core.protocol import MsgType

    torch.set_num_threads(1)
    out = {}
    for name, reply in _replies(vocab, k, batch).items():
        enc, dec = _frame_times(MsgType.REPLY, reply, repeats)
        out[name] = (1e3 * enc / batch, 1e3 * dec / batch)
    return out


def _frame_times(kind, msg, repeats: int) -> tuple[float, float]:
    """(median seconds to frame msg, median seconds to unframe it) over repeats."""
    from ssd.transport.wire import frame, unframe

    enc, dec = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        header, body = frame(kind, msg, 1)
        framed = time.perf_counter()
        unframe(header, body)
        enc.append(framed - started)
        dec.append(time.perf_counter() - framed)
    return statistics.median(enc), statistics.median(dec)


def round_messages(k: int, batch: int, repeats: int) -> dict[str, tuple[float, float]]:
    """kind -> (frame us, unframe us) of one round's messages at `batch` greedy rows, medians."""
    import torch

    from ssd.core.protocol import BeginRoundMsg, DrafterCounters, MsgType, ResolveMsg, SpeculationReply

    torch.set_num_threads(1)
    ids, fanout, rows = list(range(batch)), ([3, 2, 2] + [1] * k)[: k + 1], torch.ones(batch, dtype=torch.bool)
    tokens, num_draft = torch.randint(258, (batch, k)), torch.full((batch,), k)
    messages = {
        "BEGIN_ROUND": BeginRoundMsg(5, ids, tokens, num_draft, fanout, [120] * batch),
        "RESOLVE": ResolveMsg(5, ids, torch.full((batch,), 4), torch.full((batch,), 17), True, fanout),
        "REPLY": SpeculationReply(
            5, ids, rows, tokens, None, num_draft, 0.01, DrafterCounters(), rows, torch.zeros(batch, dtype=torch.long),
            rows,
        ),
    }  # fmt: skip
    out = {}
    for name, msg in messages.items():
        enc, dec = _frame_times(MsgType[name], msg, repeats)
        out[name] = (1e6 * enc, 1e6 * dec)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.pack_time", description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=128_256, help="vocabulary size V")
    p.add_argument("--k", type=int, default=6, help="speculation length K")
    p.add_argument("--batch", type=int, default=4, help="rows per reply")
    p.add_argument("--repeats", type=int, default=20, help="frames timed per form (median)")
    p.add_argument("--round", action="store_true", help="time a round's three messages instead (microseconds)")
    args = p.parse_args(argv)
    if args.round:
        sys.stdout.write(f"K {args.k}, {args.batch} greedy rows, median of {args.repeats}\n")
        sys.stdout.write("| message | frame us | unframe us |\n|---|---|---|\n")
        for name, (enc, dec) in round_messages(args.k, args.batch, args.repeats).items():
            sys.stdout.write(f"| {name} | {enc:.1f} | {dec:.1f} |\n")
        return 0
    sys.stdout.write(f"V {args.vocab}, K {args.k}, {args.batch} rows per reply, median of {args.repeats}\n")
    sys.stdout.write("| row form | frame ms per row | unframe ms per row |\n|---|---|---|\n")
    for name, (enc, dec) in measure(args.vocab, args.k, args.batch, args.repeats).items():
        sys.stdout.write(f"| {name} | {enc:.3f} | {dec:.3f} |\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
