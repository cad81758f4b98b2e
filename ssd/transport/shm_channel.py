"""A shared-memory channel between the target and a drafter process on the same host.

Why: on a gloo pair each transfer is a rendezvous between two processes' I/O threads, and on a
busy two-core machine every hop waits for a thread to be scheduled: an SSD round's outcome and
reply took about 2 ms of messaging (ad hoc trace: 0.46 ms from the target's send to the
drafter seeing the header, 0.5 ms for the body, 0.5 ms for the reply), out of a 13-20 ms round.
Here a message is a copy into a shared buffer and a semaphore post, and the receiver polls, so
the drafter learns that the outcome is in with one non-blocking check between tree depths.

Layout: one `Mailbox` per direction, a ring of `slots` slots of `capacity` bytes each, guarded
by two counting semaphores (`full`: chunks waiting; `empty`: slots free). A message (the frame of
ssd/transport/wire.py: header, then body) is written as a byte stream in chunks of at most
`capacity`, slot after slot around the ring; the reader copies them out in the same order. Why a
ring and not one slot: with one, a send waited until the peer had taken the message before it,
so a target announcing a round to D busy workers waited, each round, for the slowest of them to
reach its next tree depth and read the outcome it had been sent (on 2 cores, 8 workers: ~2 ms a
round). With a ring the target's sends return at once unless a worker is `slots` chunks behind.

Everything a mailbox holds is a file descriptor: the slot is an anonymous memfd and each
semaphore an eventfd in semaphore mode. So a mailbox reaches a process started by any means
(inherited fds of a `subprocess`, or fds passed over a Unix socket), with no names to choose or
clean up: the kernel frees all of it with the last process that holds it, so a killed pair
leaves nothing behind. Each eventfd read or write is a system call, and those are the memory
barriers that make the slot's bytes visible before the reader takes them, on any CPU.

Waiting: a receiver spins (non-blocking tries, yielding the core to anything runnable) for
SPIN_S, then blocks in short slices. Spinning is what makes a reply arrive in microseconds; the
slices keep an idle drafter from burning a core and let a waiter notice a dead peer or a
deadline.
"""

from __future__ import annotations

import datetime
import mmap
import os
import select
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ssd.core.protocol import MsgType
from ssd.transport.channel import ChannelClosed, ChannelTimeout
from ssd.transport.wire import HEADER, WireCounts, body_size, framed, unframe

# How long a waiter spins before blocking: covers a verification of the models this transport
# is for (a few to a few tens of milliseconds), after which latency no longer matters.
SPIN_S = 0.05
_SLICE_S = 0.05
_LEN = 8  # bytes of the chunk-length field at the start of the slot
DEFAULT_CAPACITY = 1 << 18  # bytes of one slot; a larger message goes in several chunks
DEFAULT_SLOTS = 8  # a mailbox's chunks in flight (its memfd's pages are touched only where written)


class _EventSemaphore:
    """A counting semaphore on an eventfd (EFD_SEMAPHORE): a read takes one unit, a write adds one."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def try_acquire(self) -> bool:
        try:
            os.eventfd_read(self.fd)
            return True
        except BlockingIOError:
            return False

    def acquire(self, timeout_s: float) -> bool:
        """Wait up to timeout_s for a unit. One reader per semaphore, so a unit seen by poll()
        is still there for the read that follows."""
        if self.try_acquire():
            return True
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        return bool(poller.poll(max(0, int(timeout_s * 1000)))) and self.try_acquire()

    def release(self) -> None:
        os.eventfd_write(self.fd, 1)


@dataclass(frozen=True)
class MailboxFds:
    """What another process needs to attach to a mailbox: its three file descriptors, and its
    ring's shape."""

    slot: int  # the memfd: `slots` slots, each a chunk-length field then `capacity` bytes
    full: int
    empty: int
    capacity: int
    slots: int = 1

    def fds(self) -> tuple[int, int, int]:
        return self.slot, self.full, self.empty


