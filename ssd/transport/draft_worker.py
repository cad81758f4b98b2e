"""The draft worker: a `Drafter` driven by the messages of a `Channel`, and the process that runs it.

`DraftWorker.serve()` is the drafter's state machine, whatever carries its messages:
    ADMIT / RELEASE      membership
    BEGIN_ROUND          glue, fork and tree decode; the next message (the outcome) cuts the tree
    RESOLVE              answer with the cached branches (and neural backups when asked)
    DRAFT_NOW            just-in-time speculations
    SHUTDOWN             return
After a reply in which every row hit, the next announcement is known but for its arrival
(Drafter.predict_round): the worker begins that round at once and takes it back whole if the
announcement differs (_build_predicted).

`python -m ssd.transport.draft_worker` is the process a target starts for its drafter (ssd/transport/draft_process.py).
It is started through the package's own entry point, never by re-importing the caller's main
module, so SSD works from stdin scripts, `python -c`, notebooks, scripts without a
`__main__` guard and Ray actors alike. It reads its spec (engine config, vocabulary, link) as
JSON on stdin, then serves until SHUTDOWN; a failure is reported to the target as an ERROR
message before the process exits.
"""

from __future__ import annotations

import ctypes
import datetime
import json
import logging
import os
import signal
import sys
import threading

import torch

from ssd.transport.channel import Channel, ChannelTimeout, Listener
from ssd.transport.messages import BeginRoundMsg, DrafterCounters
from ssd.transport.wire import MsgType, encode, fingerprint

logger = logging.getLogger(__name__)

PROCESS_NAME = "ssd-draft-worker"


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


def config_fingerprint(config, vocab: int) -> int:
    """Ties both ends of a channel to one configuration: a message from a worker of another
    model, K, dtype or C is refused."""
    return fingerprint(vocab, config.k, config.draft, config.draft_dtype, config.saguaro_c)


class _NextRound:
    """Reads the channel while the drafter builds a round it predicted: the target's
    announcement confirms the round when it matches (then the outcome's arrival cuts the tree
    as usual); anything else makes the round stale and is kept for the worker to handle."""

    def __init__(self, channel: Channel, predicted: BeginRoundMsg) -> None:
        self.channel, self.predicted = channel, predicted
        self.confirmed = False
        self.other: tuple | None = None  # (kind, message, ints) that superseded the prediction

    def _read(self, block: bool) -> None:
        if self.confirmed or self.other is not None or not (block or self.channel.poll()):
            return
        kind, msg, ints = self.channel.recv()
        if kind == MsgType.BEGIN_ROUND and msg.same_round(self.predicted):
            self.confirmed = True
        else:
            self.other = (kind, msg, ints)

    def stale(self) -> bool:
        self._read(block=False)
        return self.other is not None

    def outcome_arrived(self) -> bool:
        self._read(block=False)
        return self.confirmed and self.channel.poll()

    def settle(self) -> None:
        """After the build: wait for the announcement if it has not come yet."""
        self._read(block=True)


class OutOfSync(RuntimeError):
    """The target's view of a sequence differs from this worker's: a message was lost."""


