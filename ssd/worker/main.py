"""The draft worker's process: `run_forked` (what a target forks, ssd/transport/spawn.py) and
`serve_sessions` (what a worker that listens runs: here, or in a Ray actor's thread).

A forked worker gets its spec (engine config, vocabulary, link) from its target, loads the draft
and serves: one session over the link it was given (shm mailboxes, a gloo pair) until SHUTDOWN,
or, told to listen, target after target until its target's process releases it or dies. A
failure is reported to the target as an ERROR message before the process exits.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import threading

from ssd.core.config import EngineConfig, config_fingerprint
from ssd.core.forked import ForkedChild
from ssd.core.protocol import MsgType
from ssd.core.threads import set_process_threads
from ssd.drafting.build import build_tree_drafter
from ssd.drafting.tree_drafter import TreeDrafter
from ssd.model.loader import load_draft
from ssd.transport.channel import Channel, ChannelTimeout, Listener
from ssd.transport.connect import make_listener
from ssd.transport.spawn import WORKER_NAME
from ssd.worker.session import WorkerSession, send_error

logger = logging.getLogger(__name__)


def serve_sessions(drafter: TreeDrafter, listener: Listener, fp: int, cut_trees: bool, stop: threading.Event) -> None:
    """Serve targets one session at a time until `stop` is set: accept, READY, the protocol
    until SHUTDOWN or the target is gone, then start clean for the next one. A session that
    breaks (peer gone, out of sync, foreign frames) ends only that session."""
    while not stop.is_set():
        try:
            channel = listener.accept(fp, datetime.timedelta(seconds=1))
        except ChannelTimeout:
            continue
        try:
            channel.send(MsgType.READY)
            WorkerSession(drafter, channel, cut_trees).serve()
        except (RuntimeError, ValueError) as err:  # ChannelClosed, OutOfSync, ForeignMessage, protocol errors
            logger.warning("target session ended: %s", err)
            send_error(channel, err, datetime.timedelta(seconds=1))
        finally:
            channel.close()
            drafter.reset()


def _channel(link: dict, fp: int, child: ForkedChild) -> Channel:
    """The worker's end of the link its target set up (shm mailboxes, or a gloo pair). The
    mailboxes' descriptors are named by the target's numbers; child.fds maps them to ours."""
    if link["kind"] == "shm":
        from ssd.transport.shm_channel import Mailbox, MailboxFds, MailboxReader, MailboxWriter, ShmChannel
        from ssd.transport.shm_feed import FeedFds, FeedReader

        def attach(fds: dict) -> Mailbox:
            ours = {name: child.fds[fds[name]] for name in ("slot", "full", "empty")}
            return Mailbox.attach(MailboxFds(**ours, capacity=fds["capacity"], slots=fds["slots"]))

        alive, spin_s = child.owner_alive, link["spin_s"]
        writer = MailboxWriter(attach(link["outbox"]), alive, spin_s)
        if link["feed"] is None:
            return ShmChannel(MailboxReader(attach(link["inbox"]), alive, spin_s), writer, fp)
        f = link["feed"]
        fds = FeedFds(child.fds[f["fd"]], f["slots"], f["capacity"], f["readers"])
        return ShmChannel(FeedReader(fds, f["index"], child.fds[f["wake"]], alive, spin_s), writer, fp)
    from ssd.transport.gloo_channel import JOINING_KEY, pair_group, pair_store
    from ssd.transport.torch_channel import TorchChannel

    store = pair_store(link["store_dir"])
    store.set(JOINING_KEY, str(os.getpid()))
    return TorchChannel(pair_group(store, 1), 0, fp)


def _board(link: dict, child: ForkedChild):
    """The board its target made beside the mailboxes (shm_board.py), if it made one."""
    if link.get("board") is None:
        return None
    from ssd.transport.shm_board import BoardFd, BoardWriter

    return BoardWriter(BoardFd(child.fds[link["board"]["fd"]], link["board"]["bank_bytes"]))


def load_drafter(cfg: EngineConfig, vocab: int) -> TreeDrafter:
    """The drafter of `cfg`'s draft, loaded onto its draft device (split over ranks, child
    processes of this one, when cfg.draft_tensor_parallel_size > 1)."""
    return build_tree_drafter(cfg, load_draft(cfg), vocab)


def run_forked(child: ForkedChild, spec: dict) -> int:
    """A forked worker's life (ssd.core.forked runs it): load the draft, then serve. spec:
    {"config": EngineConfig fields, "vocab": int, "log_level": int, "cpus": [int] | None (its own
    cores, EngineConfig.draft_cpu_sets), "link": ...} with link
    {"kind": "shm", "inbox": MailboxFds | None, "feed": FeedPort.handle() | None, "outbox": MailboxFds,
    "spin_s": float} (one session, until SHUTDOWN, reading a mailbox or its pool's feed),
    {"kind": "gloo", "store_dir": str}, or
    {"kind": "listen", "transport": "torch" | "grpc", "host": str, "report_fd": int}: listen,
    write {"address": ...} as one JSON line to report_fd, and serve targets until released."""
    logging.basicConfig(
        level=spec.get("log_level", logging.WARNING),
        format=f"%(asctime)s %(levelname)s [{WORKER_NAME} {os.getpid()}] %(name)s: %(message)s",
    )
    cfg = EngineConfig(**spec["config"])
    if spec.get("cpus"):  # before the draft loads: torch's threads and a split draft's ranks inherit it
        os.sched_setaffinity(0, spec["cpus"])
    set_process_threads(cfg.draft_num_threads)
    fp = config_fingerprint(cfg, spec["vocab"])
    link = spec["link"]
    if link["kind"] == "listen":
        listener = make_listener(link["transport"], link["host"], cfg.draft_device)
        drafter = load_drafter(cfg, spec["vocab"])
        with os.fdopen(child.fds[link["report_fd"]], "w") as report:
            report.write(json.dumps({"address": listener.address}) + "\n")
        serve_sessions(drafter, listener, fp, not cfg.ssd_reproducible, threading.Event())
        return 0
    channel = _channel(link, fp, child)
    board = _board(link, child)
    drafter = None
    try:
        drafter = load_drafter(cfg, spec["vocab"])
        channel.send(MsgType.READY)
        WorkerSession(drafter, channel, cut_trees=not cfg.ssd_reproducible, board=board).serve()
        return 0
    except Exception as err:  # noqa: BLE001 - whatever it is, the target is told before the process exits
        logger.exception("draft worker failed")
        send_error(channel, err)
        return 1
    finally:
        if drafter is not None:
            drafter.close()  # a split draft's ranks stop now (they would at this process's exit anyway)
