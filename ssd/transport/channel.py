"""How a target reaches its draft workers: one channel interface, several transports.

A `Channel` carries the draft protocol's messages (ssd/core/protocol.py, framed by wire.py)
between a target and one worker: shared-memory mailboxes (shm_channel.py), a torch.distributed
pair group (torch_channel.py, gloo_channel.py) or a gRPC stream (grpc_channel.py). A worker that
targets connect to offers a `Listener` (connect.py names them). On the target's side a
`WorkerLink` (link.py) speaks the protocol over one channel; a `PoolClient` (pool_client.py)
runs D links as one `DraftClient`, taking them from a `WorkerProvider` (link.py): worker processes this
process starts (spawn.py), or workers leased from a shared pool (a provider the caller passes
in, such as the Ray one of the serving package).
"""

from __future__ import annotations

import datetime
from typing import Protocol

from ssd.core.protocol import MsgType
from ssd.transport.wire import WireCounts


class ChannelTimeout(RuntimeError):
    """The peer did not send, or did not take a message, within the deadline."""


class ChannelClosed(RuntimeError):
    """The peer is gone (its process exited, its connection closed)."""


class WorkerBusy(RuntimeError):
    """The draft worker at this address is serving another target (one session at a time)."""


class Channel(Protocol):
    """Typed messages between a target and one drafter, each sent with its kind.

    Messages arrive whole and in order. A timeout of None waits as long as the peer lives; a
    peer that is gone or silent past the timeout raises RuntimeError (ChannelClosed,
    ChannelTimeout, wire.ForeignMessage; the link turns it into DrafterUnavailable)."""

    fp: int  # configuration fingerprint every frame carries; frames with another are refused
    counts: WireCounts  # frame bytes this end sent and received

    def send(self, kind: MsgType, msg=None, timeout: datetime.timedelta | None = None) -> None:
        """msg: the message class of `kind` (ssd.core.protocol), or its wire.Encoded form (encoded
        once for several channels); None for READY and SHUTDOWN."""

    def poll(self) -> bool:
        """Whether the next message has begun to arrive. Never blocks, takes nothing. After a
        poll the peer's next send completes without this end's recv(): where sends are buffered
        (a gRPC queue; a shm slot, for a message that fits its capacity) it does anyway; a torch
        pair's send waits for the receive, which poll posts."""

    def recv(self, timeout: datetime.timedelta | None = None) -> tuple[MsgType, object]:
        """-> (kind, message; None for READY and SHUTDOWN)"""

    def close(self, peer_exited: bool = False) -> None:
        """End the session at this end. peer_exited: the peer's process is gone (its owner saw it
        exit), so nothing is sent to it or to its rendezvous any more."""


class Listener(Protocol):
    """The worker's end of a transport a target connects to (torch, grpc): it listens on a port
    the system chose and publishes `address`; each accept() is one target's session. A target
    reaches it with connect.connect_channel(address, fp, timeout) -> Channel."""

    address: str  # "<transport>://host:port"

    def accept(self, fp: int, timeout: datetime.timedelta | None = None) -> Channel:
        """The next target's session (one at a time); ChannelTimeout when none came in time."""

    def close(self) -> None: ...
