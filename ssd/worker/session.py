"""One target's session with a draft worker: a `TreeDrafter` driven by the messages of a `Channel`.

`WorkerSession.serve()` dispatches each message by its kind (_HANDLERS):
    JOIN, ADMIT, RELEASE   membership
    BEGIN_ROUND            glue, fork and tree decode; the next message (the outcome) cuts the tree
    PREDICT                the same, for a round not announced yet
    RESOLVE                answer with the cached branches (and neural backups when asked)
    NEURAL_BACKUP          the neural backup's speculations, drafted just in time
    SHUTDOWN               return
After a reply in which every row hit, the next announcement is known but for its arrival
(TreeDrafter.predict_round): the worker begins that round at once and takes it back whole if
the announcement differs (_build_predicted).

In a pool, the round's grid shard (BeginRoundMsg.grid_shard) sends the round's branch grid (GRID)
as soon as it has forked and the round is announced; the target reads off it which shard holds
each row's outcome and names the answering shards in RESOLVE, and a worker that answers no row
sends no reply.

Round messages must come in order: a BEGIN_ROUND or PREDICT for a round not after the last one
begun, or a RESOLVE for a round other than the one built, is a duplicate or a stale copy; it is
counted (`rejected`) and dropped unanswered, so it cannot change a speculation. A round whose
committed lengths differ from the worker's own raises OutOfSync: the target replaces the worker.
"""

from __future__ import annotations

import logging
import time

from ssd.core.protocol import BeginRoundMsg, ErrorMsg, GridMsg, MsgType
from ssd.drafting.tree_drafter import TreeDrafter
from ssd.transport.channel import Channel
from ssd.transport.shm_board import BoardWriter

logger = logging.getLogger(__name__)

# The worker's peak memory is read at most this often (after a reply): a read of /proc costs
# ~0.1 ms, and it sits between one round's reply and the build of the next, which on a CPU is
# what bounds an SSD round.
MEMORY_NOTE_EVERY_S = 1.0


def peak_rss_bytes() -> int:
    """This process's peak resident memory (VmHWM), 0 where /proc is unavailable. Not
    getrusage's ru_maxrss: in a process started by subprocess it also counts the parent's peak,
    which the child held until its exec."""
    try:
        with open("/proc/self/status", "rb") as status:
            for line in status:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # no /proc (not Linux): nothing to report
        pass
    return 0


def send_error(channel: Channel, err: BaseException, timeout=None) -> None:
    """Tell the target why this worker gives up (ERROR), if it is still there to hear it."""
    try:
        channel.send(MsgType.ERROR, ErrorMsg(f"{type(err).__name__}: {err}"), timeout)
    except RuntimeError as send_err:
        logger.info("the target is gone; the worker's error was not delivered: %s", send_err)


class OutOfSync(RuntimeError):
    """The target's view of a sequence differs from this worker's: a message was lost."""


class _GridOut:
    """Sends a round's branch grid to the target once both are known: the grid (forked) and
    the announcement naming this worker the round's grid shard (at once for an announced round;
    for a predicted one, when the announcement confirms it)."""

    def __init__(self, channel: Channel, shard: int, announced: BeginRoundMsg | None) -> None:
        self.channel, self.shard, self.announced = channel, shard, announced
        self.grid: GridMsg | None = None

    def forked(self, grid: GridMsg) -> None:
        self.grid = grid
        self._flush()

    def confirm(self, announced: BeginRoundMsg) -> None:
        self.announced = announced
        self._flush()

    def _flush(self) -> None:
        if self.grid is None or self.announced is None:
            return
        if self.announced.grid_shard == self.shard:
            self.channel.send(MsgType.GRID, self.grid)
        self.grid = None


