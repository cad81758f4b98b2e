"""A pool's feed (ssd/transport/shm_feed.py): the target writes a round or its outcome once and
every worker of the pool reads it. A wrong read is a worker building the wrong round, or a lost
outcome, so these pin the feed's promises: each reader gets its own messages and the ones for all,
in the order written, and none for all before its first own one; a message larger than the ring
arrives whole; the writer waits for an attached reader, drops one that exits or stops reading, and
is never held back by one still starting, which skips what it missed; a blocked reader is woken.
Real memfds and eventfds; one reader is a forked process, as a worker is."""

from __future__ import annotations

import datetime
import os
import threading
import time

import pytest
import torch

from ssd.transport import shm_board, shm_feed
from ssd.transport.channel import ChannelClosed
from ssd.transport.shm_feed import ALL, FeedFds, FeedReader, FeedWriter

if not shm_board.supported():
    pytest.skip("the feed relies on x86-64 store order: no feed is made here", allow_module_level=True)

SECOND = datetime.timedelta(seconds=1)


def _msg(tag: int, n: int = 16) -> torch.Tensor:
    return torch.full((n,), tag, dtype=torch.uint8)


@pytest.fixture
def feed():
    """-> open(slots, capacity) -> (writer, [port, reader] pairs maker)"""
    made: list = []

    def open_(slots: int = 8, capacity: int = 64) -> FeedWriter:
        writer = FeedWriter(slots=slots, capacity=capacity, readers=4)
        made.append(writer)
        return writer

    yield open_
    for writer in made:
        writer.close()


def _reader(writer: FeedWriter, alive=lambda: True, spin_s: float = 0.01):
    """A port and its reader, the reader on descriptors of its own (as a worker holds copies)."""
    port = writer.port()
    f = writer.fds
    reader = FeedReader(
        FeedFds(os.dup(f.fd), f.slots, f.capacity, f.readers), port.index, os.dup(port.wake), alive, spin_s
    )
    return port, reader


def _read(reader: FeedReader, n: int = 16, timeout=SECOND) -> list[int]:
    out = torch.zeros(n, dtype=torch.uint8)
    reader.read_into(out, timeout)
    return out.tolist()


def test_each_reader_gets_its_own_and_the_messages_for_all_in_the_order_written(feed):
    writer = feed()
    (p0, r0), (p1, r1) = _reader(writer), _reader(writer)
    for tag, to in [(1, p0.index), (2, p1.index), (3, ALL), (4, p1.index), (5, ALL), (6, p0.index), (7, ALL)]:
        writer.write(_msg(tag), to, SECOND)
    assert [_read(r0)[0] for _ in range(4)] == [1, 3, 5, 6] and [_read(r1)[0] for _ in range(4)] == [2, 3, 4, 5]
    assert _read(r0)[0] == 7 and _read(r1)[0] == 7
    assert not r0.poll() and not r1.poll()
    r0.close(), r1.close()


def test_a_reader_gets_nothing_for_all_before_its_first_own_message(feed):
    writer = feed()
    (p0, r0), (p1, r1) = _reader(writer), _reader(writer)
    writer.write(_msg(9), p0.index, SECOND)
    writer.write(_msg(1), ALL, SECOND)  # before r1's JOIN: not for it
    writer.write(_msg(2), p1.index, SECOND)
    writer.write(_msg(3), ALL, SECOND)
    assert [_read(r1)[0] for _ in range(2)] == [2, 3] and not r1.poll()
    assert [_read(r0)[0] for _ in range(3)] == [9, 1, 3]
    r0.close(), r1.close()


def test_a_message_larger_than_the_ring_arrives_whole(feed):
    writer = feed(slots=4, capacity=64)
    port, reader = _reader(writer)
    data = torch.randint(0, 256, (1000,), dtype=torch.uint8)  # 16 chunks through 4 slots
    got = torch.zeros(1000, dtype=torch.uint8)
    t = threading.Thread(target=reader.read_into, args=(got, SECOND * 10))
    writer.write(_msg(0), port.index, SECOND)  # attached: the writer waits for it
    assert _read(reader)[0] == 0
    t.start()
    writer.write(data, port.index, SECOND * 10)
    t.join(10)
    assert torch.equal(got, data)
    reader.close()


def test_the_writer_waits_for_an_attached_reader_and_drops_one_that_stops_reading(feed):
    writer = feed(slots=2)
    (p0, r0), (p1, r1) = _reader(writer), _reader(writer)
    writer.write(_msg(1), p0.index, SECOND)
    writer.write(_msg(2), p1.index, SECOND)
    assert _read(r1)[0] == 2  # r0 reads nothing more: the writer may not overwrite its chunk
    dropped = writer.write(_msg(3), ALL, datetime.timedelta(seconds=0.2))
    assert dropped == [p0] and p0.lost and not p1.lost
    with pytest.raises(ChannelClosed, match="dropped"):
        p0.write(_msg(4), SECOND)
    assert _read(r1)[0] == 3  # the others go on
    writer.write(_msg(5), ALL, SECOND)  # r0 holds nothing back any more
    assert _read(r1)[0] == 5
    r0.close(), r1.close()


