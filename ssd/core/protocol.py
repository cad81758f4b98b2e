"""The draft protocol: what a target and its drafter say to each other, one message per step.

A target's SSD proposer talks to a `DraftClient`: the drafter itself in the engine's thread
(`TreeDrafter`), or a pool of workers (`PoolClient`) whose links carry the same messages over a
channel. Every message has a kind (`MsgType`), sent explicitly with it; the wire format
(ssd/transport/wire.py) is a fixed tensor layout per kind, never pickle.

    JOIN                 JoinMsg          a worker's shard of the branch grid (before any sequence)
    ADMIT                AdmitMsg         new sequences join the batch
    RELEASE              ReleaseMsg       sequences leave it
    BEGIN_ROUND          BeginRoundMsg    the target verifies these speculations: build the next cache
    PREDICT              BeginRoundMsg    the round the target will most likely announce next
    GRID                 GridMsg          a round's branch grid, from one worker of a pool to its target
    RESOLVE              ResolveMsg       the round's outcomes: answer with the next speculations
    REPLY                SpeculationReply the answer to RESOLVE
    NEURAL_BACKUP        NeuralBackupMsg  the neural backup: draft just in time for sequences with nothing cached
    NEURAL_BACKUP_REPLY  SpeculationReply the answer to NEURAL_BACKUP
    READY, SHUTDOWN      (no message)     a worker is up; the target is done
    ERROR                ErrorMsg         why a worker gave up

Messages of a round (BEGIN_ROUND, PREDICT, RESOLVE, NEURAL_BACKUP and the replies) carry its round
id and the sequence ids they are about, so a reply is matched to its request and stale or
duplicated ones are dropped; membership messages (JOIN, ADMIT, RELEASE) come between rounds and
carry no round id.
"""

from __future__ import annotations

import array
import enum
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ssd.core.sampling import SequenceSampling


class MsgType(enum.IntEnum):
    ADMIT = 1
    RELEASE = 2
    BEGIN_ROUND = 3
    RESOLVE = 4
    NEURAL_BACKUP = 5
    REPLY = 6
    READY = 7
    ERROR = 8
    SHUTDOWN = 9
    PREDICT = 10
    JOIN = 11
    NEURAL_BACKUP_REPLY = 12
    GRID = 13


class DrafterUnavailable(RuntimeError):
    """The drafter died, stalled past its deadline, or answered out of protocol."""


@dataclass(frozen=True)
class JoinMsg:
    """Which shard of every round's branch grid a worker builds: branches n with n mod
    num_shards = shard (sent once, before any sequence is admitted)."""

    shard: int
    num_shards: int


