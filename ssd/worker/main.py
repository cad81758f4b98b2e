"""The draft worker's process: `python -m ssd.worker` (what a target starts, ssd/transport/spawn.py)
and `serve_sessions` (what a worker that listens runs: here, or in a Ray actor's thread).

It reads its spec (engine config, vocabulary, link) as JSON on stdin, loads the draft and serves:
one session over the link it was given (shm mailboxes, a gloo pair) until SHUTDOWN, or, told to
listen, target after target until its parent dies. A failure is reported to the target as an
ERROR message before the process exits.
"""

from __future__ import annotations

import ctypes
import datetime
import functools
import json
import logging
import os
import signal
import sys
import threading

import torch

from ssd.core.config import EngineConfig, config_fingerprint
from ssd.core.protocol import MsgType
from ssd.drafting.tree_drafter import TreeDrafter
from ssd.model.loader import load_draft, load_tokenizer
from ssd.model.runner import draft_runner
from ssd.transport.channel import Channel, ChannelTimeout, Listener
from ssd.transport.connect import make_listener
from ssd.worker.session import WorkerSession, send_error

logger = logging.getLogger(__name__)

PROCESS_NAME = "ssd-draft-worker"


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
    """The worker's end of the link its target set up (shm mailboxes, or a gloo pair)."""
    if link["kind"] == "shm":
        from ssd.transport.shm_channel import Mailbox, MailboxFds, ShmChannel

        parent = link["parent_pid"]
        inbox, outbox = (Mailbox.attach(MailboxFds(**link[name])) for name in ("inbox", "outbox"))
        return ShmChannel(inbox, outbox, fp, lambda: os.getppid() == parent, link["spin_s"])
    from ssd.transport.gloo_channel import JOINING_KEY, pair_group, pair_store
    from ssd.transport.torch_channel import TorchChannel

    store = pair_store(link["store_dir"])
    store.set(JOINING_KEY, str(os.getpid()))
    return TorchChannel(pair_group(store, 1), 0, fp)


def load_drafter(cfg: EngineConfig, vocab: int) -> TreeDrafter:
    """The drafter of `cfg`'s draft, loaded onto its draft device (split over ranks, child
    processes of this one, when cfg.draft_tensor_parallel_size > 1)."""
    runner = draft_runner(load_draft(cfg), cfg.draft_device, cfg.lean_forward, cfg.enforce_eager)
    tokenizer = functools.partial(load_tokenizer, cfg.target, cfg.trust_remote_code)
    return TreeDrafter(runner, vocab, cfg.k, cfg.saguaro_c, tokenizer=tokenizer, early_drafts=cfg.ssd_backup != "fast")


def run(spec: dict) -> int:
    """Load the draft, then serve. spec: {"config": EngineConfig fields, "vocab": int, "link": ...}
    with link {"kind": "shm", "inbox": MailboxFds, "outbox": MailboxFds, "parent_pid": int} (one
    session over inherited mailboxes, until SHUTDOWN), {"kind": "gloo", "store_dir": str}, or
    {"kind": "listen", "transport": "torch" | "grpc", "host": str}: listen, write
    {"address": ...} as one JSON line on stdout, and serve targets until the parent dies."""
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
    drafter = None
    try:
        drafter = load_drafter(cfg, spec["vocab"])
        channel.send(MsgType.READY)
        WorkerSession(drafter, channel, cut_trees=not cfg.ssd_reproducible).serve()
        return 0
    except Exception as err:  # noqa: BLE001 - whatever it is, the target is told before the process exits
        logger.exception("draft worker failed")
        send_error(channel, err)
        return 1
    finally:
        if drafter is not None:
            drafter.close()  # a split draft's ranks stop now (they would at this process's exit anyway)


def _import_loading() -> None:
    """Import what loading any Hugging Face model imports (about 2 s here, most of a small draft's
    load), before the spec arrives: a prestarted worker does it while its target loads."""
    import transformers.configuration_utils  # noqa: F401
    import transformers.modeling_utils  # noqa: F401


def main() -> int:
    _die_with_parent()
    _import_loading()
    spec = json.loads(sys.stdin.read())
    logging.basicConfig(
        level=spec.get("log_level", logging.WARNING),
        format=f"%(asctime)s %(levelname)s [{PROCESS_NAME} {os.getpid()}] %(name)s: %(message)s",
    )
    return run(spec)