def test_a_write_to_a_released_reader_or_after_close_says_the_channel_is_closed(feed):
    """A link closed after its pool (at interpreter exit, after a failure) sends its SHUTDOWN to a
    port the feed no longer has: ChannelClosed, which a closing link expects (it was a KeyError);
    so does a stale port whose index a new worker has now, and any write once the feed is closed."""
    writer = feed()
    (p0, r0), (p1, r1) = _reader(writer), _reader(writer)
    p0.close()
    with pytest.raises(ChannelClosed, match="released"):
        p0.write(_msg(1), SECOND)
    (p2, r2) = _reader(writer)  # a new worker's port, at the index p0 had
    assert p2.index == p0.index
    with pytest.raises(ChannelClosed, match="released"):
        p0.write(_msg(1), SECOND)  # never into the new worker's messages
    writer.write(_msg(2), p1.index, SECOND)
    assert _read(r1)[0] == 2 and not r2.poll()
    writer.close()
    with pytest.raises(ChannelClosed, match="closed"):
        p1.write(_msg(3), SECOND)
    with pytest.raises(ChannelClosed, match="closed"):
        writer.write(_msg(4), ALL, SECOND)
    r0.close(), r1.close(), r2.close()


def test_a_reader_whose_worker_exited_is_dropped_without_waiting_for_the_deadline(feed):
    writer = feed(slots=2)
    port, reader = _reader(writer)
    port.alive = lambda: False
    writer.write(_msg(1), port.index, None)
    started = time.monotonic()
    assert writer.write(_msg(2), ALL, None) == []
    assert writer.write(_msg(3), ALL, None) == [port] and "exited" in port.lost  # None: no deadline at all
    assert time.monotonic() - started < 5
    reader.close()


def test_a_starting_reader_holds_nothing_back_and_skips_what_it_missed(feed):
    writer = feed(slots=4)
    (p0, r0), (p1, r1) = _reader(writer), _reader(writer)
    writer.write(_msg(0), p0.index, SECOND)
    assert _read(r0)[0] == 0
    for tag in range(1, 20):  # r1 is not attached: the ring wraps past it without waiting
        writer.write(_msg(tag), ALL, SECOND)
        assert _read(r0)[0] == tag
    got = []
    t = threading.Thread(
        target=lambda: got.extend([_read(r1, timeout=SECOND * 10)[0], _read(r1, timeout=SECOND * 10)[0]])
    )
    t.start()  # it reads as the worker does once started: through what it missed, to its JOIN
    writer.write(_msg(42), p1.index, SECOND * 10)
    writer.write(_msg(43), ALL, SECOND * 10)
    t.join(10)
    assert got == [42, 43] and _read(r0)[0] == 43
    r0.close(), r1.close()


def test_a_blocked_reader_is_woken_by_the_write(feed, monkeypatch):
    monkeypatch.setattr(shm_feed, "_SLICE_S", 30.0)  # a lost wake-up would wait this long
    writer = feed()
    port, reader = _reader(writer, spin_s=0.0)
    got, t = [], threading.Thread(target=lambda: got.append(_read(reader, timeout=SECOND * 60)[0]))
    writer.write(_msg(1), port.index, SECOND)
    assert _read(reader)[0] == 1
    t.start()
    time.sleep(0.2)  # blocked in poll() by now
    started = time.monotonic()
    writer.write(_msg(2), ALL, SECOND)
    t.join(20)
    assert got == [2] and time.monotonic() - started < 10
    reader.close()


def test_a_forked_reader_reads_what_the_target_writes(feed):
    writer = feed(slots=4, capacity=32)
    port, reader = _reader(writer)
    theirs, ours = os.pipe()
    pid = os.fork()
    if pid == 0:  # the worker: sums every message for it until one of tag 0
        try:
            total = 0
            while (got := _read(reader, 100, SECOND * 30))[0] != 0:
                total += sum(got)
            os.write(ours, str(total).encode())
        finally:
            os._exit(0)
    os.close(ours)
    writer.write(_msg(7, 100), port.index, SECOND * 30)
    for tag in range(1, 40):  # each 4 chunks, through 4 slots
        writer.write(_msg(tag, 100), ALL, SECOND * 30)
    writer.write(_msg(0, 100), ALL, SECOND * 30)
    with os.fdopen(theirs) as pipe:
        assert int(pipe.read()) == 100 * (7 + sum(range(1, 40)))
    os.waitpid(pid, 0)
    reader.close()