@dataclass(frozen=True)
class AdmitMsg:
    """New sequences join the batch (appended in this order)."""

    seq_ids: list[int]
    tokens: list[list[int]]  # each sequence's committed tokens (a new sequence's: its prompt)
    seeds: list[int]  # the drafter's own generator seed per sequence
    sampling: list[SequenceSampling]


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
    fanout: list[int]  # [K+1] F_j, shared by the batch: the whole tree's (every shard's together)
    # [b] tokens committed per sequence before this round, as the target knows them: a worker
    # whose own count differs has missed a message and must not answer from a wrong prefix.
    committed: list[int] = field(default_factory=list)
    # The shard that sends the round's branch grid (GRID) to the target as soon as it has forked,
    # so the target can tell which shard holds each outcome (ResolveMsg.answering); -1: none.
    grid_shard: int = -1

    @classmethod
    def after_reply(cls, outcome: ResolveMsg, reply: SpeculationReply, committed: list[int]) -> BeginRoundMsg:
        """The round a target announces after `outcome` when `reply` carried every row's next
        speculation (a hit's branch or a just-in-time draft): it verifies those, with the fan-out
        the outcome message named. What a worker predicts (PREDICT), and what the pool tells the
        workers that did not hold the hits."""
        return cls(
            outcome.round_id + 1,
            list(outcome.seq_ids),
            reply.tokens.clone(),
            reply.num_draft.clone(),
            list(outcome.next_fanout),
            committed,
            outcome.backup_shard if outcome.answering else -1,
        )

    def board_key(self) -> int:
        """A number that names this round's content (what same_round compares), by which a
        worker's board publishes the round's build and the target finds it
        (ssd/transport/shm_board.py): a digest of its bytes, the same in every process (Python's
        own hash of bytes is salted per process)."""
        # Python lists, not array operations: the key is taken between the target's forwards, whose
        # runs have just evicted the caches, where each call into numpy or torch costs ~10 us.
        drafts = self.num_draft.tolist()
        real = [t for row, n in zip(self.spec_tokens.tolist(), drafts) for t in row[:n]]  # padding is not content
        sizes = [self.round_id, len(self.seq_ids), len(self.fanout), len(self.committed), len(drafts)]
        content = sizes + list(self.seq_ids) + list(self.fanout) + list(self.committed) + drafts + real
        digest = hashlib.blake2b(array.array("q", content).tobytes(), digest_size=8)
        return int.from_bytes(digest.digest(), "little") & ((1 << 62) - 1)

    def same_round(self, other: BeginRoundMsg) -> bool:
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
    # A pool's: [b] the shard that answers each row (the one whose shard of the grid holds its
    # outcome, else the backup shard), as the target read it off the round's GridMsg; a worker
    # with no row sends no reply. Empty: every shard answers every row.
    answering: list[int] = field(default_factory=list)
    backup_shard: int = 0  # the shard that drafts the rows no shard holds, when neural_backup
    # A pool's: [b] how many tokens of each row's hit the target took off its answering shard's
    # board (ssd/transport/shm_board.py), 0 where none; that shard sends no reply for those rows
    # and speculates from that depth on (predict_round). Empty: none taken.
    taken: list[int] = field(default_factory=list)

    def owes_reply(self, shard: int) -> bool:
        """Whether shard `shard` replies: it answers some row (every row where none is named)
        whose speculation the target did not take off its board."""
        if not self.answering:
            return True
        taken = self.taken or [0] * len(self.answering)
        return any(a == shard and t == 0 for a, t in zip(self.answering, taken))


@dataclass(frozen=True)
class GridMsg:
    """A round's branch grid, as every shard of a pool forks it alike: branch n of row r stands
    for the outcome (outcome[r, n] tokens accepted, bonus token candidates[r, n]) and is built by
    shard n mod D. Sent by the round's grid_shard once it has forked, while the target verifies."""

    round_id: int
    seq_ids: list[int]
    outcome: torch.Tensor  # [b, N] long
    candidates: torch.Tensor  # [b, N] long

    def branches(self, accepted: list[int], bonus: list[int]) -> list[int]:
        """Per row, the number of the branch of its outcome (accepted[r], bonus[r]), -1 where the
        grid has none (a miss)."""
        return grid_branches(self.outcome.tolist(), self.candidates.tolist(), accepted, bonus)

    def rank(self, row: int, branch: int) -> int:
        """The rank of branch `branch` among its outcome's candidates."""
        return branch_rank(self.outcome[row].tolist(), branch)


def grid_branches(outcome: list, candidates: list, accepted: list[int], bonus: list[int]) -> list[int]:
    """GridMsg.branches over a grid's rows as lists (outcome, candidates: [b][N] ints)."""
    out = []
    for row_outcome, row_candidates, a, t in zip(outcome, candidates, accepted, bonus, strict=True):
        n = branch_of(row_outcome, row_candidates, a, t)
        out.append(-1 if n is None else n)
    return out


def branch_rank(outcome: Sequence[int], branch: int) -> int:
    """The rank of branch `branch` of a row whose branches stand for `outcome` ([N] tokens
    accepted) among its outcome's candidates: branches are numbered by outcome, then rank
    (ssd/drafting/tree.py)."""
    return branch - outcome.index(outcome[branch])


