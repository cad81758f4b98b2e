"""How the target reaches its drafter: one interface, several transports.

`DraftClient` is what the SSD proposer calls. `InProcessClient` runs the drafter in the caller's
thread (unit tests, debugging: no overlap with verification). The process transport
(ssd/draft_process.py) runs it in its own process, reached over shared-memory mailboxes or a
torch.distributed pair group.
"""

from __future__ import annotations

from typing import Protocol

from ssd.drafter import Drafter
from ssd.messages import AdmitMsg, BeginRoundMsg, DraftNowMsg, ReleaseMsg, ResolveMsg, SpeculationReply


class DrafterUnavailable(RuntimeError):
    """The drafter died, stalled past its deadline, or answered out of protocol."""


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
