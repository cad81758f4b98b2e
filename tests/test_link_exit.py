"""A WorkerLink's exit hook (ssd/transport/link.py): a link open at exit is closed then, and a
link closed or killed before leaves nothing behind (no atexit hook, no reference to it)."""

from __future__ import annotations

import atexit
import gc
import time
import weakref

import pytest
import torch

from ssd.core.protocol import MsgType, ResolveMsg
from ssd.transport import link as link_module
from ssd.transport.link import WorkerLink
from ssd.transport.shm_channel import Mailbox, ShmChannel
from ssd.transport.wire import WireCounts


class FakeChannel:
    """A channel end that records what is sent and whether it was closed."""

    def __init__(self) -> None:
        self.counts = WireCounts()
        self.sent: list[MsgType] = []
        self.closed = False

    def send(self, kind, msg=None, timeout=None) -> None:
        self.sent.append(kind)

    def close(self, peer_exited: bool = False) -> None:
        self.closed = True


def make_link(i: int = 0) -> WorkerLink:
    return WorkerLink(FakeChannel(), f"fake {i}", deadline_s=1.0)


def test_many_links_closed_or_killed_leave_no_exit_hook_behind():
    hooks = atexit._ncallbacks()
    links = [make_link(i) for i in range(200)]
    for i, link in enumerate(links):
        link.close() if i % 2 else link.kill()
    assert atexit._ncallbacks() == hooks
    assert all(link.channel.closed for link in links)
    assert [link.channel.sent for link in links[1::2]] == [[MsgType.SHUTDOWN]] * 100  # close(): SHUTDOWN first
    assert all(link.channel.sent == [] for link in links[::2])  # kill(): nothing sent
    gone = weakref.ref(links[0])
    del links, link
    gc.collect()
    assert gone() is None  # nothing holds a closed link


def test_a_link_still_open_at_exit_is_closed_by_the_hook(monkeypatch):
    monkeypatch.setattr(link_module, "_OPEN", {})  # this test's links only: others' stay open
    first, second, done = make_link(1), make_link(2), make_link(3)
    assert link_module.open_links() == [first, second, done]
    done.close()
    closed_in_order = []
    for link in (first, second):
        link.channel.close = lambda peer_exited=False, name=link.name: closed_in_order.append(name)
    link_module._close_open_links()  # what the interpreter runs at exit
    assert first.closed and second.closed
    assert first.channel.sent == second.channel.sent == [MsgType.SHUTDOWN]
    assert done.channel.sent == [MsgType.SHUTDOWN]  # closed once, not again
    assert closed_in_order == ["fake 2", "fake 1"]  # the newest first, as atexit's own order
    assert link_module.open_links() == []


@pytest.mark.parametrize("worker", ["stopped reading", "owes a reply"])
def test_a_clean_close_waits_for_a_silent_worker_seconds_not_its_deadline(worker):
    """Reported: a served target replica closed while its leased worker no longer read (the pool
    being deleted beside it) waited its 30 s reply deadline on SHUTDOWN, and Serve force-killed it
    at its grace period. Real shm mailboxes: one slot taken by a message never read, or a reply owed
    and never sent (the close drains it first); either way SHUTDOWN_TIMEOUT bounds the close."""
    to_worker, to_target = Mailbox.create(capacity=256, slots=1), Mailbox.create(capacity=256, slots=1)
    outcome = ResolveMsg(1, [1], torch.tensor([0]), torch.tensor([1]), False)
    link = WorkerLink(ShmChannel.of(to_target, to_worker, 7, lambda: True), worker, deadline_s=30.0)
    if worker == "stopped reading":
        link.channel.send(MsgType.RESOLVE, outcome)
    else:
        link.resolve(outcome, answers=True)
        assert link.owed is not None
    started = time.monotonic()
    link.close()
    assert time.monotonic() - started < 2 * link_module.SHUTDOWN_TIMEOUT.total_seconds() + 1
    assert link.closed
    to_worker.close()
    to_target.close()
