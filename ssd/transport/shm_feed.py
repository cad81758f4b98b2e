"""A pool's feed: one shared-memory ring that a target writes and every draft worker of its pool
on this host reads, so a message for all of them (a round, its outcome) is written once.

Why: with a mailbox per worker (shm_channel.py) a target told each of its D workers the round and
its outcome in a write of its own, on its own thread between its verification and its next
forward: about 14 us a write on the 2-core VM, 2D writes a round. Through the feed a round costs
the target one write and D wake-ups (an eventfd write each, under a microsecond), whatever D.

Layout (one memfd): a control block, then `slots` slots.
    control  head (int64: chunks written so far); then per reader r a cache line whose first
             int64 is its `consumed` (chunks it has gone past; only reader r writes it)
    slot     stamp, to, length (int64 each), padding, then `capacity` bytes
A message (a frame of wire.py) is written as chunks of at most `capacity` bytes; chunk s goes to
slot s mod slots with stamp s + 1 (0 while it is being written). `to` is one reader's index, or
ALL: every reader that has taken a message of its own (a worker is sent JOIN before anything else,
so an announcement written before its JOIN is not for it).

Order: every reader goes past every chunk in the order written, taking those for it and skipping
the others, so what a target writes to one worker and what it writes to all arrive in the order
it wrote them.

Flow control: chunk s overwrites chunk s - slots, so it waits until every *attached* reader (one
that has been written to) has gone past that chunk. A reader not attached yet (a worker still
starting) holds nothing back: a chunk overwritten before it read it was, by that rule, not for
it, and it goes past a slot whose stamp is beyond the one it expects. A reader whose worker exits,
or that stops reading for the writer's deadline, is dropped (`FeedPort.lost`): its target's link
fails at its next use, as a mailbox's send would.

Memory order: the writer zeroes a slot's stamp, writes the chunk, then its stamp; a reader reads
the stamp before the chunk. This relies on the host keeping stores in program order (x86-64), as
the boards do (shm_board.supported); elsewhere workers keep a mailbox each. A chunk never changes
under a reader it is for: the writer attaches a reader with its first chunk for it, and from
then on does not overwrite a slot that reader has not gone past. A slot that changes under a
reader held a chunk not for it, which it skips whatever it read.

Waking: a reader spins for spin_s, then blocks on an eventfd of its own, which the writer posts
after each chunk for it. The reader clears it before its last look at the ring, so no post is
lost: the eventfd calls take a lock in the kernel, a full barrier on x86.
"""

from __future__ import annotations

import datetime
import mmap
import os
import select
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ssd.transport.channel import ChannelClosed, ChannelTimeout

ALL = -1  # `to` of a chunk for every joined reader
DEFAULT_SLOTS = 64
DEFAULT_CAPACITY = 1 << 18  # bytes of a slot (its pages are touched only where written)
MAX_READERS = 255  # workers a feed serves at once (a pool's D, and replacements starting)
_LINE = 64  # a reader's cell: its own cache line, so readers do not share one
_SLOT_HEAD = 32  # stamp, to, length, padding
_Q = struct.Struct("<q")
_TO_LEN = struct.Struct("<qq")
_DROP_CHECK_S = 0.001  # how often a writer waiting for room asks whether its laggards are alive
_SLICE_S = 0.05  # a blocked reader's wait between its checks of the writer's liveness and the deadline


@dataclass(frozen=True)
class FeedFds:
    """What a process needs to map a feed: its memfd and its shape."""

    fd: int
    slots: int
    capacity: int
    readers: int

    def control_bytes(self) -> int:
        return _LINE * (1 + self.readers)

    def size(self) -> int:
        return self.control_bytes() + self.slots * (_SLOT_HEAD + self.capacity)


class _Mapping:
    """A feed's memory, mapped in this process."""

    def __init__(self, fds: FeedFds) -> None:
        self.fds = fds
        self.map = mmap.mmap(fds.fd, fds.size())
        self.view = memoryview(self.map)
        self.base, self.stride = fds.control_bytes(), _SLOT_HEAD + fds.capacity

    def slot(self, seq: int) -> int:
        """Offset of the slot that chunk `seq` goes to."""
        return self.base + (seq % self.fds.slots) * self.stride

    def get(self, offset: int) -> int:
        return _Q.unpack_from(self.map, offset)[0]

    def put(self, offset: int, value: int) -> None:
        _Q.pack_into(self.map, offset, value)

    def close(self) -> None:
        if self.map.closed:  # closed already: its descriptor may be another file's by now
            return
        self.view.release()
        self.map.close()
        os.close(self.fds.fd)


def _cell(index: int) -> int:
    """Offset of reader `index`'s consumed count."""
    return _LINE * (1 + index)


