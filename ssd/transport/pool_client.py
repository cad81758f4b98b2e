"""A target's client over its D draft workers: one `DraftClient` (ssd.core.protocol) that the SSD
proposer talks to as to one drafter.

Glossary:
    shard     one of the D places of the pool; shard w's worker builds shard w of every round's
              branch grid (branches n with n mod D = w, ssd/drafting/tree_drafter.py)
    link      the target's end of one worker (`WorkerLink`, link.py)
    provider  where links come from (`WorkerProvider`): worker processes this process starts
              (spawn.py), or workers leased from a shared pool (a provider passed in); acquire()
              blocks, discard() gives one back (killed, or its lease released and reported)

Every message goes to every attached shard, except the neural backup's requests (one shard per
round answers the rows no shard holds). The round and its outcome leave the target once: one
write to the pool's feed where its workers share one (shm_feed.py), else one encoding sent to
each. With the outcome the target looks up which shard holds each row's branch in the round's
grid (read off the workers' boards, board_reads.py, or sent by the first live shard as soon as
it has forked), names those (else the backup shard, the first live one) in RESOLVE, and takes
each hit off its worker's board or waits for that shard's reply alone: at batch 1, one answer a
round. A shard with no row sends nothing. Without a grid (its shard was lost before sending it)
every shard answers every row, and after an all-hit round each shard that did not hold all of
them is sent the next round (PREDICT), so it starts that build at once.

Faults: a link that fails (its worker died, errored, stalled past the deadline or sent a foreign
frame) is discarded at once and its shard counts as misses: the hits it held are lost, the
backup speculates, the output stays exact. A replacement is acquired in a background thread and
attached at the next round boundary: JOIN (its shard), ADMIT of every running sequence with the
tokens committed so far and seeds of its own, then the round. SSD never stays off for good.

Random streams: a sequence's drafter seed is mixed with the shard and the shard's incarnation,
so no two workers (nor a worker and its replacement) ever draw the same numbers; shard 0's first
worker keeps the seed unchanged, so a pool of one reproduces a single drafter exactly.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

from ssd.core.protocol import (
    AdmitMsg,
    BeginRoundMsg,
    DrafterCounters,
    DrafterUnavailable,
    GridMsg,
    JoinMsg,
    MsgType,
    NeuralBackupMsg,
    ReleaseMsg,
    ResolveMsg,
    SpeculationReply,
)
from ssd.transport.board_reads import board_grid, on_boards, read_hits
from ssd.transport.link import WorkerLink, WorkerProvider, announce
from ssd.transport.pool_state import PoolTally, SeqView, Shard, shard_seed
from ssd.transport.refills import Refills
from ssd.transport.rows import assemble, merge_shards, take
from ssd.transport.shm_board import BoardGrid
from ssd.transport.wire import HEADER, Encoded

logger = logging.getLogger(__name__)

BUILD_FRESH_ROUNDS = 16  # rounds a shard's build time stands for it in the merged reply's


class PoolClient:
    """`DraftClient` over D workers from a `WorkerProvider` (D = 1 is the default engine's drafter)."""

    def __init__(
        self,
        provider: WorkerProvider,
        num_workers: int,
        split: str = "outcomes",
        on_event: Callable[[str], None] | None = None,
    ) -> None:
        assert num_workers >= 1 and split in ("outcomes", "sequences")
        self.provider, self.d, self.split = provider, num_workers, split
        self.owner: dict[int, int] = {}  # split="sequences": the shard that drafts each sequence
        self.shards = [Shard() for _ in range(num_workers)]
        self.seqs: dict[int, SeqView] = {}
        self.order: list[int] = []
        self.round: BeginRoundMsg | None = None  # the round being verified
        self.outcome: ResolveMsg | None = None  # its outcome, once resolve() sent it
        self.round_key: int | None = None  # the round's BeginRoundMsg.board_key, where its grid is on boards
        self.board_parts: dict[int, SpeculationReply] = {}  # the outcome's hits read off boards (board_reads.py)
        self.refills = Refills(provider)
        self.tally = PoolTally(num_workers)
        self._on_event = on_event or (lambda _e: None)
        try:
            for w in range(num_workers):
                self._attach(w, provider.acquire())
        except BaseException:
            self.close()
            raise

    # ---- shards ---------------------------------------------------------------------------------

    def _attach(self, w: int, link: WorkerLink) -> None:
        """Make `link` shard w's worker and bring it up to date (between rounds only)."""
        shard = self.shards[w]
        shard.link, shard.answered, shard.build_s = link, False, 0.0
        # By sequence, a worker builds whole trees: every one is shard 0 of 1.
        link.join(JoinMsg(w, self.d) if self.split == "outcomes" else JoinMsg(0, 1))
        mine = [s for s in self.order if self.split == "outcomes" or self.owner[s] == w]
        if mine:
            views = [self.seqs[s] for s in mine]
            seeds = [shard_seed(v.seed, w, shard.incarnation) for v in views]
            link.admit(AdmitMsg(mine, [list(v.tokens) for v in views], seeds, [v.sampling for v in views]))

    def resplit(self, split: str) -> None:
        """Share the work `split`'s way from now on (draft_split: outcomes or sequences). Only with
        no sequence admitted (the proposer detached: every row released), as a worker joins a
        pool before any is: each live worker is sent its new place (JOIN), and the next ADMIT
        brings the rows back, split the new way."""
        assert split in ("outcomes", "sequences") and not self.order, (split, self.order)
        if split == self.split:
            return
        self.split, self.owner = split, {}
        self.tally.resplits += 1
        self._each(lambda w, link: link.join(JoinMsg(w, self.d) if split == "outcomes" else JoinMsg(0, 1)))

    def _fail(self, w: int, err: BaseException) -> None:
        shard = self.shards[w]
        link, shard.link = shard.link, None
        if link is None:
            return
        self.tally.lost(w, link)
        # A worker that fails before its first reply will likely fail again: back off.
        shard.backoff_s = 0.0 if shard.answered else min(max(0.5, 2 * shard.backoff_s), 30.0)
        logger.warning(
            "draft worker %s (shard %d of %d) lost: %s; its shard counts as misses until a replacement joins",
            link.name, w, self.d, err,
        )  # fmt: skip
        self._on_event(f"lost shard {w}")
        try:
            self.provider.discard(link, failed=True)
        except (RuntimeError, OSError) as discard_err:
            logger.error("could not discard draft worker %s: %s", link.name, discard_err)
        if not shard.refilling:
            shard.refilling = True
            self.refills.start(w, shard.backoff_s)

    def _attach_ready(self) -> None:
        for w, link in self.refills.take_ready():
            shard = self.shards[w]
            shard.refilling = False
            shard.incarnation += 1
            try:
                self._attach(w, link)
            except DrafterUnavailable as err:
                shard.link = link
                self._fail(w, err)
                continue
            self.tally.replacements += 1
            self._on_event(f"attached shard {w}")
            logger.info("draft worker %s joined shard %d of %d", link.name, w, self.d)

    def _each(self, fn: Callable[[int, WorkerLink], None]) -> None:
        for w, shard in enumerate(self.shards):
            if shard.link is not None:
                try:
                    fn(w, shard.link)
                except DrafterUnavailable as err:
                    self._fail(w, err)

    def live(self) -> int:
        return sum(s.link is not None for s in self.shards)

    def _part(self, w: int, msg):
        """What shard w is sent of `msg`: all of it when the pool splits outcomes, its own rows when
        it splits sequences (None: no row of its own)."""
        if self.split == "outcomes":
            return msg
        rows = [r for r, s in enumerate(msg.seq_ids) if self.owner.get(s) == w]
        return take(msg, rows) if rows else None

    def _backup_shard(self) -> int | None:
        """The shard that answers this round's neural-backup requests: the first live one."""
        return next((w for w, s in enumerate(self.shards) if s.link is not None), None)

    # ---- DraftClient ----------------------------------------------------------------------------

    def admit(self, msg: AdmitMsg) -> None:
        for s, tokens, seed, sampling in zip(msg.seq_ids, msg.tokens, msg.seeds, msg.sampling):
            self.seqs[s] = SeqView(list(tokens), int(seed), sampling)
            if self.split == "sequences":  # the least loaded shard, dead or alive: a replacement takes its rows over
                load = [0] * self.d
                for owner in self.owner.values():
                    load[owner] += 1
                self.owner[s] = load.index(min(load))
        self.order.extend(msg.seq_ids)

        def send(w: int, link: WorkerLink) -> None:
            part, inc = self._part(w, msg), self.shards[w].incarnation
            if part is not None:
                link.admit(dataclasses.replace(part, seeds=[shard_seed(int(x), w, inc) for x in part.seeds]))

        self._each(send)

    def release(self, msg: ReleaseMsg) -> None:
        self._each(lambda w, link: None if (part := self._part(w, msg)) is None else link.release(part))
        gone = set(msg.seq_ids)
        self.order = [s for s in self.order if s not in gone]
        for s in gone:
            self.seqs.pop(s, None)
            self.owner.pop(s, None)

    def begin_round(self, msg: BeginRoundMsg) -> None:
        started = time.perf_counter()
        self._attach_ready()
        # A round on its workers' boards has its grid read off them (board_reads.py): no GRID.
        self.round_key = (
            msg.board_key()
            if self.split == "outcomes" and self.d > 1 and on_boards(msg, self._boards(), self.live())
            else None
        )
        # Else a pool of shards that split outcomes asks its first live one for the grid (GRID).
        grid_shard = (
            self._backup_shard() if self.round_key is None and self.d > 1 and self.split == "outcomes" else None
        )
        if grid_shard is not None:
            msg = dataclasses.replace(msg, grid_shard=grid_shard)
        self.round, self.outcome = msg, None
        encoded = Encoded.of(MsgType.BEGIN_ROUND, msg) if self.split == "outcomes" else None  # once for all

        def send(w: int, link: WorkerLink) -> None:
            part = self._part(w, msg)
            if part is not None:
                link.begin_round(part, encoded)
            if w == grid_shard:  # before the other shards' sends, which on a torch pair each wait
                link.expect()

        if encoded is None or not self._announce(encoded, None):
            self._each(send)
        self.tally.round_s = time.perf_counter() - started

    def resolve(self, msg: ResolveMsg) -> None:
        started = time.perf_counter()
        rnd = self.round
        assert rnd is not None and rnd.round_id == msg.round_id, "resolve() without its begin_round()"
        grid = self._grid(rnd) if self.split == "outcomes" else None
        backup = self._backup_shard()  # after the grid's read, which may have lost its shard
        accepted, bonus = msg.num_accepted.tolist(), msg.bonus_tokens.tolist()
        self.board_parts = {}
        if self.split == "outcomes":
            # Each row's branch in the grid (-1: none), found once for the answers and the boards.
            branches = None if grid is None else grid.branches(accepted, bonus)
            answering, taken = self._answering(branches, backup), []
            if answering and self.round_key is not None:  # hits on their workers' boards: no reply to wait for
                greedy = [self.seqs[s].sampling.greedy for s in msg.seq_ids]
                hits = read_hits(rnd, answering, grid, branches, self._boards(), greedy, self.round_key)
                taken, self.board_parts = (hits.taken if hits.any else []), hits.parts
            msg = dataclasses.replace(
                msg, answering=answering, backup_shard=-1 if backup is None else backup, taken=taken
            )
        self.outcome = msg

        encoded = Encoded.of(MsgType.RESOLVE, msg) if self.split == "outcomes" else None  # once for all

        def send(w: int, link: WorkerLink) -> None:
            part = self._part(w, msg)
            if part is not None:
                link.resolve(part, answers=part.owes_reply(w), encoded=encoded)

        if encoded is None or not self._announce(encoded, msg):
            self._each(send)
        # The committed tokens, as every drafter records them (a replacement is admitted with them,
        # at the next round's start): after the sends, which the target's reply waits for.
        for s, spec, a, t in zip(msg.seq_ids, rnd.spec_tokens.tolist(), accepted, bonus, strict=True):
            self.seqs[s].tokens.extend(spec[:a] + [t])
        self.tally.round_s += time.perf_counter() - started

    def _announce(self, msg: Encoded, outcome: ResolveMsg | None) -> bool:
        """Send msg (the whole of it) to every live shard in one write to their feed, where they
        all read one (shm_feed.py): False where they do not (each is sent it in turn instead).
        outcome: the RESOLVE msg encodes, whose named shards owe a reply."""
        links = {w: s.link for w, s in enumerate(self.shards) if s.link is not None}
        writers = {None if link.feed is None else link.feed.writer for link in links.values()}
        if not links or len(writers) != 1 or None in writers:
            return False
        written, failed = announce(links, msg.kind, msg, outcome)
        if written:
            self.tally.announced.on_send(msg.kind, written - 8 * HEADER)
        for w, err in failed.items():
            self._fail(w, err)
        return True

    def _boards(self) -> list:
        """Each shard's board, None where it has none (a transport other than shm) or is lost."""
        return [None if s.link is None else s.link.board for s in self.shards]

    def _grid(self, rnd: BeginRoundMsg) -> GridMsg | BoardGrid | None:
        """The round's branch grid off its workers' boards, or from its grid shard (waited for,
        within the deadline); None where the round named none or its shard is lost."""
        live = next((s.link for s in self.shards if s.link is not None), None)
        if self.round_key is not None and live is not None:
            alive = lambda: any(s.link is not None and s.link.is_alive() for s in self.shards)  # noqa: E731
            grid = board_grid(self.round_key, self._boards(), live.deadline.total_seconds(), alive)
            self.tally.grids_missed += int(grid is None)
            return grid
        w = rnd.grid_shard
        link = self.shards[w].link if w >= 0 else None
        if link is None:
            self.tally.grids_missed += int(w >= 0)
            return None
        try:
            return link.grid(rnd.round_id, rnd.seq_ids)
        except DrafterUnavailable as err:
            self.tally.grids_missed += 1
            self._fail(w, err)
            return None

    def _answering(self, branches: list[int] | None, backup: int | None) -> list[int]:
        """[b] the shard that answers each row: the live one whose shard of the grid holds its
        outcome (branches [b]: its branch, -1 where none), else the backup shard. Empty (every
        shard answers every row) without a grid."""
        if branches is None or backup is None:
            return []
        holders = [n % self.d if n >= 0 else -1 for n in branches]
        return [w if w >= 0 and self.shards[w].link is not None else backup for w in holders]

    def reply(self, deadline_s: float) -> SpeculationReply:
        """The answers of the shards that owe one (those named for a row, else every live one) to
        the outcome resolve() sent, made one (rows.py)."""
        started = time.perf_counter()
        msg = self.outcome
        assert msg is not None, "reply() without its resolve()"
        replies: dict[int, SpeculationReply] = {}
        end = time.monotonic() + deadline_s
        owing = [w for w, shard in enumerate(self.shards) if shard.link is not None and shard.link.owed is not None]
        for w in owing:
            link = self.shards[w].link
            if link is None:  # lost while an earlier shard was read
                continue
            try:
                replies[w] = link.reply(max(end - time.monotonic(), 0.0))
            except DrafterUnavailable as err:
                self._fail(w, err)
        merged = self._merged(msg, replies)
        self.tally.round_done(len(owing), time.perf_counter() - started)
        return merged

    def _merged(self, msg: ResolveMsg, replies: dict[int, SpeculationReply]) -> SpeculationReply:
        """The replies made one; its build time is the slowest live shard's latest of the last
        BUILD_FRESH_ROUNDS rounds, which the budget is sized by (every shard's tree must fit the
        verification)."""
        for w, rep in replies.items():
            self.tally.replied(w, rep)
            shard = self.shards[w]
            shard.answered, shard.build_s, shard.build_round = True, rep.build_seconds, self.tally.rounds
        if len(replies) == 1 and self.d == 1:
            return next(iter(replies.values()))
        if self.split == "sequences":  # each worker predicts its own rows' next round: no hints
            merged = self._assemble(msg.round_id, msg.seq_ids, replies)
        else:
            for w in self.board_parts:
                self.tally.read_off_board(w, sum(a == w and t > 0 for a, t in zip(msg.answering, msg.taken)))
            merged = merge_shards(msg, [*self.board_parts.values(), *replies.values()], self.counters())
            if not msg.answering:
                self._hint(msg, merged, replies)
        live = [s for s in self.shards if s.link is not None]
        fresh = [s.build_s for s in live if self.tally.rounds - s.build_round < BUILD_FRESH_ROUNDS]
        return dataclasses.replace(merged, build_seconds=max([merged.build_seconds, *fresh]))

    def _hint(self, msg: ResolveMsg, merged: SpeculationReply, replies: dict[int, SpeculationReply]) -> None:
        """After an all-hit round, tell each shard that did not hold every hit which round comes
        next (a shard that held every hit predicts it itself), so all begin building at once."""
        if self.round is None or not msg.next_fanout or not bool(merged.hit.all()):
            return
        nxt = BeginRoundMsg.after_reply(msg, merged, [len(self.seqs[s].tokens) for s in msg.seq_ids])

        def send(w: int, link: WorkerLink) -> None:
            if w in replies and not bool(replies[w].hit.all()):
                link.predict(nxt)
                self.tally.hints += 1

        self._each(send)

    def _assemble(self, round_id: int, seq_ids: list[int], replies: dict[int, SpeculationReply]) -> SpeculationReply:
        rows = {s: r for r, s in enumerate(seq_ids)}
        parts = [([rows[s] for s in rep.seq_ids], rep) for rep in replies.values()]
        k = max((rep.tokens.shape[1] for rep in replies.values()), default=0)
        return assemble(round_id, list(seq_ids), parts, k, self.counters())

    def neural_backup(self, msg: NeuralBackupMsg) -> SpeculationReply:
        self._attach_ready()
        if self.split == "sequences":
            replies = {}
            for w, shard in enumerate(self.shards):
                part = self._part(w, msg) if shard.link is not None else None
                if part is not None and any(part.need):
                    try:
                        replies[w] = shard.link.neural_backup(part)
                    except DrafterUnavailable as err:
                        self._fail(w, err)
            return self._assemble(msg.round_id, msg.seq_ids, replies)
        while (w := self._backup_shard()) is not None:
            try:
                return self.shards[w].link.neural_backup(msg)
            except DrafterUnavailable as err:
                self._fail(w, err)
        return SpeculationReply.empty(msg.round_id, msg.seq_ids, self.counters())

    # ---- figures and lifetime -------------------------------------------------------------------

    def counters(self) -> DrafterCounters:
        return self.tally.counters()

    def stats(self) -> dict:
        return {**self.tally.stats([s.link for s in self.shards if s.link is not None]), "draft_split": self.split}

    def close(self) -> None:
        self.refills.close()
        for shard in self.shards:
            link, shard.link = shard.link, None
            if link is not None:
                self.provider.discard(link, failed=False)
        self.provider.close()