class DraftWorker:
    """Serves one target over one channel. cut_trees=False builds every tree to depth K
    whatever the timing (reproducible output, at the cost of waiting for the whole build).

    Round messages must come in order: a BEGIN_ROUND or PREDICT for a round not after the last
    one begun, or a RESOLVE for a round other than the one built, is a duplicate or a stale
    copy; it is counted (`rejected`) and dropped unanswered, so it cannot change a speculation.
    A round whose committed lengths differ from the worker's own raises OutOfSync: the target
    replaces the worker."""

    def __init__(self, drafter, channel: Channel, cut_trees: bool = True) -> None:
        self.drafter, self.channel, self.cut_trees = drafter, channel, cut_trees
        self.last_begun = 0  # round id of the last round begun (announced or predicted)

    def serve(self) -> None:
        queued = None  # a message read while building a predicted round that it superseded
        while True:
            if queued is not None:
                (kind, msg, ints), queued = queued, None
            else:
                kind, msg, ints = self.channel.recv()
            if kind == MsgType.SHUTDOWN:
                return
            if kind == MsgType.JOIN:
                shard, num_shards = ints.tolist()
                if self.drafter.order:
                    raise OutOfSync("JOIN after sequences were admitted")
                self.drafter.shard, self.drafter.num_shards = int(shard), int(num_shards)
            elif kind == MsgType.ADMIT:
                if any(s in self.drafter.states for s in msg.seq_ids):
                    self._reject(kind, 0)
                    continue
                self.drafter.admit(msg)
            elif kind == MsgType.RELEASE:
                self.drafter.release(msg.seq_ids)
            elif kind in (MsgType.BEGIN_ROUND, MsgType.PREDICT):
                if msg.round_id <= self.last_begun:
                    self._reject(kind, msg.round_id)
                    continue
                self._check_committed(msg)
                self.last_begun = msg.round_id
                if kind == MsgType.PREDICT:
                    queued = self._build_predicted(msg)
                    continue
                # The next message (the round's outcome) cuts the tree decode short: the target
                # is waiting, and branches of the depth reached are still usable speculations.
                self.drafter.begin_round(msg, interrupted=self.channel.poll if self.cut_trees else None)
            elif kind == MsgType.RESOLVE:
                if msg.round_id != self.last_begun or self.drafter.round is None:
                    self._reject(kind, msg.round_id)
                    continue
                reply = self.drafter.resolve(msg)
                self.channel.send(reply)
                self._note_memory()
                predicted = self.drafter.predict_round(msg, reply)
                if predicted is not None:
                    self.last_begun = predicted.round_id
                    queued = self._build_predicted(predicted)
            elif kind == MsgType.DRAFT_NOW:
                _, round_id, ints, floats = encode(self.drafter.draft_reply(msg))
                self.channel.send_raw(MsgType.DRAFT_REPLY, round_id, ints, floats)
                self._note_memory()
            else:
                raise ValueError(f"draft worker got unexpected {kind.name}")

    def _note_memory(self) -> None:
        """After a reply is sent, so the target never waits for it (the next reply carries it)."""
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
        """Build the round predicted after an all-hit reply while the target is still finishing
        its step (bookkeeping, the next proposal, the announcement). The announcement confirms
        it, or the round is taken back (cache and generators as before, so outputs do not
        depend on the prediction) and the message that came instead is handled as usual.
        -> a message to handle first, or None."""
        counters = self.drafter.counters
        counters.predicted += 1
        watch = _NextRound(self.channel, predicted)
        built = self.drafter.begin_round(
            predicted, interrupted=watch.outcome_arrived if self.cut_trees else None, stale=watch.stale
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


# ---- the process ---------------------------------------------------------------------------------


def _die_with_parent() -> None:
    """Ask the kernel to kill this process when its parent dies (PR_SET_PDEATHSIG), and name it
    (PR_SET_NAME: what `ps -e`, `top` and `pgrep ssd-draft` show)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        libc.prctl(15, PROCESS_NAME.encode()[:15])  # PR_SET_NAME (15 bytes at most)
    except OSError:
        logger.warning("prctl unavailable: the draft worker may outlive a killed parent")


def _channel(link: dict, fp: int) -> Channel:
    if link["kind"] == "shm":
        from ssd.transport.shm_channel import Mailbox, MailboxFds, ShmChannel

        parent = link["parent_pid"]
        inbox, outbox = (Mailbox.attach(MailboxFds(**link[name])) for name in ("inbox", "outbox"))
        return ShmChannel(inbox, outbox, fp, lambda: os.getppid() == parent, link["spin_s"])
    from ssd.transport.gloo_channel import (
        JOINING_KEY,
        GlooChannel,
        pair_group,
        pair_store,
    )

    store = pair_store(link["store_dir"])
    store.set(JOINING_KEY, str(os.getpid()))
    return GlooChannel(pair_group(store, 1), 0, fp)


def load_drafter(cfg, vocab: int):
    """The draft model of `cfg` (an EngineConfig), loaded into a Drafter."""
    from ssd.drafting.drafter import Drafter
    from ssd.model.loader import load_model
    from ssd.model.runner import draft_runner

    model = load_model(cfg.draft, cfg.draft_dtype, cfg.draft_device, cfg.trust_remote_code)
    return Drafter(draft_runner(model, cfg.draft_device, cfg.lean_forward), vocab, cfg.k, cfg.saguaro_c)


def make_listener(transport: str, host: str, device: str = "cpu") -> Listener:
    """The worker's end of a connectable transport: "torch" (a torch.distributed pair group per
    session) or "grpc" (a bidirectional stream per session)."""
    if transport == "torch":
        from ssd.transport.torch_channel import TorchListener

        return TorchListener(host, device)
    if transport == "grpc":
        from ssd.transport.grpc_channel import GrpcListener

        return GrpcListener(host)
    raise ValueError(f"draft transport {transport!r} cannot be listened on: choose 'torch' or 'grpc'")


def _reset(drafter) -> None:
    """Forget the last target's sequences, share and counters before the next session."""
    drafter.release(list(drafter.order))
    drafter.round = None
    drafter.shard, drafter.num_shards = 0, 1
    drafter.counters = DrafterCounters()


