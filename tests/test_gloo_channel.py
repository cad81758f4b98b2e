"""The gloo pair channel: startup failures reported at once, arrival seen while busy."""

from __future__ import annotations

import datetime
import subprocess
import sys
import threading
import time

import pytest
import torch

from ssd.core.protocol import MsgType, ResolveMsg
from ssd.transport.gloo_channel import WorkerGone, await_worker, pair_group, pair_store
from ssd.transport.torch_channel import TorchChannel


def test_a_worker_that_dies_before_connecting_is_reported_at_once(tmp_path):
    """Regression: spawn() waited the whole 180 s connect timeout for a dead child."""
    process = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    started = time.monotonic()
    with pytest.raises(WorkerGone, match="exited with code 3 before connecting"):
        await_worker(pair_store(str(tmp_path)), lambda: process.poll() is None, process.poll)
    assert time.monotonic() - started < 30


def _pair(tmp_path):
    """Both ranks of a real gloo pair group in this process (construction blocks until both join)."""
    store = pair_store(str(tmp_path))
    groups: dict[int, object] = {}
    threads = [threading.Thread(target=lambda r=r: groups.__setitem__(r, pair_group(store, r))) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return TorchChannel(groups[0], 1, 7), TorchChannel(groups[1], 0, 7)


def test_a_posted_receive_reports_arrival_without_being_waited_on(tmp_path):
    """Regression: the drafter polled gloo's Work.is_completed(), which stays False until
    wait() is called, so the tree decode was never cut short when the outcome came in."""
    target, drafter = _pair(tmp_path)
    assert not drafter.poll()
    time.sleep(0.05)
    assert not drafter.poll()
    # A gloo send completes only once the peer posts the matching receive (the body's is posted
    # by recv below), so the target side sends from a thread of its own, as from its process.
    msg = ResolveMsg(5, [11], torch.tensor([2]), torch.tensor([65]), False)
    sender = threading.Thread(target=target.send, args=(MsgType.RESOLVE, msg, datetime.timedelta(seconds=30)))
    sender.start()
    deadline = time.monotonic() + 10
    while not drafter.poll() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert drafter.poll()
    kind, msg = drafter.recv()
    sender.join(30)
    assert not sender.is_alive()
    assert kind == MsgType.RESOLVE and msg.round_id == 5 and msg.seq_ids == [11]
    assert msg.num_accepted.tolist() == [2] and msg.bonus_tokens.tolist() == [65]
