"""A pool of D draft workers behind one `DraftClient`: the SSD proposer talks to it as to one drafter.

Glossary:
    slot      one of the D places of the pool; slot w builds share w of every round's branch
              grid (branches n with n mod D = w, ssd/drafting/drafter.py)
    link      the target's end of one worker (`ProcessClient` or `RemoteClient`, ssd/transport/draft_process.py)
    source    where links come from (`WorkerSource`): worker processes this process starts, or
              workers leased from a shared pool (actors/); acquire() blocks, discard() gives
              one back (killed, or its lease released and reported)
    holder    the slot whose reply carries a row's hit

Every message goes to every attached slot, except the neural backup's requests (one slot per
round answers the rows no share holds) and PREDICT hints. After a round in which every row hit,
each slot that did not hold all of them is sent the next round as the target will announce it
(PREDICT), so it starts that build now, as the holder of every hit does on its own.

Faults: a link that fails (its worker died, errored, stalled past the deadline or sent a foreign
frame) is discarded at once and its slot counts as misses: the hits it held are lost, the
backup speculates, the output stays exact. A replacement is acquired in a background thread and
attached at the next round boundary: JOIN (its slot), ADMIT of every running sequence with the
tokens committed so far and seeds of its own, then the round. SSD never stays off for good.

Random streams: a sequence's drafter seed is mixed with the slot and the slot's incarnation, so
no two workers (nor a worker and its replacement) ever draw the same numbers; slot 0's first
worker keeps the seed unchanged, so a pool of one reproduces a single drafter exactly.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ssd.transport.channel import DrafterUnavailable, WorkerLink, WorkerSource
from ssd.transport.messages import (
    AdmitMsg,
    BeginRoundMsg,
    DrafterCounters,
    DraftNowMsg,
    ReleaseMsg,
    ResolveMsg,
    SpeculationReply,
)
from ssd.transport.rows import assemble, take
from ssd.transport.wire import WireCounts

logger = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1
CLOSE_REFILL_WAIT_S = 120.0  # a worker being started when the pool closes: its model load, then READY


def slot_seed(seed: int, slot: int, incarnation: int) -> int:
    """A seed for the drafter of `slot` that no other slot or incarnation shares (splitmix64)."""
    if slot == 0 and incarnation == 0:
        return seed
    z = (seed + 0x9E3779B97F4A7C15 * (1 + slot + (incarnation << 20))) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 2  # 62 bits, like the seeds the proposer draws


@dataclass
class _SeqView:
    """What a replacement worker needs to take a sequence over."""

    tokens: list[int]  # committed, as the drafters know them
    seed: int
    temperature: float
    top_k: int
    top_p: float


@dataclass
class _Slot:
    link: WorkerLink | None = None
    incarnation: int = 0  # workers this slot has had (seeds differ per incarnation)
    refilling: bool = False
    resolved: ResolveMsg | None = None  # the outcome this slot was sent this round (it owes a reply)
    answered: bool = False  # its current worker has delivered a reply
    backoff_s: float = 0.0  # wait before acquiring the next worker (grows while workers fail at once)


class DraftPool:
    """`DraftClient` over D workers from a `WorkerSource` (D = 1 is the default engine's drafter)."""

    def __init__(
        self,
        source: WorkerSource,
        num_workers: int,
        deadline_s: float,
        split: str = "outcomes",
        on_event: Callable[[str], None] | None = None,
    ) -> None:
        assert num_workers >= 1 and split in ("outcomes", "sequences")
        self.source, self.d, self.deadline_s, self.split = source, num_workers, deadline_s, split
        self.owner: dict[int, int] = {}  # split="sequences": the slot that drafts each sequence
        self.slots = [_Slot() for _ in range(num_workers)]
        self.seqs: dict[int, _SeqView] = {}
        self.order: list[int] = []
        self.round: BeginRoundMsg | None = None
        self._ready: list[tuple[int, WorkerLink]] = []  # replacements waiting for a round boundary
        self._lock = threading.Lock()
        self._closed = False
        self._closing = threading.Event()  # wakes refills that are waiting to retry
        self._refills: list[
            threading.Thread
        ] = []  # close() waits for them: a worker one starts must not outlive the pool
        self.failures = 0  # links lost since the start
        self.replacements = 0  # links attached after a failure
        self.rejected_replies = 0  # stale or duplicated replies dropped (links that are gone included)
        self._retired = DrafterCounters()  # counters of links that are gone
        self._retired_wire = WireCounts()  # frame bytes of links that are gone
        self._latest: dict[int, DrafterCounters] = {}  # per slot, as of its latest reply
        self.slot_hits = [0] * num_workers  # rows whose hit each slot held
        self.hints = 0  # PREDICT messages sent
        self._on_event = on_event or (lambda _e: None)
        try:
            for w in range(num_workers):
                self._attach(w, source.acquire())
        except BaseException:
            self.close()
            raise

    # ---- slots ----------------------------------------------------------------------------------

    def _attach(self, w: int, link: WorkerLink) -> None:
        """Make `link` slot w's worker and bring it up to date (between rounds only)."""
        slot = self.slots[w]
        slot.link, slot.resolved, slot.answered = link, None, False
        link.join(*((w, self.d) if self.split == "outcomes" else (0, 1)))  # by sequence, a worker builds whole trees
        mine = [s for s in self.order if self.split == "outcomes" or self.owner[s] == w]
        if mine:
            views = [self.seqs[s] for s in mine]
            link.admit(
                AdmitMsg(
                    mine,
                    [list(v.tokens) for v in views],
                    [slot_seed(v.seed, w, slot.incarnation) for v in views],
                    [v.temperature for v in views],
                    [v.top_k for v in views],
                    [v.top_p for v in views],
                )
            )

    def _fail(self, w: int, err: BaseException) -> None:
        slot = self.slots[w]
        link, slot.link, slot.resolved = slot.link, None, None
        if link is None:
            return
        self.failures += 1
        # A worker that fails before its first reply will likely fail again: back off.
        slot.backoff_s = 0.0 if slot.answered else min(max(0.5, 2 * slot.backoff_s), 30.0)
        self.rejected_replies += link.rejected
        self._retired_wire = self._retired_wire + link.wire
        self._retired = self._retired + self._latest.pop(w, DrafterCounters())
        logger.warning(
            "draft worker %s (slot %d of %d) lost: %s; its share counts as misses until a replacement joins",
            link.name,
            w,
            self.d,
            err,
        )
        self._on_event(f"lost slot {w}")
        try:
            self.source.discard(link, failed=True)
        except (RuntimeError, OSError) as discard_err:
            logger.error("could not discard draft worker %s: %s", link.name, discard_err)
        self._refill(w)

    def _refill(self, w: int) -> None:
        slot = self.slots[w]
        if slot.refilling or self._closed:
            return
        slot.refilling = True

        def acquire() -> None:
            if self._closing.wait(slot.backoff_s):
                return
            delay = 0.5
            while not self._closed:
                try:
                    link = self.source.acquire()
                except DrafterUnavailable as err:
                    logger.warning("no replacement for draft slot %d yet (%s); retrying in %.1f s", w, err, delay)
                    if self._closing.wait(delay):
                        return
                    delay = min(delay * 2, 30.0)
                    continue
                with self._lock:
                    if self._closed:
                        self.source.discard(link, failed=False)
                    else:
                        self._ready.append((w, link))
                return

        thread = threading.Thread(target=acquire, name=f"ssd-draft-refill-{w}", daemon=True)
        self._refills.append(thread)
        thread.start()

    def _attach_ready(self) -> None:
        with self._lock:
            ready, self._ready = self._ready, []
        for w, link in ready:
            slot = self.slots[w]
            slot.refilling = False
            slot.incarnation += 1
            try:
                self._attach(w, link)
            except DrafterUnavailable as err:
                slot.link = link
                self._fail(w, err)
                continue
            self.replacements += 1
            self._on_event(f"attached slot {w}")
            logger.info("draft worker %s joined slot %d of %d", link.name, w, self.d)

    def _each(self, fn: Callable[[int, WorkerLink], None]) -> None:
        for w, slot in enumerate(self.slots):
            if slot.link is not None:
                try:
                    fn(w, slot.link)
                except DrafterUnavailable as err:
                    self._fail(w, err)

    def live(self) -> int:
        return sum(s.link is not None for s in self.slots)

    # ---- DraftClient ----------------------------------------------------------------------------

    def _part(self, w: int, msg):
        """What slot w is sent of `msg`: all of it when the pool splits outcomes, its own rows when
        it splits sequences (None: no row of its own)."""
        if self.split == "outcomes":
            return msg
        rows = [r for r, s in enumerate(msg.seq_ids) if self.owner.get(s) == w]
        return take(msg, rows) if rows else None

    def admit(self, msg: AdmitMsg) -> None:
        for i, s in enumerate(msg.seq_ids):
            self.seqs[s] = _SeqView(
                list(msg.prompts[i]),
                int(msg.seeds[i]),
                float(msg.temperature[i]),
                int(msg.top_k[i]),
                float(msg.top_p[i]),
            )
            if self.split == "sequences":  # the least loaded slot, dead or alive: a replacement takes its rows over
                load = [0] * self.d
                for owner in self.owner.values():
                    load[owner] += 1
                self.owner[s] = load.index(min(load))
        self.order.extend(msg.seq_ids)

        def send(w: int, link: WorkerLink) -> None:
            part, inc = self._part(w, msg), self.slots[w].incarnation
            if part is not None:
                link.admit(dataclasses.replace(part, seeds=[slot_seed(int(x), w, inc) for x in part.seeds]))

        self._each(send)

    def release(self, msg: ReleaseMsg) -> None:
        def send(w: int, link: WorkerLink) -> None:
            part = self._part(w, msg)
            if part is not None:
                link.release(part)

        self._each(send)
        gone = set(msg.seq_ids)
        self.order = [s for s in self.order if s not in gone]
        for s in gone:
            self.seqs.pop(s, None)
            self.owner.pop(s, None)

    def begin_round(self, msg: BeginRoundMsg) -> None:
        self._attach_ready()
        self.round = msg

        def send(w: int, link: WorkerLink) -> None:
            part = self._part(w, msg)
            if part is not None:
                link.begin_round(part)

        self._each(send)

    def _backup_slot(self) -> int | None:
        """The slot that answers this round's neural-backup requests: the first live one."""
        return next((w for w, s in enumerate(self.slots) if s.link is not None), None)

    def resolve(self, msg: ResolveMsg) -> None:
        rnd = self.round
        assert rnd is not None and rnd.round_id == msg.round_id, "resolve() without its begin_round()"
        for r, s in enumerate(msg.seq_ids):  # the committed tokens, as every drafter records them
            acc = int(msg.num_accepted[r])
            self.seqs[s].tokens.extend(rnd.spec_tokens[r, :acc].tolist() + [int(msg.bonus_tokens[r])])
        backup = self._backup_slot()

        def send(w: int, link: WorkerLink) -> None:
            part = self._part(w, msg)
            self.slots[w].resolved = None
            if part is None:
                return
            # Split by outcome, one slot drafts the rows no share covers; by sequence, each its own.
            part = part if w == backup or self.split == "sequences" else dataclasses.replace(part, neural_backup=False)
            link.resolve(part)
            self.slots[w].resolved = part

        self._each(send)

    def reply(self, msg: ResolveMsg, deadline_s: float) -> SpeculationReply:
        """Every live slot's answer, merged: a row's speculation comes from its holder, else from
        the backup slot's just-in-time draft, else none (num_draft 0: the target's fast backup)."""
        replies: dict[int, SpeculationReply] = {}
        end = time.monotonic() + deadline_s
        for w, slot in enumerate(self.slots):
            if slot.link is None or slot.resolved is None:
                continue
            sent, slot.resolved = slot.resolved, None
            try:
                replies[w] = slot.link.reply(sent, max(end - time.monotonic(), 0.0))
            except DrafterUnavailable as err:
                self._fail(w, err)
        for w, rep in replies.items():
            self._latest[w] = rep.counters
            self.slots[w].answered = True
            self.slot_hits[w] += int(rep.hit.sum())
        if len(replies) == 1 and self.d == 1:
            return next(iter(replies.values()))
        if self.split == "sequences":  # each worker predicts its own rows' next round: no hints
            return self._assemble(msg.round_id, msg.seq_ids, replies)
        merged = self._merge(msg, replies)
        self._hint(msg, merged, replies)
        return merged

    def _merge(self, msg: ResolveMsg, replies: dict[int, SpeculationReply]) -> SpeculationReply:
        b = len(msg.seq_ids)
        if not replies:
            return SpeculationReply(
                msg.round_id,
                list(msg.seq_ids),
                torch.zeros(b, dtype=torch.bool),
                torch.zeros(b, 0, dtype=torch.long),
                torch.zeros(b, 0, 0),
                torch.zeros(b, dtype=torch.long),
                counters=self.counters(),
                answered=False,
            )
        any_rep = next(iter(replies.values()))
        tokens, probs = torch.zeros_like(any_rep.tokens), torch.zeros_like(any_rep.probs)
        num_draft = torch.zeros(b, dtype=torch.long)
        hit, covered = torch.zeros(b, dtype=torch.bool), torch.zeros(b, dtype=torch.bool)
        rank = torch.full((b,), -1, dtype=torch.long)  # every worker ranks the same whole grid
        for rep in replies.values():  # the holders
            covered |= rep.covered if rep.covered is not None else rep.hit
            if rep.bonus_rank is not None:
                rank = torch.maximum(rank, rep.bonus_rank)
            rows = rep.hit & ~hit
            tokens[rows], probs[rows], num_draft[rows] = rep.tokens[rows], rep.probs[rows], rep.num_draft[rows]
            hit |= rows
        for rep in replies.values():  # the backup's drafts for rows nobody holds
            rows = ~hit & (num_draft == 0) & (rep.num_draft > 0) & ~rep.hit
            tokens[rows], probs[rows], num_draft[rows] = rep.tokens[rows], rep.probs[rows], rep.num_draft[rows]
        build = max(rep.build_seconds for rep in replies.values())
        return SpeculationReply(
            msg.round_id, list(msg.seq_ids), hit, tokens, probs, num_draft, build, self.counters(), covered, rank
        )

    def _hint(self, msg: ResolveMsg, merged: SpeculationReply, replies: dict[int, SpeculationReply]) -> None:
        """After an all-hit round, tell each slot that did not hold every hit which round comes
        next (the holders predict it themselves), so all begin building at once."""
        rnd = self.round
        if rnd is None or not msg.next_fanout or not bool(merged.hit.all()):
            return
        committed = [len(self.seqs[s].tokens) for s in msg.seq_ids]
        nxt = BeginRoundMsg(
            msg.round_id + 1,
            list(msg.seq_ids),
            merged.tokens.clone(),
            merged.num_draft.clone(),
            list(msg.next_fanout),
            committed,
        )

        def send(w: int, link: WorkerLink) -> None:
            if w in replies and not bool(replies[w].hit.all()):
                link.predict(nxt)
                self.hints += 1

        self._each(send)

    def _assemble(self, round_id: int, seq_ids: list[int], replies: dict[int, SpeculationReply]) -> SpeculationReply:
        rows = {s: r for r, s in enumerate(seq_ids)}
        parts = [([rows[s] for s in rep.seq_ids], rep) for rep in replies.values()]
        k = max((rep.tokens.shape[1] for rep in replies.values()), default=0)
        return assemble(round_id, list(seq_ids), parts, k, self.counters())

    def draft_now(self, msg: DraftNowMsg) -> SpeculationReply:
        self._attach_ready()
        if self.split == "sequences":
            replies = {}
            for w, slot in enumerate(self.slots):
                part = self._part(w, msg) if slot.link is not None else None
                if part is not None and any(part.need):
                    try:
                        replies[w] = slot.link.draft_now(part)
                    except DrafterUnavailable as err:
                        self._fail(w, err)
            return self._assemble(msg.round_id, msg.seq_ids, replies)
        while (w := self._backup_slot()) is not None:
            try:
                return self.slots[w].link.draft_now(msg)
            except DrafterUnavailable as err:
                self._fail(w, err)
        b = len(msg.seq_ids)
        return SpeculationReply(
            msg.round_id,
            list(msg.seq_ids),
            torch.zeros(b, dtype=torch.bool),
            torch.zeros(b, 0, dtype=torch.long),
            torch.zeros(b, 0, 0),
            torch.zeros(b, dtype=torch.long),
            counters=self.counters(),
        )

    def counters(self) -> DrafterCounters:
        total = self._retired
        for c in self._latest.values():
            total = total + c
        return total

    def stats(self) -> dict:
        wire = sum((s.link.wire for s in self.slots if s.link is not None), self._retired_wire)
        return {
            "draft_workers": self.d,
            "draft_workers_live": self.live(),
            "draft_worker_failures": self.failures,
            "draft_worker_replacements": self.replacements,
            "draft_slot_hits": list(self.slot_hits),
            "draft_predict_hints": self.hints,
            "rejected_replies": self.rejected_replies + sum(s.link.rejected for s in self.slots if s.link is not None),
            # Frame bytes (ssd/transport/wire.py WireCounts) to and from the workers, by message type.
            "wire_bytes_sent": wire.sent,
            "wire_bytes_received": wire.received,
        }

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._closing.set()
        for thread in self._refills:  # a refill that is starting a worker discards it once started
            thread.join(CLOSE_REFILL_WAIT_S)
            if thread.is_alive():
                logger.error("a draft worker refill did not finish within %.0f s of close()", CLOSE_REFILL_WAIT_S)
        with self._lock:
            ready, self._ready = self._ready, []
        for _, link in ready:
            self.source.discard(link, failed=False)
        for slot in self.slots:
            link, slot.link = slot.link, None
            if link is not None:
                self.source.discard(link, failed=False)
        self.source.close()