class FeedWriter:
    """The target's end of a feed: it makes the feed, gives each worker a port (port()), and writes
    (write(): to one reader, or to ALL). Thread-safe: a pool's refills take ports from other
    threads."""

    def __init__(self, slots: int = DEFAULT_SLOTS, capacity: int = DEFAULT_CAPACITY, readers: int = MAX_READERS):
        fd = os.memfd_create("ssd-feed", os.MFD_CLOEXEC)
        fds = FeedFds(fd, slots, capacity, readers)
        os.ftruncate(fd, fds.size())
        self.mapping = _Mapping(fds)
        self.lock = threading.Lock()
        self.seq = 0  # chunks written
        self.floor = 0  # no attached reader has consumed fewer chunks (as last looked)
        self.ports: dict[int, FeedPort] = {}  # index -> the port of a reader that is not released

    @property
    def fds(self) -> FeedFds:
        return self.mapping.fds

    def port(self) -> FeedPort:
        """A new reader's port (its index and its eventfd), for a worker about to start."""
        with self.lock:
            index = next((i for i in range(self.fds.readers) if i not in self.ports), None)
            if index is None:
                raise RuntimeError(f"a feed serves at most {self.fds.readers} draft workers at once")
            port = FeedPort(self, index, os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC))
            self.ports[index] = port
            return port

    def write(
        self, data: torch.Tensor, to: int, timeout: datetime.timedelta | None, port: FeedPort | None = None
    ) -> list[FeedPort]:
        """Write `data` (uint8 [n], n > 0) for reader `to` (through `port`, when given: its port), or
        for every attached reader (ALL). Waits for room up to `timeout` (None: while the laggards
        live); a reader that exits or stays behind past it is dropped. -> the ports dropped during
        this write."""
        with self.lock:
            if self.mapping.map.closed:
                raise ChannelClosed("the pool's feed is closed")
            # A released index may be a new worker's by now: only its own port writes to it.
            if to != ALL and (to not in self.ports or (port is not None and self.ports[to] is not port)):
                raise ChannelClosed(f"feed reader {to} was released (its worker left, or the pool closed)")
            if to != ALL and not self.ports[to].attached:
                self.ports[to].attached = True
                self.floor = 0  # looked at (flow control) before the next overwrite, wherever it is
            wake = [p.wake for p in self.ports.values() if p.attached and (to == ALL or p.index == to)]
            src, cap, dropped = memoryview(data.numpy()), self.fds.capacity, []
            for start in range(0, len(src), cap):
                dropped += self._room(timeout)
                chunk = src[start : start + cap]
                off = self.mapping.slot(self.seq)
                self.mapping.put(off, 0)  # being written: a reader that sees this takes nothing
                _TO_LEN.pack_into(self.mapping.map, off + 8, to, len(chunk))
                self.mapping.view[off + _SLOT_HEAD : off + _SLOT_HEAD + len(chunk)] = chunk
                self.seq += 1
                self.mapping.put(off, self.seq)
                self.mapping.put(0, self.seq)
                for fd in wake:
                    os.eventfd_write(fd, 1)
            return dropped

    def _room(self, timeout: datetime.timedelta | None) -> list[FeedPort]:
        """Wait until every attached reader has gone past the chunk the next one overwrites."""
        need = self.seq - self.fds.slots + 1
        if need <= self.floor:
            return []
        end = None if timeout is None else time.monotonic() + timeout.total_seconds()
        checked, dropped = time.monotonic(), []
        while True:
            attached = [p for p in self.ports.values() if p.attached]
            counts = {p: self.mapping.get(_cell(p.index)) for p in attached}
            self.floor = min(counts.values(), default=self.seq)
            laggards = [p for p, n in counts.items() if n < need]
            if not laggards:
                return dropped
            now = time.monotonic()
            if now - checked > _DROP_CHECK_S:
                checked = now
                for p in laggards:
                    if not p.alive():
                        dropped.append(p.drop("its worker exited"))
                    elif end is not None and now > end:
                        dropped.append(p.drop(f"its worker read nothing for {timeout.total_seconds():g} s"))
                continue
            os.sched_yield()

    def release(self, port: FeedPort) -> None:
        """Forget a port (its worker is gone or leaving): it holds nothing back any more."""
        with self.lock:
            if self.ports.get(port.index) is port:
                del self.ports[port.index]
                os.close(port.wake)

    def close(self) -> None:
        with self.lock:
            for port in self.ports.values():
                os.close(port.wake)
            self.ports.clear()
            self.mapping.close()


