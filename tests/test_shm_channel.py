"""The shared-memory channel: messages of any size cross processes intact, arrival is seen
without consuming, and a dead or silent peer ends a wait with a clear error."""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
import threading
import time
from dataclasses import asdict

import pytest
import torch

from ssd.core.protocol import MsgType, ResolveMsg, SpeculationReply
from ssd.transport.channel import ChannelClosed, ChannelTimeout
from ssd.transport.shm_channel import Mailbox, ShmChannel

FP = 7
LONG = datetime.timedelta(seconds=60)

# A child that knows nothing but the descriptors it inherited: echo every message until SHUTDOWN.
ECHO = """
import json, os, sys
from ssd.transport.shm_channel import Mailbox, MailboxFds, ShmChannel
from ssd.core.protocol import MsgType
spec = json.loads(sys.argv[1])
parent = os.getppid()
end = ShmChannel.of(Mailbox.attach(MailboxFds(**spec["inbox"])), Mailbox.attach(MailboxFds(**spec["outbox"])), 7,
                 lambda: os.getppid() == parent)
while True:
    kind, msg = end.recv()
    if kind == MsgType.SHUTDOWN:
        break
    end.send(kind, msg)
"""


def _reply(b: int, k: int, v: int, seed: int) -> SpeculationReply:
    gen = torch.Generator().manual_seed(seed)
    return SpeculationReply(
        round_id=seed,
        seq_ids=list(range(b)),
        hit=torch.rand(b, generator=gen) > 0.5,
        tokens=torch.randint(0, v, (b, k), generator=gen),
        probs=torch.rand(b, k, v, generator=gen),
        num_draft=torch.full((b,), k),
        build_seconds=0.25,
    )


def test_messages_cross_processes_intact_in_chunks():
    """A 4 KB slot carries replies of up to 1.5 MB (chunked) and small messages between them."""
    to_child, to_parent = Mailbox.create(capacity=4096), Mailbox.create(capacity=4096)
    spec = json.dumps({"inbox": asdict(to_child.handle), "outbox": asdict(to_parent.handle)})
    child = subprocess.Popen(
        [sys.executable, "-c", ECHO, spec], pass_fds=to_child.handle.fds() + to_parent.handle.fds()
    )
    try:
        end = ShmChannel.of(to_parent, to_child, FP, lambda: child.poll() is None)
        for i, (b, k, v) in enumerate([(1, 6, 258), (16, 6, 4000), (2, 1, 3)]):
            sent = _reply(b, k, v, i)
            end.send(MsgType.REPLY, sent, LONG)
            kind, got = end.recv(LONG)
            assert kind == MsgType.REPLY and got.round_id == i and got.seq_ids == sent.seq_ids
            assert torch.equal(got.tokens, sent.tokens) and torch.equal(got.probs, sent.probs)
            assert torch.equal(got.hit, sent.hit) and got.build_seconds == pytest.approx(0.25)
            msg = ResolveMsg(i, [3, 4], torch.tensor([1, 2]), torch.tensor([65, 66]), True)
            end.send(MsgType.RESOLVE, msg, LONG)
            kind, back = end.recv(LONG)
            assert kind == MsgType.RESOLVE and back.seq_ids == [3, 4] and back.neural_backup
        end.send(MsgType.SHUTDOWN, None, LONG)
        assert child.wait(30) == 0
    finally:
        child.kill()
        child.wait(5)


def _pair(alive=lambda: True, slots: int = 4):
    a_to_b, b_to_a = Mailbox.create(capacity=256, slots=slots), Mailbox.create(capacity=256, slots=slots)
    return ShmChannel.of(b_to_a, a_to_b, FP, alive), ShmChannel.of(a_to_b, b_to_a, FP, alive)


def test_arrival_is_seen_without_consuming_the_message():
    a, b = _pair()
    assert not b.poll()
    a.send(MsgType.RESOLVE, ResolveMsg(5, [11], torch.tensor([2]), torch.tensor([65]), False))
    assert b.poll() and b.poll()  # asking twice takes nothing
    kind, msg = b.recv()
    assert kind == MsgType.RESOLVE and msg.round_id == 5 and msg.bonus_tokens.tolist() == [65]
    assert not b.poll()


def test_a_silent_peer_times_out_and_a_dead_one_is_reported():
    _, b = _pair()
    started = time.monotonic()
    with pytest.raises(ChannelTimeout, match="0.2 s"):
        b.recv(datetime.timedelta(seconds=0.2))
    assert time.monotonic() - started < 5
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    _, b = _pair(lambda: child.poll() is None)
    started = time.monotonic()
    with pytest.raises(ChannelClosed, match="peer exited"):
        b.recv()  # no deadline: only the peer's death ends this wait
    assert time.monotonic() - started < 10
    child.wait(5)


def _resolve(round_id: int) -> ResolveMsg:
    return ResolveMsg(round_id, [1], torch.tensor([0]), torch.tensor([round_id]), False)


def test_a_sender_runs_ahead_of_its_reader_by_the_ring_then_waits_to_its_deadline():
    """A target announcing a round to D busy workers must not wait for each to read the message
    before (with one slot per direction it did: on 2 cores, 8 workers, ~2 ms a round). A message
    of this size is one chunk: the ring holds `slots` of them unread; the next send waits, and
    gives up at its deadline."""
    a, _ = _pair(slots=4)
    quick = datetime.timedelta(seconds=0.2)
    started = time.monotonic()
    for round_id in range(1, 5):
        a.send(MsgType.RESOLVE, _resolve(round_id), quick)
    assert time.monotonic() - started < 0.2  # none of them waited
    with pytest.raises(ChannelTimeout):
        a.send(MsgType.RESOLVE, _resolve(5), quick)


def test_messages_written_ahead_arrive_whole_and_in_order_across_the_ring():
    """Small messages and a reply of many chunks (more than the ring holds), written while the
    reader lags, wrap around the ring and arrive as sent."""
    a, b = _pair(slots=3)
    quick = datetime.timedelta(seconds=5)  # a broken ring fails here instead of hanging
    a.send(MsgType.RESOLVE, _resolve(1), quick)
    a.send(MsgType.RESOLVE, _resolve(2), quick)
    kind, first = b.recv()
    assert kind == MsgType.RESOLVE and first.round_id == 1
    big = _reply(2, 3, 50, 9)  # ~1.3 KB of probabilities: 6 chunks of 256 bytes through 3 slots
    reader = threading.Thread(target=lambda: got.append([b.recv(LONG) for _ in range(3)]))
    got: list = []
    a.send(MsgType.RESOLVE, _resolve(3), quick)
    reader.start()
    a.send(MsgType.REPLY, big, LONG)
    reader.join(30)
    (second, third, (kind, reply)) = got[0]
    assert [second[1].round_id, third[1].round_id] == [2, 3]
    assert kind == MsgType.REPLY and torch.equal(reply.probs, big.probs) and torch.equal(reply.tokens, big.tokens)
    assert not b.poll()
