"""Typed messages between the target (engine) and the drafter, one per protocol step.

Every message carries the round id and the sequence ids it is about, so a reply can be matched
to its request and stale ones dropped. Fields are tensors or small lists of ints with fixed
meanings; the wire format (ssd/wire.py) is a fixed tensor layout, never pickle.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AdmitMsg:
    """New sequences join the batch (appended in this order)."""

    seq_ids: list[int]
    prompts: list[list[int]]
    seeds: list[int]  # the drafter's own generator seed per sequence
    temperature: list[float]
    top_k: list[int]
    top_p: list[float]


@dataclass(frozen=True)
class ReleaseMsg:
    seq_ids: list[int]


@dataclass(frozen=True)
class BeginRoundMsg:
    """The target starts verifying these speculations; build the next round's cache."""

    round_id: int
    seq_ids: list[int]
    spec_tokens: torch.Tensor  # [b, K] long
    num_draft: torch.Tensor  # [b] long
    fanout: list[int]  # [K+1] F_k, shared by the batch


@dataclass(frozen=True)
class ResolveMsg:
    """Verification outcomes of the round; asks for the next speculation of every row."""

    round_id: int
    seq_ids: list[int]
    num_accepted: torch.Tensor  # [b] long
    bonus_tokens: torch.Tensor  # [b] long
    neural_backup: bool  # draft misses just in time (else the target uses its fast backup)


@dataclass(frozen=True)
class DraftNowMsg:
    """Draft K tokens just in time for the rows marked in `need` (sequences with no cached
    speculation); seq_ids lists the whole running batch, in the target's order."""

    round_id: int
    seq_ids: list[int]
    need: list[bool]  # [b]


@dataclass(frozen=True)
class SpeculationReply:
    round_id: int
    seq_ids: list[int]
    hit: torch.Tensor  # [b] bool: came from the speculation cache
    tokens: torch.Tensor  # [b, K] long
    probs: torch.Tensor  # [b, K, V] float32 (draft distributions the tokens were drawn from)
    num_draft: torch.Tensor  # [b] long: 0 where the reply has no speculation for the row
    build_seconds: float = 0.0  # drafter time spent building this round's cache (glue + tree)