class Mailbox:
    """One direction of the channel. create() makes a new one; attach() maps one whose file
    descriptors this process inherited or received."""

    def __init__(self, fds: MailboxFds) -> None:
        self.handle = fds
        self.capacity, self.slots = fds.capacity, fds.slots
        self.full = _EventSemaphore(fds.full)
        self.empty = _EventSemaphore(fds.empty)
        self._map = mmap.mmap(fds.slot, fds.slots * (_LEN + fds.capacity))

    @classmethod
    def create(cls, capacity: int = DEFAULT_CAPACITY, slots: int = DEFAULT_SLOTS) -> "Mailbox":
        flags = os.EFD_SEMAPHORE | os.EFD_NONBLOCK | os.EFD_CLOEXEC
        slot = os.memfd_create("ssd-mailbox", os.MFD_CLOEXEC)
        os.ftruncate(slot, slots * (_LEN + capacity))
        return cls(MailboxFds(slot, os.eventfd(0, flags), os.eventfd(slots, flags), capacity, slots))

    @classmethod
    def attach(cls, fds: MailboxFds) -> "Mailbox":
        for fd in (fds.full, fds.empty):  # inherited descriptors may have lost O_NONBLOCK
            os.set_blocking(fd, False)
        return cls(fds)

    def views(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per slot of the ring: (its bytes [capacity] uint8, its chunk-length field [1] int64),
        zero-copy."""
        ring = torch.frombuffer(self._map, dtype=torch.uint8).view(self.slots, _LEN + self.capacity)
        return [(slot[_LEN:], slot[:_LEN].view(torch.long)) for slot in ring]

    def close(self) -> None:
        """Close this process's descriptors (the mapping goes with the last view of it)."""
        for fd in self.handle.fds():
            try:
                os.close(fd)
            except OSError:  # already closed: close() may run twice (explicitly, then at exit)
                pass


def _acquire(
    sem: _EventSemaphore,
    timeout: datetime.timedelta | None,
    alive: Callable[[], bool],
    what: str,
    spin_s: float = SPIN_S,
) -> None:
    if sem.try_acquire():
        return
    start = time.monotonic()
    deadline = None if timeout is None else start + timeout.total_seconds()
    tries = 0
    while time.monotonic() - start < spin_s:
        if sem.try_acquire():
            return
        os.sched_yield()
        tries += 1
        if tries % 4096 == 0 and not alive():
            raise ChannelClosed(f"peer exited while waiting to {what}")
    while True:
        left = _SLICE_S if deadline is None else min(_SLICE_S, deadline - time.monotonic())
        if left > 0 and sem.acquire(left):
            return
        if not alive():
            raise ChannelClosed(f"peer exited while waiting to {what}")
        if deadline is not None and time.monotonic() >= deadline:
            raise ChannelTimeout(f"peer did not respond within {timeout.total_seconds():g} s while waiting to {what}")


class MailboxWriter:
    def __init__(self, box: Mailbox, alive: Callable[[], bool], spin_s: float) -> None:
        self.box, self.alive, self.spin_s = box, alive, spin_s
        self.ring = box.views()
        self.next = 0  # the slot the next chunk goes to

    def write(self, data: torch.Tensor, timeout: datetime.timedelta | None) -> None:
        cap = self.box.capacity
        for start in range(0, data.numel(), cap):  # never empty: a header leads every message
            chunk = data[start : start + cap]
            _acquire(self.box.empty, timeout, self.alive, "send", self.spin_s)
            slot, length = self.ring[self.next]
            slot[: chunk.numel()].copy_(chunk)
            length[0] = chunk.numel()
            self.next = (self.next + 1) % len(self.ring)
            self.box.full.release()

    def close(self) -> None:
        self.box.close()


class MailboxReader:
    def __init__(self, box: Mailbox, alive: Callable[[], bool], spin_s: float) -> None:
        self.box, self.alive, self.spin_s = box, alive, spin_s
        self.ring = box.views()
        self.next = 0  # the slot of the next chunk (the one held, while held)
        self.held = False  # a chunk is in that slot and this side owns it
        self.pos = self.end = 0

    def _take(self) -> None:
        self.held, self.pos, self.end = True, 0, int(self.ring[self.next][1][0])

    def poll(self) -> bool:
        """Whether a chunk is waiting (takes it without blocking)."""
        if not self.held and self.box.full.try_acquire():
            self._take()
        return self.held

    def read_into(self, out: torch.Tensor, timeout: datetime.timedelta | None) -> None:
        done = 0
        while done < out.numel():
            if not self.held:
                _acquire(self.box.full, timeout, self.alive, "receive", self.spin_s)
                self._take()
            n = min(out.numel() - done, self.end - self.pos)
            out[done : done + n].copy_(self.ring[self.next][0][self.pos : self.pos + n])
            done, self.pos = done + n, self.pos + n
            if self.pos == self.end:
                self.held = False
                self.next = (self.next + 1) % len(self.ring)
                self.box.empty.release()

    def close(self) -> None:
        self.box.close()


class ShmChannel:
    """A `Channel` (ssd/transport/channel.py) over shared memory: typed messages in both
    directions. reader: the inbound end (a mailbox's, or a worker's end of its pool's feed,
    shm_feed.py); writer: the outbound end (a mailbox's, or a target's port on its feed)."""

    def __init__(self, reader, writer, fp: int) -> None:
        self.fp = fp
        self.reader, self.writer = reader, writer
        self.counts = WireCounts()

    @classmethod
    def of(
        cls, inbox: Mailbox, outbox: Mailbox, fp: int, peer_alive: Callable[[], bool], spin_s: float = SPIN_S
    ) -> ShmChannel:
        """A channel over two mailboxes, one each way."""
        return cls(MailboxReader(inbox, peer_alive, spin_s), MailboxWriter(outbox, peer_alive, spin_s), fp)

    def send(self, kind: MsgType, msg=None, timeout: datetime.timedelta | None = None) -> None:
        data = framed(kind, msg, self.fp)
        self.writer.write(data, timeout)
        self.counts.on_send(kind, data.numel() - 8 * HEADER)

    def poll(self) -> bool:
        """Whether the next message has begun to arrive; one non-blocking check."""
        return self.reader.poll()

    def recv(self, timeout: datetime.timedelta | None = None) -> tuple[MsgType, object]:
        """-> (kind, message; None for READY and SHUTDOWN)"""
        header = torch.zeros(HEADER, dtype=torch.long)
        self.reader.read_into(header.view(torch.uint8), timeout)
        body = torch.zeros(body_size(header, self.fp), dtype=torch.uint8)
        self.reader.read_into(body, timeout)
        kind, msg = unframe(header, body)
        self.counts.on_receive(kind, body.numel())
        return kind, msg

    def close(self, peer_exited: bool = False) -> None:
        self.reader.close()
        self.writer.close()