def branch_of(outcome: Sequence[int], candidates: Sequence[int], accepted: int, bonus: int) -> int | None:
    """The number of the branch of one row's grid (outcome [N], candidates [N]) that stands for
    the outcome (accepted, bonus), None where there is none."""
    return next((n for n, pair in enumerate(zip(outcome, candidates)) if pair == (accepted, bonus)), None)


@dataclass(frozen=True)
class NeuralBackupMsg:
    """The neural backup: draft K tokens just in time for the rows marked in `need` (sequences
    with no cached speculation); seq_ids lists the whole running batch, in the target's order."""

    round_id: int
    seq_ids: list[int]
    need: list[bool]  # [b]


@dataclass(frozen=True)
class ErrorMsg:
    """Why a worker ended the session (its exception, as text)."""

    text: str


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
    drafted_early: int = 0  # rows whose first speculation was drafted at admission and served (neural_backup.py)
    # Where the builds' time went (every tree built, but those of predicted rounds that went stale
    # while building): trees, their depths, and host microseconds preparing them (glue forward,
    # fork, processing) and decoding them. On a device the preparation counts until its queued
    # kernels have run (tree_decode.decode_tree). Against a verification's time these say whether
    # a tree can reach depth K before the outcome comes.
    built: int = 0
    depths: int = 0
    prepare_us: int = 0
    tree_us: int = 0
    # Largest bytes of the branch probabilities one round kept ([b, N_own, depth, V] float32).
    branch_probs_bytes: int = 0
    # Peak resident memory of the worker process (VmHWM, read after a reply at most once a second:
    # ssd/worker/session.py; 0 when the drafter runs in the engine's own process).
    peak_rss_bytes: int = 0

    def as_list(self) -> list[int]:
        return [
            self.rounds,
            self.cut,
            self.predicted,
            self.confirmed,
            self.taken_back,
            self.rejected,
            self.drafted_early,
            self.built,
            self.depths,
            self.prepare_us,
            self.tree_us,
            self.branch_probs_bytes,
            self.peak_rss_bytes,
        ]

    def count_build(self, depth: int, prepare_s: float, tree_s: float) -> None:
        """A tree built to `depth`, after prepare_s seconds of glue and fork and tree_s of decoding."""
        self.built, self.depths = self.built + 1, self.depths + depth
        self.prepare_us += round(prepare_s * 1e6)
        self.tree_us += round(tree_s * 1e6)

    def copy(self) -> DrafterCounters:
        return DrafterCounters(*self.as_list())

    def __add__(self, other: DrafterCounters) -> DrafterCounters:
        summed = [a + b for a, b in zip(self.as_list()[:_COUNTS], other.as_list()[:_COUNTS])]
        peaks = [max(a, b) for a, b in zip(self.as_list()[_COUNTS:], other.as_list()[_COUNTS:])]
        return DrafterCounters(*summed, *peaks)

    def as_dict(self) -> dict[str, float]:
        """The counters by name, and what they give per tree built: its mean depth, and the ms of
        its preparation and of one of its depths (a pool's: the mean over its workers)."""
        built, depths = max(self.built, 1), max(self.depths, 1)
        return {
            **{f"drafter_{name}": value for name, value in zip(COUNTER_NAMES, self.as_list())},
            "drafter_mean_depth": round(self.depths / built, 3),
            "drafter_prepare_ms": round(self.prepare_us / built / 1000, 3),
            "drafter_depth_ms": round(self.tree_us / depths / 1000, 3),
        }


COUNTER_NAMES = (
    "rounds",
    "rounds_cut",
    "predicted_rounds",
    "predicted_confirmed",
    "predicted_taken_back",
    "rejected_messages",
    "first_drafts_early",
    "rounds_built",
    "tree_depths",
    "prepare_us",
    "tree_us",
    "branch_probs_bytes",
    "peak_rss_bytes",
)
_COUNTS = 11  # the first eleven are counts (summed over a pool's workers); the rest are high-water marks


