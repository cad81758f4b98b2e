"""The drafter wire format (ssd/transport/wire.py): every kind of message round-trips exactly,
the kind is the sender's (never inferred), and reply probabilities travel in their smallest exact
form."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from messages import every_message, same_message

from ssd import LLM, SamplingParams
from ssd.core.protocol import BeginRoundMsg, MsgType, ReleaseMsg, SpeculationReply
from ssd.drafting.ssd_proposer import SSDProposer
from ssd.drafting.tree_drafter import TreeDrafter
from ssd.transport.wire import Encoded, ForeignMessage, body_size, decode, encode, frame, unframe

FP = 99


@pytest.mark.parametrize("index", range(len(every_message())))
def test_every_message_round_trips_through_a_frame(index):
    kind, msg = every_message()[index]
    header, body = frame(kind, msg, FP)
    assert header.dtype == torch.long and body.dtype == torch.uint8
    assert body_size(header, FP) == body.numel()
    back_kind, back = unframe(header.clone(), body.clone())
    assert back_kind == kind and same_message(msg, back), (msg, back)


@pytest.mark.parametrize("index", range(len(every_message())))
def test_a_message_encoded_once_frames_as_the_message_does(index):
    """A pool encodes a round once for all its workers (wire.Encoded): each frame is the same."""
    kind, msg = every_message()[index]
    once = Encoded.of(kind, msg)
    for fp in (FP, FP + 1):  # one encoding, framed for channels of any fingerprint
        assert all(torch.equal(a, b) for a, b in zip(frame(kind, once, fp), frame(kind, msg, fp)))


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


@pytest.mark.parametrize("kind", [MsgType.RESOLVE, MsgType.REPLY, MsgType.ADMIT])
def test_a_truncated_or_malformed_body_raises_value_error(kind):
    """A frame that carries the right fingerprint but too few values, or a negative count, is a
    ValueError: the worker ends that session on it (an IndexError from reading past the body's
    memoryview would escape its handler)."""
    msg = next(m for k, m in every_message() if k == kind)
    header, body = frame(kind, msg, FP)
    header = header.clone()
    header[3] = 2  # two ints of the body are all that is left of it
    with pytest.raises(ValueError, match="malformed frame"):
        unframe(header, body[:16].clone())
    with pytest.raises(ValueError, match="malformed frame"):
        decode(kind, 1, torch.tensor([-1, 0, 0, 0]), torch.zeros(0))


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


def test_greedy_rows_travel_as_their_tokens_without_their_probs_being_read():
    """A reply's greedy rows are packed from the drafted tokens in O(K): their probabilities are
    never read (NaN here) and decode as zeros (a greedy row's verification reads none), positions
    past num_draft travel as none, and a row with nothing drafted as nothing; the other rows are
    still found by scanning, exactly."""
    vocab, k = 128_256, 6
    tokens = torch.tensor([[5, 7, 9, 11, 13, 15], [1, 2, 3, 4, 5, 6], [8, 8, 8, 8, 8, 8]])
    probs = torch.full((3, k, vocab), float("nan"))
    probs[2] = 0.0
    probs[2, torch.arange(k), torch.tensor([3, 1, 4, 1, 5, 9])] = 1.0  # a sampled row, one-hot: scanned
    reply = SpeculationReply(
        4, [1, 2, 3], torch.tensor([True, False, True]), tokens, probs, torch.tensor([4, 0, 6]),
        greedy=torch.tensor([True, True, False]),
    )  # fmt: skip
    header, body = frame(MsgType.REPLY, reply, FP)
    back = unframe(header, body)[1]
    expected = torch.zeros(3, k, vocab)
    expected[2] = probs[2]
    assert torch.equal(back.probs, expected) and torch.equal(back.tokens, tokens)
    assert body.numel() < 800  # ids only: no row was sent dense


def test_a_reply_of_greedy_rows_alone_carries_no_distributions():
    """Every row greedy: the reply holds no [b, K, V] block, and the target's decoding builds none
    (at V = 128k and b = 8, 24 MB a round of zeros before)."""
    tokens = torch.tensor([[5, 7, 9, 11], [1, 2, 3, 4]])
    reply = SpeculationReply(
        4, [1, 2], torch.tensor([True, True]), tokens, None, torch.tensor([4, 2]), greedy=torch.tensor([True, True])
    )
    header, body = frame(MsgType.REPLY, reply, FP)
    back = unframe(header, body)[1]
    assert back.probs is None and torch.equal(back.tokens, tokens) and torch.equal(back.num_draft, reply.num_draft)
    with pytest.raises(AssertionError, match="greedy rows only"):  # a sampled row must carry its distribution
        frame(MsgType.REPLY, dataclasses.replace(reply, greedy=torch.tensor([True, False])), FP)


@pytest.mark.parametrize("transport", ["inprocess", "shm"])
def test_a_drafter_leaves_out_the_distributions_of_its_greedy_rows_only(tiny_pair, monkeypatch, transport):
    """What the drafter's replies hold, in a batch mixing greedy and sampled rows with Saguaro's
    scaling on, in cached speculations and just-in-time ones alike: a greedy row's tokens and no
    distribution (zeros; none at all in a reply of greedy rows alone), a sampled row's tokens and
    the distribution each was drawn from. The engine's output stays exact either way
    (tests/test_ssd.py, tests/test_sampling_exactness.py); this is what it is given."""
    seen: list[SpeculationReply] = []
    owner = TreeDrafter if transport == "inprocess" else SSDProposer
    names = ("reply", "neural_backup") if transport == "inprocess" else ("_store",)
    for name in names:
        original = getattr(owner, name)
        if transport == "inprocess":
            monkeypatch.setattr(owner, name, lambda self, *a, _f=original: seen.append(_f(self, *a)) or seen[-1])
        else:  # what the target decoded from the wire
            monkeypatch.setattr(
                owner, name, lambda self, seqs, rep, _f=original: seen.append(rep) or _f(self, seqs, rep)
            )
    greedy, sampled = (
        SamplingParams(temperature=0.0, max_tokens=24),
        SamplingParams(temperature=1.0, seed=3, max_tokens=24),
    )
    options = dict(mode="ssd", k=4, draft_transport=transport, saguaro_c=0.5, ssd_backup="neural")
    with LLM(*tiny_pair, **options) as llm:
        llm.generate(["def add(a, b):", "import os"], [greedy, sampled])
        llm.generate(["def add(a, b):"], greedy)
    greedy_ids = {0, 2}  # the engine numbers sequences as they come: greedy, sampled, then greedy alone
    greedy_rows = sampled_rows = alone = 0
    for reply in seen:
        alone += reply.probs is None
        for r, seq_id in enumerate(reply.seq_ids):
            n = int(reply.num_draft[r])
            if n == 0:
                continue
            if seq_id in greedy_ids:
                greedy_rows += 1
                assert reply.probs is None or float(reply.probs[r].abs().sum()) == 0.0
                continue
            sampled_rows += 1
            probs = reply.probs[r, :n]
            assert torch.allclose(probs.sum(-1), torch.ones(n)), "a sampled row carries its distributions"
            assert bool((probs.gather(-1, reply.tokens[r, :n].unsqueeze(-1)) > 0).all())
    assert greedy_rows > 5 and sampled_rows > 5 and alone > 0


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
