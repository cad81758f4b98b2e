"""The hand-off between a proposer (whatever drafts) and the target's verification."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ssd.engine.sampling import BatchSampling
from ssd.engine.sequence import Sequence


class Source(enum.IntEnum):
    """Where a row's speculation came from."""

    DRAFT = 0  # ordinary SD: drafted just in time
    CACHE = 1  # SSD: a speculation-cache hit (no drafting latency)
    NEURAL = 2  # SSD backup: the draft model, just in time
    FAST = 3  # SSD backup: n-gram lookup / random tokens


@dataclass(frozen=True)
class Speculation:
    """K proposed tokens per running sequence and the distributions they were drawn from."""

    tokens: torch.Tensor  # [b, K] long (entries past num_draft are padding)
    probs: torch.Tensor  # [b, K, V] float32, V = the target's vocabulary size
    num_draft: torch.Tensor  # [b] long, real proposals per row (<= K)
    source: torch.Tensor | None = field(default=None)  # [b] long Source; None = all DRAFT

    @property
    def k(self) -> int:
        return self.tokens.shape[1]

    @staticmethod
    def empty(batch: int, vocab: int) -> "Speculation":
        return Speculation(
            torch.zeros(batch, 0, dtype=torch.long),
            torch.zeros(batch, 0, vocab),
            torch.zeros(batch, dtype=torch.long),
        )


@dataclass(frozen=True)
class RoundOutcome:
    """What verification decided, per row of the batch that was verified."""

    num_accepted: torch.Tensor  # [b] long, k in 0..num_draft
    bonus_tokens: torch.Tensor  # [b] long
    tokens_before: torch.Tensor  # [b] long, committed length of each row before this round


class Proposer(Protocol):
    """Drafting for the rows of the engine's running batch, in batch order.

    The engine calls add() for newly admitted sequences (appended at the end of the batch),
    propose() once per round, outcome_known() as soon as verification has decided (before the
    engine's bookkeeping, which a proposer waiting on another process overlaps with that wait),
    observe() after the bookkeeping (the sequences already hold the new tokens), and keep()
    with the rows that stay after finished ones leave.
    """

    def add(self, seqs: list[Sequence]) -> None: ...

    def propose(self, seqs: list[Sequence], k: int, sampling: BatchSampling) -> Speculation: ...

    def outcome_known(self, seqs: list[Sequence], speculation: Speculation, outcome: RoundOutcome) -> None: ...

    def observe(self, seqs: list[Sequence], speculation: Speculation, outcome: RoundOutcome) -> None: ...

    def keep(self, rows: torch.Tensor) -> None: ...

    def close(self) -> None: ...
