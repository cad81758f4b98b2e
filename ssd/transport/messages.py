"""Typed messages between the target (engine) and the drafter, one per protocol step.

Every message carries the round id and the sequence ids it is about, so a reply can be matched
to its request and stale ones dropped. Fields are tensors or small lists of ints with fixed
meanings; the wire format (ssd/transport/wire.py) is a fixed tensor layout, never pickle.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    fanout: list[int]  # [K+1] F_k, shared by the batch: the whole pool's (every worker's share together)
    # [b] tokens committed per sequence before this round, as the target knows them: a worker
    # whose own count differs has missed a message and must not answer from a wrong prefix.
    committed: list[int] = field(default_factory=list)

    def same_round(self, other: "BeginRoundMsg") -> bool:
        """Whether both announce the same round: ids, batch, fan-out and the speculations' real tokens."""
        mine = (self.round_id, list(self.seq_ids), list(self.fanout), list(self.committed))
        if mine != (other.round_id, list(other.seq_ids), list(other.fanout), list(other.committed)):
            return False
        if not torch.equal(self.num_draft, other.num_draft):
            return False
        return all(
            torch.equal(self.spec_tokens[r, :n], other.spec_tokens[r, :n])
            for r, n in enumerate(self.num_draft.tolist())
        )


@dataclass(frozen=True)
class ResolveMsg:
    """Verification outcomes of the round; asks for the next speculation of every row."""

    round_id: int
    seq_ids: list[int]
    num_accepted: torch.Tensor  # [b] long
    bonus_tokens: torch.Tensor  # [b] long
    neural_backup: bool  # draft misses just in time (else the target uses its fast backup)
    # [K+1] the fan-out the next round will announce (decided now, so the drafter can begin that
    # round before the announcement); empty when not decided.
    next_fanout: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class DraftNowMsg:
    """Draft K tokens just in time for the rows marked in `need` (sequences with no cached
    speculation); seq_ids lists the whole running batch, in the target's order."""

    round_id: int
    seq_ids: list[int]
    need: list[bool]  # [b]


@dataclass
class DrafterCounters:
    """What a drafter did since it started (counts, and two high-water marks; every reply
    carries a snapshot). Adding two (a pool's workers) sums the counts and keeps the larger
    high-water marks: what one worker needed."""

    rounds: int = 0  # rounds whose cache answered an outcome
    cut: int = 0  # of which the tree stopped before depth K (the outcome arrived first)
    predicted: int = 0  # rounds begun on a prediction, before the target announced them
    confirmed: int = 0  # of which the announcement matched
    taken_back: int = 0  # of which the announcement differed: cache and generators restored
    rejected: int = 0  # messages refused as duplicated, reordered or stale (never acted on)
    # Largest bytes of the branch probabilities one round kept ([b, N_own, depth, V] float32).
    branch_probs_bytes: int = 0
    # Peak resident memory of the worker process (VmHWM, as of its previous reply; 0 when the
    # drafter runs in the engine's own process).
    peak_rss_bytes: int = 0

    def as_list(self) -> list[int]:
        return [
            self.rounds,
            self.cut,
            self.predicted,
            self.confirmed,
            self.taken_back,
            self.rejected,
            self.branch_probs_bytes,
            self.peak_rss_bytes,
        ]

    def __add__(self, other: "DrafterCounters") -> "DrafterCounters":
        summed = [a + b for a, b in zip(self.as_list()[:_COUNTS], other.as_list()[:_COUNTS])]
        peaks = [max(a, b) for a, b in zip(self.as_list()[_COUNTS:], other.as_list()[_COUNTS:])]
        return DrafterCounters(*summed, *peaks)

    def as_dict(self) -> dict[str, int]:
        return {f"drafter_{name}": value for name, value in zip(COUNTER_NAMES, self.as_list())}


COUNTER_NAMES = (
    "rounds",
    "rounds_cut",
    "predicted_rounds",
    "predicted_confirmed",
    "predicted_taken_back",
    "rejected_messages",
    "branch_probs_bytes",
    "peak_rss_bytes",
)
_COUNTS = 6  # the first six are counts; the rest are high-water marks


# Candidates ranked per outcome for the bonus token's rank: enough for fan-outs of up to 128
# branches at one outcome (a pool of 8 workers at ssd_budget 16 puts about 40 at k = 0).
RANK_DEPTH = 128


@dataclass(frozen=True)
class SpeculationReply:
    round_id: int
    seq_ids: list[int]
    hit: torch.Tensor  # [b] bool: came from this worker's speculation cache
    tokens: torch.Tensor  # [b, K] long
    probs: torch.Tensor  # [b, K, V] float32 (draft distributions the tokens were drawn from)
    num_draft: torch.Tensor  # [b] long: 0 where the reply has no speculation for the row
    build_seconds: float = 0.0  # drafter time spent building this round's cache (glue + tree)
    counters: DrafterCounters = field(default_factory=DrafterCounters)  # the drafter's, at reply time
    # [b] bool: the outcome is in the round's branch grid, whichever worker's share holds it
    # (equal to hit for a single drafter). A row covered but not hit is another worker's.
    covered: torch.Tensor | None = None
    # [b] long: the rank of the real bonus token among the round's candidates at its outcome k
    # (0 = the draft's first choice; the outcome is in the tree exactly when rank < F_k),
    # capped at RANK_DEPTH (= "that or beyond"); -1 where the round built no tree for the row.
    # What the miss law is fitted on: one rank tells the hit at every fan-out.
    bonus_rank: torch.Tensor | None = None
    # False when no drafter answered at all (every worker of a pool down): nothing to learn from.
    # Never on the wire: only the pool builds such a reply.
    answered: bool = True
