"""What a pool of draft workers keeps per shard, and what it counts (ssd/transport/pool_client.py).

Glossary (the pool client's): a shard is one of the D places of the pool; its link is the
target's end of the worker that holds it now; a shard's incarnation counts the workers it has
had.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from ssd.core.protocol import DrafterCounters, SpeculationReply
from ssd.core.sampling import SequenceSampling
from ssd.transport.link import WorkerLink
from ssd.transport.wire import WireCounts

_MASK64 = (1 << 64) - 1
EXCHANGE_WINDOW = 4096  # rounds whose exchange time the median in stats() is taken over


def shard_seed(seed: int, shard: int, incarnation: int) -> int:
    """A seed for the drafter of `shard` that no other shard or incarnation shares (splitmix64)."""
    if shard == 0 and incarnation == 0:
        return seed
    z = (seed + 0x9E3779B97F4A7C15 * (1 + shard + (incarnation << 20))) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 2  # 62 bits, like the seeds the proposer draws


@dataclass
class SeqView:
    """What a replacement worker needs to take a sequence over."""

    tokens: list[int]  # committed, as the drafters know them
    seed: int
    sampling: SequenceSampling


@dataclass
class Shard:
    link: WorkerLink | None = None
    incarnation: int = 0  # workers this shard has had (seeds differ per incarnation)
    refilling: bool = False
    answered: bool = False  # its current worker has delivered a reply
    backoff_s: float = 0.0  # wait before acquiring the next worker (grows while workers fail at once)
    # Its latest reply's build time (a tree of the full depth, projected) and the round of that
    # reply. A shard named for no row sends nothing, so a round's own replies need not include the
    # slowest builder; a value older than BUILD_FRESH_ROUNDS (pool_client.py) no longer counts.
    build_s: float = 0.0
    build_round: int = -1


@dataclass
class PoolTally:
    """The pool's counts since its start, for the drafter counters and stats() it reports."""

    d: int
    failures: int = 0  # links lost
    replacements: int = 0  # links attached after a failure
    rejected_replies: int = 0  # stale or duplicated replies dropped, by links that are gone
    hints: int = 0  # PREDICT messages sent
    resplits: int = 0  # changes of the way the workers share the work (PoolClient.resplit)
    grids_missed: int = 0  # rounds whose grid shard was lost before its grid came: every shard answered
    rounds: int = 0
    replies_awaited: int = 0  # replies waited for, over all rounds
    board_rows: int = 0  # rows whose hit the target read off its worker's board (no reply waited for)
    shard_hits: list[int] = field(default_factory=list)  # [D] rows whose hit each shard held
    retired: DrafterCounters = field(default_factory=DrafterCounters)  # of links that are gone
    retired_wire: WireCounts = field(default_factory=WireCounts)  # frame bytes of links that are gone
    announced: WireCounts = field(default_factory=WireCounts)  # frame bytes written once to a whole pool's feed
    latest: dict[int, DrafterCounters] = field(default_factory=dict)  # per shard, as of its latest reply
    # Per round: seconds of the target's own thread in begin_round, resolve and reply (its
    # exchange with the pool, its forwards excluded); round_s is the current round's so far.
    exchange_s: deque = field(default_factory=lambda: deque(maxlen=EXCHANGE_WINDOW))
    round_s: float = 0.0
    _summed: DrafterCounters | None = None  # counters(), until a reply or a loss changes it

    def __post_init__(self) -> None:
        self.shard_hits = self.shard_hits or [0] * self.d

    def lost(self, w: int, link: WorkerLink) -> None:
        """Shard w's link failed: what it counted moves to the retired totals."""
        self.failures += 1
        self.rejected_replies += link.rejected
        self.retired_wire = self.retired_wire + link.wire
        self.retired = self.retired + self.latest.pop(w, DrafterCounters())
        self._summed = None

    def replied(self, w: int, reply: SpeculationReply) -> None:
        self.latest[w], self._summed = reply.counters, None
        self.shard_hits[w] += int(reply.hit.sum())

    def read_off_board(self, w: int, hits: int) -> None:
        """Shard w's `hits` rows the target read off its board (its counters come with its next reply)."""
        self.shard_hits[w] += hits
        self.board_rows += hits

    def round_done(self, replies_awaited: int, reply_s: float) -> None:
        self.rounds += 1
        self.replies_awaited += replies_awaited
        self.exchange_s.append(self.round_s + reply_s)

    def counters(self) -> DrafterCounters:
        """The workers' counters summed, each as of its latest reply (a shard named for no row
        of a round sends none: its count lags until it is named again). Kept between replies:
        with hits read off boards most rounds bring none, and the sum is D additions a round."""
        if self._summed is None:
            total = self.retired
            for c in self.latest.values():
                total = total + c
            self._summed = total
        return self._summed

    def stats(self, links: list[WorkerLink]) -> dict:
        """links: the live ones."""
        wire = sum((link.wire for link in links), self.retired_wire + self.announced)
        return {
            "draft_workers": self.d,
            "draft_workers_live": len(links),
            "draft_worker_failures": self.failures,
            "draft_worker_replacements": self.replacements,
            "draft_shard_hits": list(self.shard_hits),
            "draft_predict_hints": self.hints,
            "draft_resplits": self.resplits,
            "draft_grids_missed": self.grids_missed,
            # The target's side of each round (begin_round, resolve, reply), its forwards excluded:
            # the median over recent rounds, and the replies it waited for per round.
            "target_exchange_ms": round(1000 * statistics.median(self.exchange_s), 4) if self.exchange_s else None,
            "replies_awaited": round(self.replies_awaited / self.rounds, 4) if self.rounds else None,
            # Rows per round whose hit it read off its worker's board instead (shm_board.py).
            "board_reads": round(self.board_rows / self.rounds, 4) if self.rounds else None,
            "rejected_replies": self.rejected_replies + sum(link.rejected for link in links),
            # Frame bytes (ssd/transport/wire.py WireCounts) to and from the workers, by message kind.
            "wire_bytes_sent": wire.sent,
            "wire_bytes_received": wire.received,
        }
