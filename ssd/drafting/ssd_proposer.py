"""The target side of SSD: speculations come from the drafter's cache, or from a backup.

Per round (engine order): propose() returns for every row the speculation prepared last round
(a cache hit, or a backup) and announces it to the drafter, which starts building the next
cache while the engine verifies; outcome_known() sends the outcomes as soon as verification
has them, and observe() receives the speculations for the next round. A drafter that fails or
misses its deadline is dropped with one log line and the target goes on alone with the fast
backup: fewer tokens per round, never wrong ones.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from ssd.drafting.budget import BudgetSizer
from ssd.drafting.ngram import NgramIndex, fast_speculation
from ssd.drafting.saguaro import (
    OnlineEstimates,
    backup_threshold,
    geometric_fanout,
    prefer_fast_backup,
    row_fanout,
    uniform_fanout,
)
from ssd.drafting.speculation import RoundOutcome, Source, Speculation
from ssd.engine.sampling import BatchSampling
from ssd.engine.sequence import Sequence
from ssd.transport.channel import DraftClient, DrafterUnavailable
from ssd.transport.messages import (
    RANK_DEPTH,
    AdmitMsg,
    BeginRoundMsg,
    DrafterCounters,
    DraftNowMsg,
    ReleaseMsg,
    ResolveMsg,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SSDConfig:
    k: int
    budget: int  # B: cached branches per sequence and round (the most, when autobudget)
    autobudget: bool  # size B so the drafter finishes within one verification (BudgetSizer)
    fanout: str  # "geometric" | "uniform"
    saguaro_c: float
    backup: str  # "auto" | "neural" | "fast"
    deadline_s: float  # how long observe() waits for the drafter's reply
    # Fan-out from the prior estimates, never the learned ones (which follow other requests'
    # history): with a fixed budget and backup, a seeded request's speculations depend on
    # nothing but its own state.
    reproducible: bool = False
    # D: draft workers sharing each round's branch grid; the fan-out covers D times the budget
    # (budget is one worker's share, what the sizer sizes against one verification).
    num_workers: int = 1


@dataclass
class _Prepared:
    tokens: list[int]  # the speculation: K tokens, or fewer when the drafter's tree was cut short
    probs: torch.Tensor  # [K, V] (rows past len(tokens) unused)
    source: Source


class _Ema:
    """Exponential moving average; a prior value, or (prior None) the first observation."""

    def __init__(self, value: float | None, weight: float = 0.05) -> None:
        self.value, self.weight, self.seen = (value or 0.0), weight, value is not None
        self.observed = False  # True once a real observation arrived (not just the prior)

    def update(self, x: float) -> None:
        self.value = self.value + self.weight * (x - self.value) if self.seen else x
        self.seen = self.observed = True

    def or_else(self, fallback: float) -> float:
        return self.value if self.observed else fallback


class SSDProposer:
    def __init__(self, client: DraftClient, config: SSDConfig, target_vocab: int) -> None:
        self.client = client
        self.config = config
        self.vocab = target_vocab
        self.estimates = OnlineEstimates()
        # Every miss-law observation so far, outcome k -> {F -> [sequence-rounds, of which in
        # the tree]}, for reports that fit the law over a whole run (ssd.bench.miss_law); never
        # reset. And k -> {bonus token's rank (RANK_DEPTH: that or beyond) -> sequence-rounds}.
        self.miss_law_counts: dict[int, dict[int, list[int]]] = {}
        self.miss_law_ranks: dict[int, dict[int, int]] = {}
        self.prepared: dict[int, _Prepared] = {}
        self.order: list[int] = []
        self.backup_rng: dict[int, torch.Generator] = {}
        self.ngram: dict[int, NgramIndex] = {}  # the fast backup's index of each sequence's tokens
        self.round_id = 0
        self.dead = False
        self.fanout: list[int] = []  # of the round being verified
        self.next_fanout: list[int] = []  # decided with the outcome, announced with the next round
        self.last_backup = config.backup if config.backup != "auto" else "neural"
        # Live figures for the backup choice (tokens per round; latency / verification time).
        self.p_hit, self.e_hit, self.e_neural, self.e_fast = _Ema(0.7), _Ema(3.0), _Ema(3.0), _Ema(1.5)
        self.t_primary, self.t_neural, self.t_fast = _Ema(1.0), _Ema(0.5), _Ema(0.01)
        self._sent_at = 0.0
        self._verify_s = 1e-6  # of the current round: from its announcement to its outcome
        self._resolve: ResolveMsg | None = None  # the current round's outcome, as sent
        self.build_ratio = _Ema(None, weight=0.1)  # drafter build time / verification time
        self.sizer = BudgetSizer(config.budget, min_budget=min(config.budget, config.k + 1))
        self.drafter_counters = DrafterCounters()  # as of the drafter's latest reply

    # ---- membership -------------------------------------------------------------------------

    def add(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            self.backup_rng[s.seq_id] = torch.Generator().manual_seed(
                int(torch.randint(2**62, (1,), generator=s.generator))
            )
            self.ngram[s.seq_id] = NgramIndex()  # filled on first use: most rows never need it
        self.order.extend(s.seq_id for s in seqs)
        if self.dead:
            return
        p = [s.params for s in seqs]
        msg = AdmitMsg(
            [s.seq_id for s in seqs],
            [list(s.prompt_ids) for s in seqs],
            [int(torch.randint(2**62, (1,), generator=self.backup_rng[s.seq_id])) for s in seqs],
            [x.temperature for x in p],
            [x.top_k for x in p],
            [x.top_p for x in p],
        )
        self._call(lambda: self.client.admit(msg))

    def keep(self, rows: torch.Tensor) -> None:
        kept = [self.order[i] for i in rows.tolist()]
        kept_set = set(kept)
        gone = [s for s in self.order if s not in kept_set]
        for s in gone:
            self.prepared.pop(s, None)
            self.backup_rng.pop(s, None)
            self.ngram.pop(s, None)
        self.order = kept
        if gone and not self.dead:
            self._call(lambda: self.client.release(ReleaseMsg(gone)))

    def close(self) -> None:
        self.client.close()

    def _call(self, fn):
        """Run a drafter call; on failure drop the drafter for good and return None."""
        if self.dead:
            return None
        try:
            return fn()
        except DrafterUnavailable as err:
            self.dead = True
            self.prepared = {s: p for s, p in self.prepared.items() if p.source == Source.FAST}
            logger.warning("draft worker unavailable (%s): continuing with the fast backup speculator only", err)
            return None

    # ---- the round ----------------------------------------------------------------------------

    def propose(self, seqs: list[Sequence], k: int, sampling: BatchSampling) -> Speculation:
        self.round_id += 1
        ids = [s.seq_id for s in seqs]
        missing = [r for r, s in enumerate(seqs) if s.seq_id not in self.prepared]
        if missing and not self.dead and self.last_backup == "neural":
            reply = self._call(
                lambda: self.client.draft_now(
                    DraftNowMsg(self.round_id, ids, [s.seq_id not in self.prepared for s in seqs])
                )
            )
            if reply is not None:
                for r in missing:
                    if int(reply.num_draft[r]) > 0:  # 0: no drafter could answer (the pool is refilling)
                        self.prepared[ids[r]] = _Prepared(reply.tokens[r].tolist(), reply.probs[r], Source.NEURAL)
        for s in seqs:
            if s.seq_id not in self.prepared:
                self.prepared[s.seq_id] = self._fast(s)
        chosen = [self.prepared.pop(i) for i in ids]
        num_draft = torch.tensor([min(len(c.tokens), k) for c in chosen], dtype=torch.long)  # [b]
        tokens = torch.tensor(
            [c.tokens[:k] + [0] * (k - len(c.tokens[:k])) for c in chosen], dtype=torch.long
        )  # [b, k]
        probs = torch.stack([c.probs[:k] for c in chosen])  # [b, k, V]
        spec = Speculation(tokens, probs, num_draft, torch.tensor([int(c.source) for c in chosen]))
        if not self.dead:
            self.fanout, self.next_fanout = self.next_fanout or self._fanout(), []
            msg = BeginRoundMsg(self.round_id, ids, tokens, spec.num_draft, self.fanout, [s.num_tokens for s in seqs])
            self._call(lambda: self.client.begin_round(msg))
        self._sent_at = time.perf_counter()
        return spec

    def outcome_known(self, seqs: list[Sequence], speculation: Speculation, outcome: RoundOutcome) -> None:
        """Send the outcome the moment verification decides it: the drafter stops its tree and
        answers while the engine does its bookkeeping. The backup for this round's misses and the
        next round's fan-out (sent along, so the drafter can begin that round at once) are chosen
        from the estimates of the rounds before (observe() adds this one)."""
        self._verify_s = max(time.perf_counter() - self._sent_at, 1e-6)
        self.last_backup = self._choose_backup(len(seqs))
        self.next_fanout = self._fanout()
        self._resolve = ResolveMsg(
            self.round_id,
            [s.seq_id for s in seqs],
            outcome.num_accepted,
            outcome.bonus_tokens,
            self.last_backup == "neural",
            self.next_fanout,
        )
        self._call(lambda: self.client.resolve(self._resolve))

    def observe(self, seqs: list[Sequence], speculation: Speculation, outcome: RoundOutcome) -> None:
        verify_s = self._verify_s
        batch = len(seqs)
        t0 = time.perf_counter()
        reply = self._call(lambda: self.client.reply(self._resolve, self.config.deadline_s))
        wait = time.perf_counter() - t0  # what the target waited, beyond its own bookkeeping
        accepted = outcome.num_accepted.tolist()
        drafted = speculation.num_draft.tolist()
        hit = reply.hit.tolist() if reply is not None else [False] * batch
        # The miss law is about the tree: whether the outcome was in the round's branch grid
        # (covered), whether or not the worker holding it was alive to deliver it.
        answered = reply is not None and reply.answered
        in_grid = reply.covered.tolist() if answered and reply.covered is not None else hit
        ranks = reply.bonus_rank.tolist() if answered and reply.bonus_rank is not None else [-1] * batch
        cap = min(RANK_DEPTH, sum(self.fanout))  # no fan-out of this round reaches past its whole budget
        for r, src in enumerate(speculation.source.tolist()):
            source = Source(src)
            {Source.CACHE: self.e_hit, Source.NEURAL: self.e_neural, Source.FAST: self.e_fast}.get(
                source, self.e_hit
            ).update(accepted[r] + 1)
            # a is the draft model's acceptance: n-gram and random tokens say nothing about it.
            if source != Source.FAST:
                self.estimates.observe_round(accepted[r], drafted[r])
            # The miss law relates this round's outcome to the fan-out the drafter cached for
            # it: the bonus token's rank among the candidates tells the hit at every fan-out;
            # without it, whether the outcome was in the tree tells the hit at this one (the
            # speculation's own source tells whether the previous round hit).
            if answered and self.fanout:
                fanout = row_fanout(self.fanout, drafted[r], self.vocab)[accepted[r]]  # what the drafters cached
                self._observe_miss_law(accepted[r], fanout, ranks[r], cap, in_grid[r])
        if answered and self.fanout:
            self.estimates.fit()
        hits = 0
        for r, s in enumerate(seqs):
            if hit[r]:
                hits += 1
                self.prepared[s.seq_id] = _Prepared(
                    reply.tokens[r, : int(reply.num_draft[r])].tolist(), reply.probs[r], Source.CACHE
                )
            elif reply is not None and int(reply.num_draft[r]) > 0:
                self.prepared[s.seq_id] = _Prepared(reply.tokens[r].tolist(), reply.probs[r], Source.NEURAL)
        if reply is not None:
            self.drafter_counters = reply.counters
            self.build_ratio.update(reply.build_seconds / verify_s)
            if self.config.autobudget and self.fanout:
                self.sizer.observe(sum(self.fanout) / self.config.num_workers, reply.build_seconds / verify_s)
            self.p_hit.update(hits / max(batch, 1))
            if hits == batch:
                self.t_primary.update(1.0 + wait / verify_s)
            elif self.last_backup == "neural":
                self.t_neural.update(wait / verify_s)
        t1 = time.perf_counter()
        for s in seqs:
            if s.seq_id not in self.prepared and not s.finished:
                self.prepared[s.seq_id] = self._fast(s)
        if self.last_backup == "fast" and len(seqs) > hits:
            self.t_fast.update((time.perf_counter() - t1) / verify_s)

    def _observe_miss_law(self, k: int, fanout: int, rank: int, cap: int, in_tree: bool) -> None:
        """One sequence-round's outcome k, the fan-out cached there, the bonus token's rank (-1:
        unknown, then whether the outcome was in the tree tells the law what it can)."""
        if rank >= 0:
            self.estimates.observe_rank(rank, cap)
            by_rank = self.miss_law_ranks.setdefault(k, {})
            by_rank[rank] = by_rank.get(rank, 0) + 1
        else:
            self.estimates.observe_hit(fanout, in_tree)
        count = self.miss_law_counts.setdefault(k, {}).setdefault(fanout, [0, 0])
        count[0] += 1
        count[1] += int(in_tree)

    def _fast(self, seq: Sequence) -> _Prepared:
        index = self.ngram[seq.seq_id]
        # Committed tokens are never taken back, so the index only needs the ones it has not seen.
        index.extend(seq.tokens_from(len(index)))
        found, probs = fast_speculation(index, self.config.k, self.vocab, self.backup_rng[seq.seq_id])
        return _Prepared(found, probs, Source.FAST)

    def _fanout(self) -> list[int]:
        # config.budget unless autobudget, per worker; at least one branch per worker
        k, budget = self.config.k, max(1, int(round(self.sizer.budget))) * self.config.num_workers
        caps = [self.vocab - 1] * k + [self.vocab]
        if self.config.fanout == "uniform":
            return uniform_fanout(budget, k, caps)
        estimates = OnlineEstimates() if self.config.reproducible else self.estimates
        return geometric_fanout(budget, k, estimates.a, estimates.r, caps)

    def _live(self) -> tuple[float, ...]:
        """(p_hit, e_hit, e_neural, t_neural, e_fast, t_fast, t_primary) for Theorem 17.

        A backup's figures only move while it is in use, so an unused neural backup keeps
        stand-ins from what the drafter shows every round: a just-in-time draft comes from the
        same model and state as a cached one (it earns about E_hit), and costs about one cache
        build at B = 1 (the sizer's fixed share, else the measured build ratio)."""
        t_neural_guess = self.sizer.c0 if self.sizer.c0 is not None else self.build_ratio.or_else(self.t_neural.value)
        return (
            self.p_hit.value,
            self.e_hit.value,
            self.e_neural.or_else(self.e_hit.value),
            self.t_neural.or_else(max(t_neural_guess, 0.0)),
            self.e_fast.value,
            self.t_fast.value,
            self.t_primary.value,
        )

    def _choose_backup(self, batch: int) -> str:
        if self.config.backup != "auto":
            return self.config.backup
        return "fast" if prefer_fast_backup(batch, *self._live()) else "neural"

    def stats(self) -> dict:
        live = self._live()
        return {
            "b_star": backup_threshold(*live),
            "tokens_per_round_on_hit": round(self.e_hit.value, 4),
            "fanout": self.fanout,
            "budget": sum(self.fanout),
            "draft_workers": self.config.num_workers,
            "acceptance_estimate": round(self.estimates.a, 4),
            "miss_exponent_estimate": round(self.estimates.r, 4),
            "miss_intercept_estimate": round(self.estimates.m, 4),
            "miss_law_counts": {
                k: {f: list(n) for f, n in sorted(c.items())} for k, c in sorted(self.miss_law_counts.items())
            },
            "miss_law_ranks": {k: dict(sorted(c.items())) for k, c in sorted(self.miss_law_ranks.items())},
            "backup": self.last_backup,
            "drafter_alive": not self.dead,
            "p_hit": round(self.p_hit.value, 4),
            "T_primary": round(self.t_primary.value, 4),
            "T_neural": round(self.t_neural.value, 4),
            **self.drafter_counters.as_dict(),
            **(self.client.stats() if hasattr(self.client, "stats") else {}),
        }
