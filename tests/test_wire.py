"""The drafter wire format (ssd/transport/wire.py): every kind of message round-trips exactly,
the kind is the sender's (never inferred), and reply probabilities travel in their smallest exact
form."""

from __future__ import annotations

import pytest
import torch
from messages import every_message, same_message

from ssd import LLM, SamplingParams
from ssd.core.protocol import BeginRoundMsg, MsgType, ReleaseMsg, SpeculationReply
from ssd.drafting.tree_drafter import TreeDrafter
from ssd.transport.wire import ForeignMessage, body_size, decode, encode, frame, unframe

FP = 99


@pytest.mark.parametrize("index", range(len(every_message())))
def test_every_message_round_trips_through_a_frame(index):
    kind, msg = every_message()[index]
    header, body = frame(kind, msg, FP)
    assert header.dtype == torch.long and body.dtype == torch.uint8
    assert body_size(header, FP) == body.numel()
    back_kind, back = unframe(header.clone(), body.clone())
    assert back_kind == kind and same_message(msg, back), (msg, back)


def test_every_kind_is_covered():
    assert {kind for kind, _ in every_message()} == set(MsgType)


def test_the_kind_is_the_senders():
    """One message class, two kinds: a BeginRoundMsg announces a round or predicts one."""
    _, msg = next(m for m in every_message() if m[0] == MsgType.BEGIN_ROUND)
    for kind in (MsgType.BEGIN_ROUND, MsgType.PREDICT):
        assert unframe(*frame(kind, msg, FP))[0] == kind


def test_a_message_of_another_kind_or_none_is_refused():
    with pytest.raises(TypeError, match="RESOLVE message is ResolveMsg, not ReleaseMsg"):
        encode(MsgType.RESOLVE, ReleaseMsg([1]))
    with pytest.raises(TypeError, match="READY message is None"):
        encode(MsgType.READY, ReleaseMsg([1]))
    with pytest.raises(TypeError, match="ADMIT message is AdmitMsg, not NoneType"):
        encode(MsgType.ADMIT, None)
    with pytest.raises(ValueError):
        decode(MsgType(99), 0, torch.zeros(0, dtype=torch.long), torch.zeros(0))


def test_a_foreign_header_is_refused():
    header, _ = frame(MsgType.RELEASE, ReleaseMsg([1]), FP)
    with pytest.raises(ForeignMessage, match="fingerprint"):
        body_size(header, FP + 1)


def test_reply_probabilities_travel_in_their_smallest_exact_form():
    """At a 128k vocabulary a dense row is 3 MB per round: greedy rows carry token ids only,
    top-k rows their support, and decoding rebuilds the exact tensor."""
    vocab, k = 128_256, 6
    gen = torch.Generator().manual_seed(1)
    greedy = torch.zeros(1, k, vocab)
    greedy[0, torch.arange(k), torch.randint(vocab, (k,), generator=gen)] = 1.0
    topk = torch.zeros(1, k, vocab)
    values, ids = torch.rand(k, 50, generator=gen), torch.randperm(vocab, generator=gen)[:50].expand(k, 50)
    topk[0].scatter_(1, ids, values / values.sum(1, keepdim=True))
    dense = torch.softmax(torch.randn(1, k, vocab, generator=gen), -1)
    sizes = {}
    for name, probs in (("greedy", greedy), ("top50", topk), ("dense", dense)):
        reply = SpeculationReply(
            3, [1], torch.tensor([True]), torch.zeros(1, k, dtype=torch.long), probs, torch.tensor([k])
        )
        header, body = frame(MsgType.REPLY, reply, FP)
        sizes[name] = body.numel()
        assert torch.equal(unframe(header, body)[1].probs, probs), name
    assert sizes["greedy"] < 400 and sizes["top50"] < k * 50 * 12 + 400, sizes
    assert sizes["dense"] >= k * vocab * 4, sizes


