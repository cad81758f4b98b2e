"""The interface every proposer implements (ssd/drafting: SD's and SSD's): what the engine asks
of the drafting side of a round. Apart from speculation.py, whose SpecMetrics a Sequence holds,
so that neither module imports the other.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ssd.core.sampling import BatchSampling
from ssd.core.sequence import Sequence
from ssd.core.speculation import RoundOutcome, Speculation


class Proposer(Protocol):
    """Drafting for the rows of the engine's running batch, in batch order.

    The engine calls add() for newly admitted sequences (appended at the end of the batch),
    propose() once per round, outcome_known() as soon as verification has decided (before the
    engine's bookkeeping, which a proposer waiting on another process overlaps with that wait),
    observe() after the bookkeeping (the sequences already hold the new tokens), and keep()
    with the rows that stay after finished ones leave.

    Mode auto runs rounds of other modes between a proposer's own: it calls detach() when they
    start and rejoin() when the proposer's rounds resume. A proposer whose drafters can share the
    work in more than one way (splits) is resplit between a detach() and a rejoin(). The methods
    with bodies below are what a proposer that subclasses this one gets when it has nothing to do
    there.
    """

    def add(self, seqs: list[Sequence]) -> None: ...

    def propose(self, seqs: list[Sequence], k: int, sampling: BatchSampling) -> Speculation: ...

    def outcome_known(self, seqs: list[Sequence], speculation: Speculation, outcome: RoundOutcome) -> None: ...

    def observe(self, seqs: list[Sequence], speculation: Speculation, outcome: RoundOutcome) -> None: ...

    def keep(self, rows: torch.Tensor) -> None: ...

    def close(self) -> None: ...

    def detach(self) -> None:
        """Rounds of other modes follow: stop work for the batch that nothing reads until
        rejoin(). Rows still come and go (add, keep) meanwhile."""

    def rejoin(self, seqs: list[Sequence]) -> None:
        """This proposer's rounds resume after detach(); seqs: the running batch, in order."""

    def splits(self) -> tuple[str, ...]:
        """The ways this proposer's drafters may share a round's work (draft_split), the one in
        use first; () or one: no choice."""
        return ()

    def resplit(self, split: str) -> None:
        """Share the work `split`'s way (one of splits()) from the next rejoin() on; called only
        while detached."""
        raise NotImplementedError(f"{type(self).__name__} has no splits")

    def stats(self) -> dict:
        """The proposer's own figures, which the engine's metrics report under its mode's name
        ({}: none)."""
        return {}

    def graph_runners(self) -> dict:
        """The model runners this proposer drives on the engine's thread, by the name the engine
        reports their CUDA graphs under ({}: none; a drafter elsewhere counts its own)."""
        return {}
