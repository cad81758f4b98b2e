"""What the data plane carries and what a draft worker keeps: the channels' byte counters are
exact, and the payload measurement (benchmarks/payload.py) sees greedy rows travel as token ids
while dense rows travel whole."""

from __future__ import annotations

import torch

from benchmarks.payload import PayloadPlan, format_table, measure
from ssd.core.protocol import MsgType, ResolveMsg, SpeculationReply
from ssd.transport.shm_channel import Mailbox, ShmChannel


def _metered_pair():
    """Two ends of a shared-memory channel, and the bytes each end really wrote into its mailbox
    (counted at the mailbox writer, below the channel's own counters)."""
    a_to_b, b_to_a = Mailbox.create(), Mailbox.create()
    a, b = ShmChannel.of(b_to_a, a_to_b, 7, lambda: True), ShmChannel.of(a_to_b, b_to_a, 7, lambda: True)
    written = {"a": [], "b": []}

    def metered(write, log):
        def wrapped(data, timeout):
            log.append(data.numel())
            write(data, timeout)

        return wrapped

    for name, end in (("a", a), ("b", b)):
        end.writer.write = metered(end.writer.write, written[name])
    return a, b, written


def test_a_channel_counts_the_bytes_of_every_frame_by_type_on_both_ends():
    a, b, written = _metered_pair()
    dense = torch.rand(2, 6, 1000) + 0.01  # [b, K, V]
    reply = SpeculationReply(
        3, [1, 2], torch.tensor([True, False]), torch.zeros(2, 6, dtype=torch.long), dense, torch.full((2,), 6)
    )
    outcome = ResolveMsg(3, [1, 2], torch.tensor([1, 0]), torch.tensor([5, 6]), True)
    a.send(MsgType.RESOLVE, outcome)
    assert b.recv()[0] == MsgType.RESOLVE
    b.send(MsgType.REPLY, reply)
    assert a.recv()[0] == MsgType.REPLY
    (resolve_bytes,), (reply_bytes,) = written["a"], written["b"]
    assert a.counts.sent == b.counts.received == {"RESOLVE": resolve_bytes}
    assert b.counts.sent == a.counts.received == {"REPLY": reply_bytes}
    assert reply_bytes > 2 * 6 * 1000 * 4  # dense rows travel whole
    total = a.counts + b.counts
    assert total.sent == {"REPLY": reply_bytes, "RESOLVE": resolve_bytes}


def test_payload_measurement_sees_greedy_rows_as_token_ids_and_dense_rows_whole():
    plan = PayloadPlan(
        vocab=4096,
        transports=("shm",),
        samplings=("greedy", "dense"),
        batch_sizes=(2,),
        k=4,
        budget=4,
        max_tokens=6,
        prompt_tokens=6,
    )
    greedy, dense = measure(plan)
    print(format_table([greedy, dense]))
    for r in (greedy, dense):
        assert r.row_rounds > 0 and r.to_workers_per_row > 0 and r.from_workers_per_row > 0, r
        assert r.received_by_type.get("REPLY", 0) > 0 and r.sent_by_type.get("RESOLVE", 0) > 0, r
        assert r.branch_probs_dense == 2 * 4 * 4 * 4096 * 4, r
    # Trees are built to depth K: the largest round kept [b, N, K, V] float32 for dense rows, and
    # nothing for greedy rows (a greedy row's reply is its tokens).
    assert dense.branch_probs_bytes == dense.branch_probs_dense, dense
    assert greedy.branch_probs_bytes == 0, greedy
    assert dense.worker_peak_rss_bytes > dense.branch_probs_bytes, dense
    # A dense row is K x V float32 per round (plus the reply's last, unverified speculation);
    # a greedy one is K token ids.
    assert dense.from_workers_per_row >= dense.dense_row_bytes
    assert greedy.from_workers_per_row < dense.from_workers_per_row / 100


def test_branch_probs_keep_greedy_and_top_k_rows_sparse_and_exact():
    """At a real vocabulary (V = 128256, N = 16, K = 6) a greedy row keeps no branch probabilities
    (its reply is its tokens) and a top-50 row well under 5 MB (dense: 49 MB), and every branch
    reads back exactly; a row whose support widens at a later depth turns dense without losing
    what it kept, and a row whose support changes between depths is padded without changing a
    value."""
    import torch

    from ssd.core.sampling import BatchSampling, process_logits
    from ssd.drafting.tree import BranchProbs

    vocab, n, k = 128256, 16, 6
    gen = torch.Generator().manual_seed(0)
    sampling = BatchSampling(torch.tensor([0.0, 1.0, 1.0]), torch.tensor([0, 50, 50]), torch.ones(3))
    kept, depths = BranchProbs(vocab, [True, False, False]), []
    for d in range(k):
        logits = torch.randn(3, n, vocab, generator=gen)
        logits[1, :, : 60 - 5 * (d % 2)] = 7.0  # ties with the 50th value: top-50 keeps 60 or 55 tokens
        probs = process_logits(logits, sampling)
        if d == 3:  # row 2 goes wide
            probs[2] = torch.rand(n, vocab, generator=gen).softmax(-1)
        kept.add(probs, [True, True, True])
        depths.append(probs)
    want = torch.stack(depths, 2)  # [3, N, K, V]
    for r in (1, 2):
        assert torch.equal(kept.dense(r), want[r])
        assert torch.equal(kept.branch(r, 5), want[r, 5])
    row_bytes = [kept.row_nbytes(r) for r in range(3)]
    assert row_bytes[0] == 0 and row_bytes[1] == n * k * 60 * (4 + 8)
    assert max(row_bytes[:2]) < 5 * 2**20 and row_bytes[2] == n * k * vocab * 4