def test_rows_known_one_hot_travel_as_their_tokens_without_their_probs_being_read():
    """A reply's one_hot rows are packed from the drafted tokens in O(K): their probabilities are
    never read (NaN here), positions past num_draft travel as none, and a row with nothing
    drafted as nothing; the other rows are still found by scanning."""
    vocab, k = 128_256, 6
    tokens = torch.tensor([[5, 7, 9, 11, 13, 15], [1, 2, 3, 4, 5, 6], [8, 8, 8, 8, 8, 8]])
    probs = torch.full((3, k, vocab), float("nan"))
    probs[2] = 0.0
    probs[2, torch.arange(k), torch.tensor([3, 1, 4, 1, 5, 9])] = 1.0  # one-hot, not flagged: scanned
    reply = SpeculationReply(
        4, [1, 2, 3], torch.tensor([True, False, True]), tokens, probs, torch.tensor([4, 0, 6]),
        one_hot=torch.tensor([True, True, False]),
    )  # fmt: skip
    header, body = frame(MsgType.REPLY, reply, FP)
    back = unframe(header, body)[1].probs
    expected = torch.zeros(3, k, vocab)
    expected[0, torch.arange(4), tokens[0, :4]] = 1.0
    expected[2] = probs[2]
    assert torch.equal(back, expected)
    assert body.numel() < 800  # ids only: no row was sent dense


def test_a_drafters_greedy_rows_are_one_hot_at_their_tokens(tiny_pair, monkeypatch):
    """What the drafter claims with one_hot holds: in a batch mixing greedy and sampled rows,
    with Saguaro's scaling on, every greedy row's distribution is one-hot at its drafted token,
    in cached speculations and just-in-time ones alike."""
    seen: list[SpeculationReply] = []
    for name in ("reply", "draft_now"):
        original = getattr(TreeDrafter, name)
        monkeypatch.setattr(TreeDrafter, name, lambda self, *a, _f=original: seen.append(_f(self, *a)) or seen[-1])
    params = [SamplingParams(temperature=0.0, max_tokens=24), SamplingParams(temperature=1.0, seed=3, max_tokens=24)]
    with LLM(*tiny_pair, mode="ssd", k=4, draft_transport="inprocess", saguaro_c=0.5, ssd_backup="neural") as llm:
        llm.generate(["def add(a, b):", "import os"], params)
    greedy_rows = 0
    for reply in seen:
        assert reply.one_hot is not None and reply.one_hot.shape == reply.num_draft.shape
        for r in reply.one_hot.nonzero().flatten().tolist():
            n = int(reply.num_draft[r])
            one_hot = torch.zeros(n, reply.probs.shape[-1])
            one_hot[torch.arange(n), reply.tokens[r, :n]] = 1.0
            assert torch.equal(reply.probs[r, :n], one_hot)
            greedy_rows += n > 0
    assert greedy_rows > 5 and any(not bool(rep.one_hot.all()) for rep in seen)


def test_begin_round_messages_compare_real_tokens_only():
    """same_round (the drafter's check of a predicted round against the target's announcement)
    looks at ids, batch, fan-out and each row's real tokens, not the padding."""
    a = BeginRoundMsg(4, [1, 2], torch.tensor([[5, 6, 0], [7, 0, 0]]), torch.tensor([2, 1]), [1, 1, 1, 1])
    assert a.same_round(
        BeginRoundMsg(4, [1, 2], torch.tensor([[5, 6, 9], [7, 3, 3]]), torch.tensor([2, 1]), [1, 1, 1, 1])
    )
    for other in (
        BeginRoundMsg(5, [1, 2], a.spec_tokens, a.num_draft, [1, 1, 1, 1]),
        BeginRoundMsg(4, [2, 1], a.spec_tokens, a.num_draft, [1, 1, 1, 1]),
        BeginRoundMsg(4, [1, 2], a.spec_tokens, a.num_draft, [2, 1, 1, 0]),
        BeginRoundMsg(4, [1, 2], a.spec_tokens, torch.tensor([2, 2]), [1, 1, 1, 1]),
        BeginRoundMsg(4, [1, 2], torch.tensor([[5, 8, 0], [7, 0, 0]]), a.num_draft, [1, 1, 1, 1]),
    ):
        assert not a.same_round(other)