def serve_sessions(drafter, listener: Listener, fp: int, cut_trees: bool, stop: threading.Event) -> None:
    """Serve targets one session at a time until `stop` is set: accept, READY, the protocol
    until SHUTDOWN or the target is gone, then start clean for the next one. A session that
    breaks (peer gone, out of sync, foreign frames) ends only that session."""
    while not stop.is_set():
        try:
            channel = listener.accept(fp, datetime.timedelta(seconds=1))
        except ChannelTimeout:
            continue
        try:
            channel.send_raw(MsgType.READY, 0, torch.zeros(0, dtype=torch.long), torch.zeros(0))
            DraftWorker(drafter, channel, cut_trees).serve()
        except (RuntimeError, ValueError) as err:  # ChannelClosed, OutOfSync, ForeignMessage, protocol errors
            logger.warning("target session ended: %s", err)
            text = torch.tensor(list(f"{type(err).__name__}: {err}".encode()[:4000]), dtype=torch.long)
            try:
                channel.send_raw(MsgType.ERROR, 0, text, torch.zeros(0), datetime.timedelta(seconds=1))
            except RuntimeError:
                logger.info("the target is gone; its session's error was not delivered")
        finally:
            channel.close()
            _reset(drafter)


def run(spec: dict) -> int:
    """Load the draft, then serve. spec: {"config": EngineConfig fields, "vocab": int, "link": ...}
    with link {"kind": "shm", "inbox": MailboxFds, "outbox": MailboxFds, "parent_pid": int} (one
    session over inherited mailboxes, until SHUTDOWN), {"kind": "gloo", "store_dir": str}, or
    {"kind": "listen", "transport": "torch" | "grpc", "host": str}: listen, write
    {"address": ...} as one JSON line on stdout, and serve targets until the parent dies."""
    from ssd.config import EngineConfig

    cfg = EngineConfig(**spec["config"])
    torch.set_num_threads(cfg.draft_num_threads)
    fp = config_fingerprint(cfg, spec["vocab"])
    link = spec["link"]
    if link["kind"] == "listen":
        listener = make_listener(link["transport"], link["host"], cfg.draft_device)
        drafter = load_drafter(cfg, spec["vocab"])
        sys.stdout.write(json.dumps({"address": listener.address}) + "\n")
        sys.stdout.flush()
        serve_sessions(drafter, listener, fp, not cfg.ssd_reproducible, threading.Event())
        return 0
    channel = _channel(link, fp)
    try:
        drafter = load_drafter(cfg, spec["vocab"])
        channel.send_raw(MsgType.READY, 0, torch.zeros(0, dtype=torch.long), torch.zeros(0))
        DraftWorker(drafter, channel, cut_trees=not cfg.ssd_reproducible).serve()
        return 0
    except Exception as err:
        logger.exception("draft worker failed")
        text = torch.tensor(list(f"{type(err).__name__}: {err}".encode()[:4000]), dtype=torch.long)
        try:
            channel.send_raw(MsgType.ERROR, 0, text, torch.zeros(0))
        except RuntimeError as send_err:
            logger.error("could not report the failure to the target: %s", send_err)
        return 1


def main() -> int:
    _die_with_parent()
    spec = json.loads(sys.stdin.read())
    logging.basicConfig(
        level=spec.get("log_level", logging.WARNING),
        format=f"%(asctime)s %(levelname)s [{PROCESS_NAME} {os.getpid()}] %(name)s: %(message)s",
    )
    return run(spec)


if __name__ == "__main__":
    sys.exit(main())