# Candidates ranked per outcome for the bonus token's rank: enough for fan-outs of up to 128
# branches at one outcome (a pool of 8 workers at ssd_budget 16 puts about 40 at outcome 0).
RANK_DEPTH = 128


@dataclass(frozen=True)
class SpeculationReply:
    round_id: int
    seq_ids: list[int]
    hit: torch.Tensor  # [b] bool: came from this worker's speculation cache
    tokens: torch.Tensor  # [b, K] long
    # [b, K, V] float32: the draft distributions the sampled rows' tokens were drawn from; a greedy
    # row's are zeros (its verification reads none, ssd/engine/verify.py); None when no row carries
    # any (each greedy or without a speculation), so a greedy batch's reply holds no [b, K, V]
    # block (24 MB at V = 128k and b = 8).
    probs: torch.Tensor | None
    num_draft: torch.Tensor  # [b] long: 0 where the reply has no speculation for the row
    build_seconds: float = 0.0  # drafter time spent building this round's cache (glue + tree)
    counters: DrafterCounters = field(default_factory=DrafterCounters)  # the drafter's, at reply time
    # [b] bool: the outcome is in the round's branch grid, whichever worker's shard holds it
    # (equal to hit for a single drafter). A row covered but not hit is another worker's.
    covered: torch.Tensor | None = None
    # [b] long: the rank of the real bonus token among the round's candidates at its outcome j
    # (0 = the draft's first choice; the outcome is in the tree exactly when rank < F_j),
    # capped at RANK_DEPTH (= "that or beyond"); -1 where the round built no tree for the row.
    # What the miss law is fitted on: one rank tells the hit at every fan-out.
    bonus_rank: torch.Tensor | None = None
    # [b] bool: the greedy rows, whose probs are left out (zeros), so the wire packs them from
    # `tokens` in O(K) instead of scanning K x V probabilities; on the wire as the form of those
    # rows (wire.py's GREEDY, which a greedy row without a speculation does not need). None: not
    # known (the wire finds the form of every row by scanning).
    greedy: torch.Tensor | None = None
    # False when no drafter answered at all (every worker of a pool down): nothing to learn from.
    # Never on the wire: only the pool builds such a reply.
    answered: bool = True

    @classmethod
    def empty(
        cls, round_id: int, seq_ids: list[int], counters: DrafterCounters, answered: bool = True
    ) -> SpeculationReply:
        """A reply with no speculation for any row (num_draft 0: the target's fast backup)."""
        b = len(seq_ids)
        return cls(
            round_id,
            list(seq_ids),
            torch.zeros(b, dtype=torch.bool),
            torch.zeros(b, 0, dtype=torch.long),
            None,
            torch.zeros(b, dtype=torch.long),
            counters=counters,
            answered=answered,
        )


class DraftClient(Protocol):
    """What the SSD proposer calls, in this order per round: begin_round (the round being
    verified), resolve (its outcome, the moment it is known), reply (the next speculations);
    neural_backup when a row has nothing cached and the neural backup drafts it just in time; admit
    and release between rounds. Implemented by the drafter itself (TreeDrafter, in the caller's
    thread) and by a pool of workers (PoolClient), which raises DrafterUnavailable only when it
    cannot start."""

    def admit(self, msg: AdmitMsg) -> None: ...

    def release(self, msg: ReleaseMsg) -> None: ...

    def begin_round(self, msg: BeginRoundMsg) -> None:
        """Start building the next cache; returns at once where the drafter runs elsewhere."""

    def resolve(self, msg: ResolveMsg) -> None:
        """Send the round's outcome; the drafter answers it with reply()."""

    def reply(self, deadline_s: float) -> SpeculationReply:
        """The answer to the outcome resolve() sent last (waiting at most deadline_s)."""

    def neural_backup(self, msg: NeuralBackupMsg) -> SpeculationReply: ...

    def close(self) -> None: ...
