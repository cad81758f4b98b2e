"""The drafter wire format (ssd/transport/wire.py): every kind of message round-trips exactly,
the kind is the sender's (never inferred), and reply probabilities travel in their smallest exact
form."""

from __future__ import annotations

import pytest
import torch
from messages import every_message, same_message

from ssd.core.protocol import BeginRoundMsg, MsgType, ReleaseMsg, SpeculationReply
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