class _NextRound:
    """Reads the channel while the drafter builds a round it predicted: the target's
    announcement confirms the round when it matches (then the outcome's arrival cuts the tree
    as usual, and the grid goes out if the announcement asks this worker for it); anything else
    makes the round stale and is kept for the session to handle."""

    def __init__(self, channel: Channel, predicted: BeginRoundMsg, grid: _GridOut) -> None:
        self.channel, self.predicted, self.grid = channel, predicted, grid
        self.confirmed = False
        self.other: tuple | None = None  # (kind, message) that superseded the prediction

    def _read(self, block: bool) -> None:
        if self.confirmed or self.other is not None or not (block or self.channel.poll()):
            return
        kind, msg = self.channel.recv()
        if kind == MsgType.BEGIN_ROUND and msg.same_round(self.predicted):
            self.confirmed = True
            self.grid.confirm(msg)
        else:
            self.other = (kind, msg)

    def stale(self) -> bool:
        self._read(block=False)
        return self.other is not None

    def outcome_arrived(self) -> bool:
        self._read(block=False)
        return self.confirmed and self.channel.poll()

    def settle(self) -> None:
        """After the build: wait for the announcement if it has not come yet."""
        self._read(block=True)


class WorkerSession:
    """Serves one target over one channel. cut_trees=False builds every tree to depth K whatever
    the timing (reproducible output, at the cost of waiting for the whole build)."""

    def __init__(
        self, drafter: TreeDrafter, channel: Channel, cut_trees: bool = True, board: BoardWriter | None = None
    ) -> None:
        self.drafter, self.channel, self.cut_trees, self.board = drafter, channel, cut_trees, board
        self.last_begun = 0  # round id of the last round begun (announced or predicted)
        self._memory_noted_at = -MEMORY_NOTE_EVERY_S  # time.monotonic() of the last read

    def serve(self) -> None:
        """Until SHUTDOWN: each message to its handler, which may return a message it read while
        building a predicted round (to handle next)."""
        queued = None
        while True:
            kind, msg = queued if queued is not None else self.channel.recv()
            if kind == MsgType.SHUTDOWN:
                return
            handler = _HANDLERS.get(kind)
            if handler is None:
                raise ValueError(f"draft worker got unexpected {kind.name}")
            queued = handler(self, msg)

    # ---- handlers: each -> a message to handle next, or None ------------------------------------

    def _join(self, msg):
        if self.drafter.order:
            raise OutOfSync("JOIN after sequences were admitted")
        self.drafter.join(msg)

    def _admit(self, msg):
        if any(s in self.drafter.states for s in msg.seq_ids):
            return self._reject(MsgType.ADMIT, 0)
        self.drafter.admit(msg)

    def _release(self, msg):
        self.drafter.release(msg)

    def _begin_round(self, msg: BeginRoundMsg):
        if not self._begin(MsgType.BEGIN_ROUND, msg):
            return None
        # The next message (the round's outcome) cuts the tree decode short: the target is
        # waiting, and branches of the depth reached are still usable speculations.
        grid = _GridOut(self.channel, self.drafter.shard, msg)
        self.drafter.begin_round(
            msg,
            interrupted=self.channel.poll if self.cut_trees else None,
            on_fork=self._on_fork(msg, msg, grid),
        )

    def _on_fork(self, rnd: BeginRoundMsg, announced: BeginRoundMsg | None, grid: _GridOut):
        """What the drafter hands the round's grid to once forked: the sender, where this worker
        of a pool may be asked for it (announced None: a predicted round, whose announcement will
        say); and this worker's board, where each depth is published under the round's key (the
        target finds it only if its announcement is this round: shm_board.py)."""
        pooled = self.drafter.num_shards > 1  # a worker alone (or one of a split by sequence) is never read
        sends = pooled and (announced is None or announced.grid_shard == self.drafter.shard)
        board = self.board if pooled else None
        if not sends and board is None:
            return None
        key = None if board is None else rnd.board_key()
        build_us = int(self.drafter.last_build_s * 1e6)  # the last whole build's, for the target's budget

        def forked(forked_grid, branches: int, keeps_probs: bool):
            if sends:
                grid.forked(forked_grid)
            if board is None:
                return None
            board.start(
                key,
                forked_grid,
                branches,
                self.drafter.k,
                self.drafter.just_in_time.target_vocab,
                keeps_probs,
                build_us,
            )
            return board.add

        return forked

    def _predict(self, msg: BeginRoundMsg):
        return self._build_predicted(msg) if self._begin(MsgType.PREDICT, msg) else None

    def _resolve(self, msg):
        if msg.round_id != self.last_begun or self.drafter.round is None:
            return self._reject(MsgType.RESOLVE, msg.round_id)
        self.drafter.resolve(msg)
        reply = self.drafter.reply()
        # None: the target named other shards for every row; or took every row named this
        # shard off its board (the reply still tells the prediction below what comes next).
        if reply is not None and msg.owes_reply(self.drafter.shard):
            self.channel.send(MsgType.REPLY, reply)
            self._note_memory()
        predicted = self.drafter.predict_round(msg, reply)
        if predicted is None:
            return None
        self.last_begun = predicted.round_id
        return self._build_predicted(predicted)

    def _neural_backup(self, msg):
        self.channel.send(MsgType.NEURAL_BACKUP_REPLY, self.drafter.neural_backup(msg))
        self._note_memory()

    # ---- steps ----------------------------------------------------------------------------------

    def _begin(self, kind: MsgType, msg: BeginRoundMsg) -> bool:
        """Whether a round message is in order (else it is rejected); checks the committed lengths."""
        if msg.round_id <= self.last_begun:
            self._reject(kind, msg.round_id)
            return False
        self._check_committed(msg)
        self.last_begun = msg.round_id
        return True

    def _note_memory(self) -> None:
        """After a reply is sent, so the target never waits for it (the next reply carries it),
        and at most once in MEMORY_NOTE_EVERY_S."""
        now = time.monotonic()
        if now - self._memory_noted_at < MEMORY_NOTE_EVERY_S:
            return
        self._memory_noted_at = now
        self.drafter.counters.peak_rss_bytes = peak_rss_bytes()

    def _reject(self, kind: MsgType, round_id: int) -> None:
        self.drafter.counters.rejected += 1
        logger.warning(
            "dropped a duplicated or stale %s (round %d; last begun %d)", kind.name, round_id, self.last_begun
        )

    def _check_committed(self, msg: BeginRoundMsg) -> None:
        if not msg.committed:
            return
        mine = [len(self.drafter.states[s].tokens) if s in self.drafter.states else -1 for s in msg.seq_ids]
        if mine != list(msg.committed):
            raise OutOfSync(
                f"round {msg.round_id}: the target has {msg.committed} committed tokens, this worker {mine}"
            )

    def _build_predicted(self, predicted: BeginRoundMsg):
        """Build the round predicted after a reply that carried every row's next speculation
        (TreeDrafter.predict_round) while the target is still finishing its step (bookkeeping,
        the next proposal, the announcement). The announcement confirms it, or the round is
        taken back (cache and generators as before, so outputs do not depend on the prediction)
        and the message that came instead is handled as usual. -> a message to handle first, or
        None."""
        counters = self.drafter.counters
        counters.predicted += 1
        grid = _GridOut(self.channel, self.drafter.shard, None)
        watch = _NextRound(self.channel, predicted, grid)
        built = self.drafter.begin_round(
            predicted,
            interrupted=watch.outcome_arrived if self.cut_trees else None,
            stale=watch.stale,
            on_fork=self._on_fork(predicted, None, grid),
        )
        watch.settle()
        if watch.other is None:
            counters.confirmed += 1
            return None
        counters.taken_back += 1
        self.last_begun = predicted.round_id - 1  # the announcement that came instead may reuse its id
        if built:
            self.drafter.abandon_round()
        return watch.other


_HANDLERS = {
    MsgType.JOIN: WorkerSession._join,
    MsgType.ADMIT: WorkerSession._admit,
    MsgType.RELEASE: WorkerSession._release,
    MsgType.BEGIN_ROUND: WorkerSession._begin_round,
    MsgType.PREDICT: WorkerSession._predict,
    MsgType.RESOLVE: WorkerSession._resolve,
    MsgType.NEURAL_BACKUP: WorkerSession._neural_backup,
}
