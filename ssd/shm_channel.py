"""A shared-memory channel between the target and a drafter process on the same host.

Why: on a gloo pair each transfer is a rendezvous between two processes' I/O threads, and on a
busy two-core machine every hop waits for a thread to be scheduled: an SSD round's outcome and
reply took about 2 ms of messaging (ad hoc trace: 0.46 ms from the target's send to the
drafter seeing the header, 0.5 ms for the body, 0.5 ms for the reply), out of a 13-20 ms round.
Here a message is a copy into a shared buffer and a semaphore post, and the receiver polls, so
the drafter learns that the outcome is in with one non-blocking check between tree depths.

Layout: one `Mailbox` per direction, a single slot of `capacity` bytes guarded by two
semaphores (`full`: a chunk is waiting; `empty`: the slot is free). A message (the frame of
ssd/wire.py: header, then body) is written as a byte stream in chunks of at most `capacity`;
the reader copies them out in order. The semaphores' acquire and release are the memory
barriers that make the slot's bytes visible before the reader takes them, on any CPU.

Waiting: a receiver spins (non-blocking tries, yielding the core to anything runnable) for
SPIN_S, then blocks in short slices. Spinning is what makes a reply arrive in microseconds; the
slices keep an idle drafter from burning a core and let a waiter notice a dead peer or a
deadline. Semaphores and buffers come from multiprocessing, so the kernel frees them with the
last process that holds them: a killed pair leaves nothing behind.
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable

import torch

from ssd.wire import HEADER, body_size, encode, frame, unframe

# How long a waiter spins before blocking: covers a verification of the models this transport
# is for (a few to a few tens of milliseconds), after which latency no longer matters.
SPIN_S = 0.05
_SLICE_S = 0.05
_LEN = 8  # bytes of the chunk-length field at the start of the slot


class ChannelTimeout(RuntimeError):
    """The peer did not send, or did not take a message, within the deadline."""


class ChannelClosed(RuntimeError):
    """The peer process is gone."""


class Mailbox:
    """One direction of the channel; picklable to a spawned child (created from its context)."""

    def __init__(self, ctx, capacity: int = 1 << 20) -> None:
        self.capacity = capacity
        self.full = ctx.Semaphore(0)
        self.empty = ctx.Semaphore(1)
        self.slot = ctx.RawArray("B", _LEN + capacity)

    def views(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(the slot's bytes [_LEN + capacity] uint8, its chunk-length field [1] int64), zero-copy."""
        slot = torch.frombuffer(self.slot, dtype=torch.uint8)
        return slot, slot[:_LEN].view(torch.long)


def _acquire(sem, timeout: datetime.timedelta | None, alive: Callable[[], bool], what: str) -> None:
    if sem.acquire(False):
        return
    start = time.monotonic()
    deadline = None if timeout is None else start + timeout.total_seconds()
    tries = 0
    while time.monotonic() - start < SPIN_S:
        if sem.acquire(False):
            return
        os.sched_yield()
        tries += 1
        if tries % 4096 == 0 and not alive():
            raise ChannelClosed(f"peer exited while waiting to {what}")
    while True:
        left = _SLICE_S if deadline is None else min(_SLICE_S, deadline - time.monotonic())
        if left > 0 and sem.acquire(True, left):
            return
        if not alive():
            raise ChannelClosed(f"peer exited while waiting to {what}")
        if deadline is not None and time.monotonic() >= deadline:
            raise ChannelTimeout(f"peer did not respond within {timeout.total_seconds():g} s while waiting to {what}")


class _Writer:
    def __init__(self, box: Mailbox, alive: Callable[[], bool]) -> None:
        self.box, self.alive = box, alive
        self.slot, self.length = box.views()

    def write(self, data: torch.Tensor, timeout: datetime.timedelta | None) -> None:
        cap = self.box.capacity
        for start in range(0, data.numel(), cap):  # never empty: a header leads every message
            chunk = data[start : start + cap]
            _acquire(self.box.empty, timeout, self.alive, "send")
            self.slot[_LEN : _LEN + chunk.numel()].copy_(chunk)
            self.length[0] = chunk.numel()
            self.box.full.release()


class _Reader:
    def __init__(self, box: Mailbox, alive: Callable[[], bool]) -> None:
        self.box, self.alive = box, alive
        self.slot, self.length = box.views()
        self.held = False  # a chunk is in the slot and this side owns it
        self.pos = self.end = 0

    def poll(self) -> bool:
        """Whether a chunk is waiting (takes it without blocking)."""
        if not self.held and self.box.full.acquire(False):
            self.held, self.pos, self.end = True, 0, int(self.length[0])
        return self.held

    def read_into(self, out: torch.Tensor, timeout: datetime.timedelta | None) -> None:
        done = 0
        while done < out.numel():
            if not self.held:
                _acquire(self.box.full, timeout, self.alive, "receive")
                self.held, self.pos, self.end = True, 0, int(self.length[0])
            n = min(out.numel() - done, self.end - self.pos)
            out[done : done + n].copy_(self.slot[_LEN + self.pos : _LEN + self.pos + n])
            done, self.pos = done + n, self.pos + n
            if self.pos == self.end:
                self.held = False
                self.box.empty.release()


class _ShmPosted:
    """The next message's header, maybe not here yet: arrived() is one non-blocking check."""

    def __init__(self, reader: _Reader) -> None:
        self.reader = reader

    def arrived(self) -> bool:
        return self.reader.poll()


class ShmEndpoint:
    """Typed send/recv over two mailboxes; the same interface as the gloo endpoint
    (send_raw, send, post_header, recv), so the drafter process serves either."""

    def __init__(self, inbox: Mailbox, outbox: Mailbox, fp: int, peer_alive: Callable[[], bool]) -> None:
        self.fp = fp
        self.reader, self.writer = _Reader(inbox, peer_alive), _Writer(outbox, peer_alive)

    def send_raw(self, kind, round_id: int, ints: torch.Tensor, floats: torch.Tensor,
                 timeout: datetime.timedelta | None = None) -> None:
        header, body = frame(kind, round_id, ints, floats, self.fp)
        self.writer.write(torch.cat([header.view(torch.uint8), body]), timeout)

    def send(self, msg, timeout: datetime.timedelta | None = None) -> None:
        self.send_raw(*encode(msg), timeout=timeout)

    def post_header(self) -> _ShmPosted:
        return _ShmPosted(self.reader)

    def recv(self, timeout: datetime.timedelta | None = None, posted: _ShmPosted | None = None):
        """-> (MsgType, message or None for bodiless control messages, ints). `posted` is
        accepted for the gloo endpoint's interface: what its arrived() took, the reader holds."""
        header = torch.zeros(HEADER, dtype=torch.long)
        self.reader.read_into(header.view(torch.uint8), timeout)
        body = torch.zeros(body_size(header, self.fp), dtype=torch.uint8)
        self.reader.read_into(body, timeout)
        return unframe(header, body)
