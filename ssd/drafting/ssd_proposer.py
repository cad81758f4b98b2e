"""The target side of SSD: speculations come from the drafter's cache, or from a backup.

Per round (engine order): propose() returns for every row the speculation prepared last round
(a cache hit, or a backup) and announces it to the drafter, which starts building the next
cache while the engine verifies; outcome_known() sends the outcomes as soon as verification
has them, and observe() receives the speculations for the next round. A drafter that misses
its deadline or fails counts as misses (the pool, ssd/transport/pool_client.py, replaces it):
the backup speculates, fewer tokens per round, never wrong ones.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ssd.core.config import EngineConfig
from ssd.core.proposer import Proposer
from ssd.core.protocol import (
    RANK_DEPTH,
    AdmitMsg,
    BeginRoundMsg,
    DraftClient,
    DrafterCounters,
    NeuralBackupMsg,
    ReleaseMsg,
    ResolveMsg,
    SpeculationReply,
)
from ssd.core.sampling import BatchSampling
from ssd.core.sequence import Sequence
from ssd.core.speculation import RoundOutcome, Source, Speculation
from ssd.drafting.backup_choice import BackupChoice
from ssd.drafting.budget import BudgetSizer
from ssd.drafting.ngram import NgramIndex, fast_speculation
from ssd.drafting.saguaro import OnlineEstimates, geometric_fanout, marginal_fanout, row_fanout, uniform_fanout

# The miss law is refitted once in this many learned rounds (and at the first). A fit is a grid
# likelihood over the last 256 observations, about 0.3 ms on the development CPU: refitted every
# round it sat between the drafter's reply and the next announcement, 5% of a batch-1 round,
# while a few rounds' observations move it little.
MISS_LAW_REFIT_ROUNDS = 8


@dataclass
class _Prepared:
    tokens: list[int]  # the speculation: K tokens, or fewer when the drafter's tree was cut short
    # [K, V] (rows past len(tokens) unused); None for a greedy row, whose verification reads none
    probs: torch.Tensor | None
    source: Source


class SSDProposer(Proposer):
    """config: the engine's (k, ssd_budget, ssd_autobudget, ssd_fanout, ssd_backup,
    ssd_reproducible, draft_deadline_s, draft_workers, draft_split); client: the drafter, wherever it
    runs (a pool of draft_workers > 1 can be resplit between rounds: splits, resplit)."""

    def __init__(self, client: DraftClient, config: EngineConfig, target_vocab: int) -> None:
        self.client = client
        self.config = config
        self.vocab = target_vocab
        self.estimates = OnlineEstimates()
        # Every miss-law observation so far, outcome's accepted count -> {F -> [sequence-rounds, of
        # which in the tree]}, for reports that fit the law over a whole run (benchmarks.miss_law);
        # never reset. And accepted count -> {bonus token's rank (RANK_DEPTH: that or beyond) ->
        # sequence-rounds}.
        self.miss_law_counts: dict[int, dict[int, list[int]]] = {}
        self.miss_law_ranks: dict[int, dict[int, int]] = {}
        self.prepared: dict[int, _Prepared] = {}
        self.order: list[int] = []
        self.attached = True  # the drafters hold the rows in `order` (False: detached, mode auto)
        self.backup_rng: dict[int, torch.Generator] = {}
        self.ngram: dict[int, NgramIndex] = {}  # the fast backup's index of each sequence's tokens
        self.round_id = 0
        self.fanout: list[int] = []  # of the round being verified
        self.next_fanout: list[int] = []  # decided with the outcome, announced with the next round
        self.backup = BackupChoice(config.ssd_backup)
        self._sent_at = 0.0
        self._verify_s = 1e-6  # of the current round: from its announcement to its outcome
        budget = config.ssd_budget
        self.sizer = BudgetSizer(budget, min_budget=min(budget, config.k + 1))
        self.drafter_counters = DrafterCounters()  # as of the drafter's latest reply
        self._learned_rounds = 0  # rounds that fed the miss law (it is refitted every MISS_LAW_REFIT_ROUNDS)
        self.split = config.first_split  # how the pool's workers share the work (config.draft_split)
        self.tree_shards = config.tree_shards(self.split)  # workers that build one sequence's tree

    # ---- membership -------------------------------------------------------------------------

    def add(self, seqs: list[Sequence]) -> None:
        """New rows at the batch's end; the drafters admit them now, or at rejoin() if detached."""
        for s in seqs:
            self.backup_rng[s.seq_id] = torch.Generator().manual_seed(
                int(torch.randint(2**62, (1,), generator=s.generator))
            )
            self.ngram[s.seq_id] = NgramIndex()  # filled on first use: most rows never need it
        self.order.extend(s.seq_id for s in seqs)
        if self.attached:
            self._admit(seqs)

    def _admit(self, seqs: list[Sequence]) -> None:
        """The drafters admit `seqs` with every token they have committed (a new sequence: its
        prompt), each with a seed from its backup generator."""
        self.client.admit(
            AdmitMsg(
                [s.seq_id for s in seqs],
                [s.tokens_from(0) for s in seqs],
                [int(torch.randint(2**62, (1,), generator=self.backup_rng[s.seq_id])) for s in seqs],
                [s.sampling for s in seqs],
            )
        )

    def keep(self, rows: torch.Tensor) -> None:
        kept = [self.order[i] for i in rows.tolist()]
        kept_set = set(kept)
        gone = [s for s in self.order if s not in kept_set]
        for s in gone:
            self.prepared.pop(s, None)
            self.backup_rng.pop(s, None)
            self.ngram.pop(s, None)
        self.order = kept
        if gone and self.attached:
            self.client.release(ReleaseMsg(gone))

    def detach(self) -> None:
        """Rounds of another mode follow (mode auto): the drafters drop their state of every row
        now, rather than keep it and admit every new row while nothing reads their trees (on shared
        cores, that work slows the rounds that run). Until rejoin(), rows come and go here only."""
        if not self.attached:
            return
        self.attached = False
        self.prepared.clear()
        self.next_fanout = []
        if self.order:
            self.client.release(ReleaseMsg(list(self.order)))

    def rejoin(self, seqs: list[Sequence]) -> None:
        """SSD's rounds resume after detach(): the drafters admit the running sequences with every
        committed token (one prefill each)."""
        assert not self.attached, "rejoin() after detach()"
        assert [s.seq_id for s in seqs] == self.order, "rejoin() with the batch the proposer holds"
        self.attached = True
        self._admit(seqs)

    def splits(self) -> tuple[str, ...]:
        """The ways the drafters may share the work, the one in use first: a pool of more than one
        worker splits the outcomes or the sequences; a single drafter has no choice (())."""
        if self.config.draft_workers < 2 or not hasattr(self.client, "resplit"):
            return ()
        return (self.split, *(s for s in ("outcomes", "sequences") if s != self.split))

    def resplit(self, split: str) -> None:
        """Share the work `split`'s way from the next rejoin() on (while detached: no row held)."""
        assert not self.attached, "resplit() between detach() and rejoin()"
        self.client.resplit(split)
        self.split, self.tree_shards = split, self.config.tree_shards(split)

    def close(self) -> None:
        self.client.close()

    # ---- the round ----------------------------------------------------------------------------

    def propose(self, seqs: list[Sequence], k: int, sampling: BatchSampling) -> Speculation:
        self.round_id += 1
        ids = [s.seq_id for s in seqs]
        if self.backup.last == "neural" and any(i not in self.prepared for i in ids):
            self._neural_backup(ids)
        for s in seqs:
            if s.seq_id not in self.prepared:
                self.prepared[s.seq_id] = self._fast(s)
        chosen = [self.prepared.pop(i) for i in ids]
        num_draft = torch.tensor([min(len(c.tokens), k) for c in chosen], dtype=torch.long)  # [b]
        tokens = torch.tensor(
            [c.tokens[:k] + [0] * (k - len(c.tokens[:k])) for c in chosen], dtype=torch.long
        )  # [b, k]
        # A batch of greedy rows verifies without draft probabilities: no [b, k, V] to stack.
        probs = None if bool(sampling.greedy.all()) else self._stacked(chosen, k)  # [b, k, V]
        spec = Speculation(tokens, probs, num_draft, torch.tensor([int(c.source) for c in chosen]))
        self.fanout, self.next_fanout = self.next_fanout or self._fanout(), []
        committed = [s.num_tokens for s in seqs]
        self.client.begin_round(BeginRoundMsg(self.round_id, ids, tokens, spec.num_draft, self.fanout, committed))
        self._sent_at = time.perf_counter()
        return spec

    def _stacked(self, chosen: list[_Prepared], k: int) -> torch.Tensor:
        """The rows' draft distributions [b, k, V] for verification; a greedy row's are zeros."""
        none = torch.zeros(k, self.vocab)
        return torch.stack([none if c.probs is None else c.probs[:k] for c in chosen])

    def _neural_backup(self, ids: list[int]) -> None:
        """The neural backup: the draft drafts the rows with nothing prepared, just in time."""
        reply = self.client.neural_backup(NeuralBackupMsg(self.round_id, ids, [i not in self.prepared for i in ids]))
        for r, i in enumerate(ids):
            # num_draft 0: no drafter could answer (the pool is refilling)
            if i not in self.prepared and int(reply.num_draft[r]) > 0:
                self.prepared[i] = _Prepared(reply.tokens[r].tolist(), _row(reply.probs, r), Source.NEURAL)

    def outcome_known(self, seqs: list[Sequence], speculation: Speculation, outcome: RoundOutcome) -> None:
        """Send the outcome the moment verification decides it: the drafter stops its tree and
        answers while the engine does its bookkeeping. The backup for this round's misses and the
        next round's fan-out (sent along, so the drafter can begin that round at once) are chosen
        from the estimates of the rounds before (observe() adds this one)."""
        self._verify_s = max(time.perf_counter() - self._sent_at, 1e-6)
        backup = self.backup.choose(_greedy(seqs), self.sizer.c0)
        self.next_fanout = self._fanout()
        ids = [s.seq_id for s in seqs]
        self.client.resolve(
            ResolveMsg(
                self.round_id, ids, outcome.num_accepted, outcome.bonus_tokens, backup == "neural", self.next_fanout
            )
        )

    def observe(self, seqs: list[Sequence], speculation: Speculation, outcome: RoundOutcome) -> None:
        """The drafter's answer to this round's outcome: what it says about acceptance and the miss
        law, the speculations it prepared, and what it cost; the fast backup for the rest."""
        t0 = time.perf_counter()
        reply = self.client.reply(self.config.draft_deadline_s)
        wait = time.perf_counter() - t0  # what the target waited, beyond its own bookkeeping
        greedy = _greedy(seqs)
        self._learn(speculation, outcome, reply, greedy)
        hits = self._store(seqs, reply)
        self._time(reply, greedy, wait)
        t1 = time.perf_counter()
        for s in seqs:
            if s.seq_id not in self.prepared and not s.finished:
                self.prepared[s.seq_id] = self._fast(s)
        if self.backup.last == "fast" and len(seqs) > hits:
            self.backup.observe_fast((time.perf_counter() - t1) / self._verify_s)

    def _learn(
        self, speculation: Speculation, outcome: RoundOutcome, reply: SpeculationReply, greedy: list[bool]
    ) -> None:
        """Acceptance a, the miss law (m, r) and tokens per round by source, from this round."""
        accepted, drafted = outcome.num_accepted.tolist(), speculation.num_draft.tolist()
        # The miss law is about the tree: whether the outcome was in the round's branch grid
        # (covered), whether or not the worker holding it was alive to deliver it.
        learn = reply.answered and bool(self.fanout)
        b = len(accepted)
        in_grid = (reply.covered if reply.covered is not None else reply.hit).tolist() if learn else []
        ranks = reply.bonus_rank.tolist() if learn and reply.bonus_rank is not None else [-1] * b
        cap = min(RANK_DEPTH, sum(self.fanout))  # no fan-out of this round reaches past its whole budget
        for r, src in enumerate(speculation.source.tolist()):
            source = Source(src)
            self.backup.observe_tokens(source, accepted[r] + 1, greedy[r])
            # a is the draft model's acceptance: n-gram and random tokens say nothing about it.
            if source != Source.FAST:
                self.estimates.observe_round(accepted[r], drafted[r])
            if learn:
                fanout = row_fanout(self.fanout, drafted[r], self.vocab)[accepted[r]]  # what the drafters cached
                self._observe_miss_law(accepted[r], fanout, ranks[r], cap, in_grid[r])
        if learn:
            self._learned_rounds += 1
            if (self._learned_rounds - 1) % MISS_LAW_REFIT_ROUNDS == 0:
                self.estimates.fit()

    def _observe_miss_law(self, accepted: int, fanout: int, rank: int, cap: int, in_tree: bool) -> None:
        """One sequence-round's outcome (its accepted count), the fan-out cached there and the bonus
        token's rank: the rank tells the hit at every fan-out; unknown (-1), whether the outcome
        was in the tree tells the hit at this one."""
        if rank >= 0:
            self.estimates.observe_rank(rank, cap)
            by_rank = self.miss_law_ranks.setdefault(accepted, {})
            by_rank[rank] = by_rank.get(rank, 0) + 1
        else:
            self.estimates.observe_hit(fanout, in_tree)
        count = self.miss_law_counts.setdefault(accepted, {}).setdefault(fanout, [0, 0])
        count[0] += 1
        count[1] += int(in_tree)

    def _store(self, seqs: list[Sequence], reply: SpeculationReply) -> int:
        """The reply's speculations as next round's, for hits and neural backups; -> the hits."""
        hits = 0
        for r, s in enumerate(seqs):
            if bool(reply.hit[r]):
                hits += 1
                tokens = reply.tokens[r, : int(reply.num_draft[r])].tolist()
                self.prepared[s.seq_id] = _Prepared(tokens, _row(reply.probs, r), Source.CACHE)
            elif int(reply.num_draft[r]) > 0:
                self.prepared[s.seq_id] = _Prepared(reply.tokens[r].tolist(), _row(reply.probs, r), Source.NEURAL)
        return hits

    def _time(self, reply: SpeculationReply, greedy: list[bool], wait: float) -> None:
        """What the round cost, relative to its verification: the drafter's build (the budget
        sizer's input) and the target's wait (the backup choice's)."""
        self.drafter_counters = reply.counters
        build = reply.build_seconds / self._verify_s
        if self.config.ssd_autobudget and self.fanout:
            self.sizer.observe(sum(self.fanout) / self.tree_shards, build)
        self.backup.observe_reply([bool(h) for h in reply.hit.tolist()], greedy, build, wait / self._verify_s)

    def _fast(self, seq: Sequence) -> _Prepared:
        index = self.ngram[seq.seq_id]
        # Committed tokens are never taken back, so the index only needs the ones it has not seen.
        index.extend(seq.tokens_from(len(index)))
        greedy = seq.params.greedy  # its verification reads no draft distribution
        found, probs = fast_speculation(index, self.config.k, self.vocab, self.backup_rng[seq.seq_id], not greedy)
        return _Prepared(found, probs, Source.FAST)

    def _fanout(self) -> list[int]:
        # ssd_budget unless autobudget, per shard; at least one branch per shard
        k, budget = self.config.k, max(1, int(round(self.sizer.budget))) * self.tree_shards
        caps = [self.vocab - 1] * k + [self.vocab]
        if self.config.ssd_fanout == "uniform":
            return uniform_fanout(budget, k, caps)
        estimates = OnlineEstimates() if self.config.ssd_reproducible else self.estimates
        if self.config.ssd_fanout == "marginal":
            return marginal_fanout(budget, k, estimates.a, estimates.m, estimates.r, caps)
        return geometric_fanout(budget, k, estimates.a, estimates.r, caps)

    def stats(self) -> dict:
        return {
            **self.backup.stats(self.sizer.c0),
            "fanout": self.fanout,
            "tree_branches": sum(self.fanout),  # the round's, over every shard (per worker: ssd_budget)
            "tree_shards": self.tree_shards,
            "acceptance_estimate": round(self.estimates.a, 4),
            "miss_exponent_estimate": round(self.estimates.r, 4),
            "miss_intercept_estimate": round(self.estimates.m, 4),
            "miss_law_counts": {
                j: {f: list(n) for f, n in sorted(c.items())} for j, c in sorted(self.miss_law_counts.items())
            },
            "miss_law_ranks": {j: dict(sorted(c.items())) for j, c in sorted(self.miss_law_ranks.items())},
            **self.drafter_counters.as_dict(),
            **(self.client.stats() if hasattr(self.client, "stats") else {}),
        }


def _greedy(seqs: list[Sequence]) -> list[bool]:
    """Whether each row is greedy: the backup choice keeps its figures by that (backup_choice.py)."""
    return [s.params.greedy for s in seqs]


def _row(probs: torch.Tensor | None, r: int) -> torch.Tensor | None:
    """Row r [K, V] of a reply's probs [b, K, V] (None: the reply carries none, every row greedy)."""
    return None if probs is None else probs[r]