class FeedPort:
    """A target's end of one reader of its feed: the channel's outbound end (shm_channel.py) for
    what the target writes to that worker alone. alive: whether the worker's process lives (set
    once it is started)."""

    def __init__(self, writer: FeedWriter, index: int, wake: int) -> None:
        self.writer, self.index, self.wake = writer, index, wake
        self.alive: Callable[[], bool] = lambda: True
        self.attached = False  # it has been written to: the writer waits for it (flow control)
        self.lost: str | None = None  # why the writer dropped it

    def handle(self) -> dict:
        """What its worker needs to read the feed (descriptors are this process's numbers)."""
        f = self.writer.fds
        return {"fd": f.fd, "slots": f.slots, "capacity": f.capacity, "readers": f.readers} | {
            "index": self.index, "wake": self.wake,
        }  # fmt: skip

    def fds(self) -> tuple[int, int]:
        return self.writer.fds.fd, self.wake

    def drop(self, why: str) -> FeedPort:
        self.attached, self.lost = False, why
        return self

    def write(self, data: torch.Tensor, timeout: datetime.timedelta | None) -> None:
        if self.lost is not None:
            raise ChannelClosed(f"the draft worker's feed reader was dropped: {self.lost}")
        self.writer.write(data, self.index, timeout, self)
        if self.lost is not None:  # dropped while this write waited for room behind it
            raise ChannelTimeout(f"the draft worker's feed reader was dropped: {self.lost}")

    def close(self) -> None:
        self.writer.release(self)


class FeedReader:
    """A worker's end of its pool's feed: the channel's inbound end (shm_channel.py). It takes the
    chunks for its index, and those for ALL once it has taken one of its own."""

    def __init__(self, fds: FeedFds, index: int, wake: int, alive: Callable[[], bool], spin_s: float) -> None:
        self.mapping, self.index, self.wake = _Mapping(fds), index, wake
        self.alive, self.spin_s = alive, spin_s
        self.cell = _cell(index)
        self.next = self.mapping.get(0)  # the writer's head: nothing before it is for this reader
        self.mapping.put(self.cell, self.next)
        self.joined = False
        self.held = False  # the chunk at `next` is for this reader, and partly read
        self.at = self.pos = self.end = 0  # its bytes' offset; how many were read; how many it has

    def _look(self) -> bool:
        """Whether a chunk for this reader is next, going past those that are not; never waits."""
        m = self.mapping
        while True:
            off, want = m.slot(self.next), self.next + 1
            stamp = m.get(off)
            if stamp < want:  # not written yet (0: being written)
                return False
            if stamp == want:
                to, length = _TO_LEN.unpack_from(m.map, off + 8)
                if to == self.index or (to == ALL and self.joined):
                    self.joined = True
                    self.held, self.at, self.pos, self.end = True, off + _SLOT_HEAD, 0, length
                    return True
            # Another reader's, or overwritten before this reader came by: not for it (flow control).
            self.next += 1
            m.put(self.cell, self.next)

    def poll(self) -> bool:
        """Whether a message for this reader has begun to arrive (takes nothing)."""
        return self.held or self._look()

    def read_into(self, out: torch.Tensor, timeout: datetime.timedelta | None) -> None:
        """Fill `out` (uint8) with the next bytes for this reader, waiting up to `timeout`."""
        dst, done, n = memoryview(out.numpy()), 0, out.numel()
        while done < n:
            if not self.held:
                self._wait(timeout)
            k = min(n - done, self.end - self.pos)
            dst[done : done + k] = self.mapping.view[self.at + self.pos : self.at + self.pos + k]
            done, self.pos = done + k, self.pos + k
            if self.pos == self.end:
                self.held = False
                self.next += 1
                self.mapping.put(self.cell, self.next)

    def _wait(self, timeout: datetime.timedelta | None) -> None:
        """Until a chunk for this reader is next: spin for spin_s, then block on the eventfd."""
        start = time.monotonic()
        tries = 0
        while time.monotonic() - start < self.spin_s:
            if self._look():
                return
            os.sched_yield()
            tries += 1
            if tries % 4096 == 0 and not self.alive():
                raise ChannelClosed("the target exited while its draft worker waited for a message")
        end = None if timeout is None else start + timeout.total_seconds()
        poller = select.poll()
        poller.register(self.wake, select.POLLIN)
        while True:
            try:
                os.eventfd_read(self.wake)  # clear the posts seen so far, then look
            except BlockingIOError:
                pass
            if self._look():
                return
            left = _SLICE_S if end is None else min(_SLICE_S, end - time.monotonic())
            if left > 0:
                poller.poll(int(left * 1000) + 1)
            if not self.alive():
                raise ChannelClosed("the target exited while its draft worker waited for a message")
            if end is not None and time.monotonic() >= end and not self._look():
                raise ChannelTimeout(f"nothing came within {timeout.total_seconds():g} s")

    def close(self) -> None:
        self.mapping.close()
        os.close(self.wake)
