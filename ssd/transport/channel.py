"""How the target reaches its drafters: one client interface, one channel interface, several transports.

`DraftClient` is what the SSD proposer calls: `InProcessClient` runs the drafter in the caller's
thread (unit tests, debugging: no overlap with verification); `DraftPool` (pool.py) runs D
workers, each reached through a `ProcessClient` or `RemoteClient` (draft_process.py) over a `Channel`: shared-memory
mailboxes (shm_channel.py), a torch.distributed pair group (torch_channel.py, gloo_channel.py)
or a gRPC stream (grpc_channel.py). A worker that others connect to offers a `Listener`."""

from __future__ import annotations

import datetime
from typing import Protocol

from ssd.drafting.drafter import Drafter
from ssd.transport.messages import AdmitMsg, BeginRoundMsg, DraftNowMsg, ReleaseMsg, ResolveMsg, SpeculationReply
from ssd.transport.wire import WireCounts


class DrafterUnavailable(RuntimeError):
    """The drafter died, stalled past its deadline, or answered out of protocol."""


class ChannelTimeout(RuntimeError):
    """The peer did not send, or did not take a message, within the deadline."""


class ChannelClosed(RuntimeError):
    """The peer is gone (its process exited, its connection closed)."""


class Channel(Protocol):
    """Typed messages (ssd/transport/messages.py, framed by ssd/transport/wire.py) between a target and one drafter.

    Messages arrive whole and in order. A timeout of None waits as long as the peer lives; a
    peer that is gone or silent past the timeout raises RuntimeError (the client turns it into
    DrafterUnavailable)."""

    fp: int  # configuration fingerprint every frame carries; frames with another are refused
    counts: WireCounts  # frame bytes this end sent and received

    def send(self, msg, timeout: datetime.timedelta | None = None) -> None: ...

    def send_raw(self, kind, round_id: int, ints, floats, timeout: datetime.timedelta | None = None) -> None:
        """A frame of any type (control messages READY, ERROR, SHUTDOWN have no message class)."""

    def poll(self) -> bool:
        """Whether the next message has begun to arrive. Never blocks, takes nothing."""

    def recv(self, timeout: datetime.timedelta | None = None) -> tuple:
        """-> (MsgType, message or None for control messages, the frame's int body)"""

    def close(self) -> None: ...


class Listener(Protocol):
    """The worker's end of a transport a target connects to (torch, grpc): it listens on a port
    the system chose and publishes `address`; each accept() is one target's session. A target
    reaches it with that transport's connect(address, fp, timeout) -> Channel."""

    address: str  # "<transport>://host:port"

    def accept(self, fp: int, timeout: datetime.timedelta | None = None) -> Channel:
        """The next target's session (one at a time); ChannelTimeout when none came in time."""

    def close(self) -> None: ...


class WorkerLink(Protocol):
    """What a DraftPool (pool.py) needs of one worker's client (ProcessClient, RemoteClient in draft_process.py)."""

    name: str
    rejected: int  # stale or duplicated replies it dropped
    wire: WireCounts  # frame bytes sent to and received from this worker (its channel's counts)

    def join(self, shard: int, num_shards: int) -> None: ...
    def admit(self, msg: AdmitMsg) -> None: ...
    def release(self, msg: ReleaseMsg) -> None: ...
    def begin_round(self, msg: BeginRoundMsg) -> None: ...
    def predict(self, msg: BeginRoundMsg) -> None: ...
    def resolve(self, msg: ResolveMsg) -> None: ...
    def reply(self, msg: ResolveMsg, deadline_s: float) -> SpeculationReply: ...
    def draft_now(self, msg: DraftNowMsg) -> SpeculationReply: ...
    def kill(self) -> None: ...
    def close(self) -> None: ...


class WorkerSource(Protocol):
    def acquire(self) -> WorkerLink:
        """A ready worker (blocks while one starts or is leased); DrafterUnavailable if none can be had."""

    def discard(self, link: WorkerLink, failed: bool) -> None:
        """Give a worker back: closed or killed, its lease released (and, if failed, reported)."""

    def close(self) -> None: ...


class DraftClient(Protocol):
    def admit(self, msg: AdmitMsg) -> None: ...

    def release(self, msg: ReleaseMsg) -> None: ...

    def begin_round(self, msg: BeginRoundMsg) -> None:
        """Start building the next cache; returns at once on transports that overlap."""

    def resolve(self, msg: ResolveMsg) -> None:
        """Send the round's outcome; the drafter answers it with reply()."""

    def reply(self, msg: ResolveMsg, deadline_s: float) -> SpeculationReply:
        """The drafter's answer to the outcome sent by resolve(msg)."""

    def draft_now(self, msg: DraftNowMsg) -> SpeculationReply: ...

    def close(self) -> None: ...


class InProcessClient:
    def __init__(self, drafter: Drafter) -> None:
        self.drafter = drafter
        self.pending: SpeculationReply | None = None

    def admit(self, msg: AdmitMsg) -> None:
        self.drafter.admit(msg)

    def release(self, msg: ReleaseMsg) -> None:
        self.drafter.release(msg.seq_ids)

    def begin_round(self, msg: BeginRoundMsg) -> None:
        self.drafter.begin_round(msg)

    def resolve(self, msg: ResolveMsg) -> None:
        self.pending = self.drafter.resolve(msg)

    def reply(self, msg: ResolveMsg, deadline_s: float) -> SpeculationReply:
        assert self.pending is not None and self.pending.round_id == msg.round_id, "reply() without its resolve()"
        out, self.pending = self.pending, None
        return out

    def draft_now(self, msg: DraftNowMsg) -> SpeculationReply:
        return self.drafter.draft_reply(msg)

    def close(self) -> None:
        pass
