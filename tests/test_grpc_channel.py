"""The grpc transport: a worker listening on a port the OS picked, targets connecting to it by
address over a gRPC bidirectional stream, with real processes on loopback."""

from __future__ import annotations

import datetime
import importlib.util
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _stubs_ready() -> bool:
    """The generated stubs exist, or are generated now (as `make protos` does) when grpc_tools is
    installed; the tests are skipped only when neither is the case."""
    if importlib.util.find_spec("ssd.transport._proto.ssd_draft_pb2_grpc") is not None:
        return True
    if importlib.util.find_spec("grpc_tools") is None:
        return False
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-Issd/transport/_proto=protos",
            "--python_out=.",
            "--grpc_python_out=.",
            "protos/ssd_draft.proto",
        ],
        cwd=ROOT,
        check=True,
    )
    return True


if not _stubs_ready():
    pytest.skip("gRPC stubs not generated and grpcio-tools not installed (run `make protos`)", allow_module_level=True)

from messages import every_message, same_message
from workers import Proc

from ssd.core.protocol import (
    DrafterCounters,
    ReleaseMsg,  # noqa: E402
    SpeculationReply,
)
from ssd.transport.channel import ChannelClosed, ChannelTimeout  # noqa: E402
from ssd.transport.grpc_address import parse_grpc_address  # noqa: E402
from ssd.transport.grpc_channel import GrpcListener, WorkerBusy, connect_grpc  # noqa: E402
from ssd.transport.wire import ForeignMessage, MsgType  # noqa: E402

FP = 4242
S = datetime.timedelta(seconds=1)

# A worker that echoes every message of every session and reports how each session ended.
# argv: fp, keepalive seconds.
ECHO_WORKER = """
import datetime, sys, time, torch
from ssd.transport.grpc_channel import GrpcListener
listener = GrpcListener(keepalive=datetime.timedelta(seconds=float(sys.argv[2])))
print(listener.address, flush=True)
while True:
    channel = listener.accept(int(sys.argv[1]))
    print("OPEN", flush=True)
    try:
        while True:
            kind, msg = channel.recv()
            channel.send(kind, msg)
    except RuntimeError as err:
        print("END", type(err).__name__, time.monotonic(), flush=True)
"""

# A target that connects, says so, and waits to be killed.
IDLE_TARGET = """
import sys, time, datetime
from ssd.transport.grpc_channel import connect_grpc
channel = connect_grpc(sys.argv[1], int(sys.argv[2]), datetime.timedelta(seconds=30))
print("CONNECTED", flush=True)
time.sleep(600)
"""


@pytest.fixture(scope="module")
def echo():
    """(worker process, its address); sessions run one after another."""
    worker = Proc(ECHO_WORKER, FP, 10)
    yield worker, worker.line()
    worker.kill()


def _end(worker: Proc) -> list[str]:
    """Skip to the worker's report of how the current session ended."""
    while not (line := worker.line()).startswith("END"):
        pass
    return line.split()


def _wait_poll(channel, seconds: float = 10) -> bool:
    deadline = time.monotonic() + seconds
    while not channel.poll() and time.monotonic() < deadline:
        time.sleep(0.001)
    return channel.poll()


def test_every_message_type_round_trips_and_poll_sees_arrival(echo):
    worker, address = echo
    channel = connect_grpc(address, FP, 30 * S)
    try:
        for kind, msg in every_message():
            assert not channel.poll()
            channel.send(kind, msg, 10 * S)
            assert _wait_poll(channel), "the echo arrived but poll() did not see it"
            assert channel.poll()  # poll() takes nothing
            back_kind, back = channel.recv(10 * S)
            assert back_kind == kind and same_message(msg, back), (msg, back)
        # A dense reply at a 128k vocabulary and batch 8 (~33 MB) fits the default message size.
        big = SpeculationReply(
            6,
            list(range(8)),
            torch.ones(8, dtype=torch.bool),
            torch.zeros(8, 8, dtype=torch.long),
            torch.rand(8, 8, 128256) + 0.01,
            torch.full((8,), 8),
            0.0,
            DrafterCounters(),
            torch.ones(8, dtype=torch.bool),
        )
        channel.send(MsgType.REPLY, big, 30 * S)
        assert same_message(big, channel.recv(30 * S)[1])
    finally:
        channel.close()
    assert _end(worker)[1] == "ChannelClosed"


def test_sessions_in_a_row_and_a_second_target_refused_while_one_is_open(echo):
    worker, address = echo
    first = connect_grpc(address, FP, 30 * S)
    started = time.monotonic()
    with pytest.raises(WorkerBusy, match=f"{address}.*busy"):
        connect_grpc(address, FP, 30 * S)
    assert time.monotonic() - started < 5
    assert isinstance(WorkerBusy("x"), RuntimeError)
    first.send(MsgType.RELEASE, ReleaseMsg([7]), 10 * S)
    assert first.recv(10 * S)[1].seq_ids == [7]
    first.close()
    # The next target right after: the session ended with the first target's close().
    second = connect_grpc(address, FP, 30 * S)
    second.send(MsgType.RELEASE, ReleaseMsg([8]), 10 * S)
    assert second.recv(10 * S)[1].seq_ids == [8]
    second.close()
    assert _end(worker)[1] == "ChannelClosed"


def test_a_killed_target_ends_the_workers_session_at_once(echo):
    worker, address = echo
    target = Proc(IDLE_TARGET, address, FP)
    try:
        assert target.line() == "CONNECTED"
        killed = time.monotonic()
        target.kill()
        _, kind, when = _end(worker)
        assert kind == "ChannelClosed" and float(when) - killed < 2
        # ... and the worker takes the next target.
        channel = connect_grpc(address, FP, 30 * S)
        channel.send(MsgType.RELEASE, ReleaseMsg([9]), 10 * S)
        assert channel.recv(10 * S)[1].seq_ids == [9]
        channel.close()
    finally:
        target.kill()


def test_a_killed_worker_raises_channel_closed_at_once():
    worker = Proc(ECHO_WORKER, FP, 10)
    try:
        channel = connect_grpc(worker.line(), FP, 30 * S)
        assert worker.line() == "OPEN"
        threading.Timer(0.3, worker.kill).start()
        started = time.monotonic()
        with pytest.raises(ChannelClosed, match="draft worker is gone"):
            channel.recv(30 * S)
        assert time.monotonic() - started < 10  # the recv's timeout is 30 s
        assert channel.poll()  # never blocks: the recv() that follows says what happened
        with pytest.raises(ChannelClosed):  # and so does everything after
            channel.send(MsgType.RELEASE, ReleaseMsg([1]), 10 * S)
        with pytest.raises(ChannelClosed):
            channel.recv(10 * S)
        channel.close()
    finally:
        worker.kill()


def test_a_stopped_worker_host_is_noticed_by_the_keepalive():
    """SIGSTOP: the socket stays open but nothing answers, as when the worker's host is gone."""
    worker = Proc(ECHO_WORKER, FP, 0.5)
    try:
        channel = connect_grpc(worker.line(), FP, 30 * S, keepalive=datetime.timedelta(seconds=0.5))
        channel.send(MsgType.RELEASE, ReleaseMsg([1]), 10 * S)
        assert channel.recv(10 * S)[1].seq_ids == [1]
        # Pings on an idle session do not end it (the server's ping policy allows them): 2.5 s is
        # 5 pings, past gRPC's default limit of 2 strikes.
        for _ in range(25):
            time.sleep(0.1)
            assert not channel.poll()
        channel.send(MsgType.RELEASE, ReleaseMsg([2]), 10 * S)
        assert channel.recv(10 * S)[1].seq_ids == [2]
        worker.popen.send_signal(signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(ChannelClosed):
            channel.recv(30 * S)
        assert time.monotonic() - started < 15  # keepalive, well before the recv's 30 s
        channel.close()
    finally:
        worker.kill()


def _in_process_pair(target_fp: int = FP, **kwargs):
    """(listener, worker channel, target channel), both ends in this process."""
    listener = GrpcListener(**kwargs)
    accepted: list = []
    thread = threading.Thread(target=lambda: accepted.append(listener.accept(FP, 30 * S)))
    thread.start()
    target = connect_grpc(listener.address, target_fp, 30 * S, **kwargs)
    thread.join(30)
    return listener, accepted[0], target


def test_timeouts_leave_the_session_usable():
    listener, worker, target = _in_process_pair()
    try:
        for channel, peer in ((target, worker), (worker, target)):
            started = time.monotonic()
            with pytest.raises(ChannelTimeout, match="sent nothing within 0.3 s"):
                channel.recv(datetime.timedelta(seconds=0.3))
            assert 0.25 < time.monotonic() - started < 3
            peer.send(MsgType.RELEASE, ReleaseMsg([5]), 10 * S)
            assert channel.recv(10 * S)[1].seq_ids == [5]
        # The worker closing the session: the target's recv() ends, after what was sent before.
        burst = [ReleaseMsg(list(range(n, n + 1 + 50_000 * (n % 2)))) for n in range(20)]  # up to 400 kB each
        for msg in burst:
            worker.send(MsgType.RELEASE, msg, 10 * S)
        worker.close()
        assert [target.recv(10 * S)[1] for _ in burst] == burst
        with pytest.raises(ChannelClosed, match="ended the session"):
            target.recv(10 * S)
        with pytest.raises(ChannelClosed, match="closed by this end"):
            worker.recv(10 * S)
    finally:
        target.close()
        listener.close()


def test_listener_and_connect_time_out():
    listener = GrpcListener()
    try:
        with pytest.raises(ChannelTimeout, match="no target connected"):
            listener.accept(FP, datetime.timedelta(seconds=0.3))
        # The worker never accepts: the target gives up, and its pending session is dropped.
        with pytest.raises(ChannelTimeout, match=f"{listener.address} did not accept"):
            connect_grpc(listener.address, FP, datetime.timedelta(seconds=1))
        # The drop reaches the server a moment later (an accept() before it would take the dead
        # session: under load in CI the accept below did, and the next target waited in vain).
        deadline = time.monotonic() + 10
        while listener.pending:
            assert time.monotonic() < deadline, "the abandoned session was not dropped within 10 s"
            time.sleep(0.01)
        accepted: list = []
        thread = threading.Thread(target=lambda: accepted.append(listener.accept(FP, 30 * S)))
        thread.start()
        target = connect_grpc(listener.address, FP, 30 * S)
        thread.join(30)
        target.send(MsgType.RELEASE, ReleaseMsg([3]), 10 * S)
        assert accepted[0].recv(10 * S)[1].seq_ids == [3]
        target.close()
        with pytest.raises(ChannelClosed, match="target closed the session"):
            accepted[0].recv(10 * S)
    finally:
        listener.close()
    with pytest.raises(ChannelClosed, match="no draft worker listens"):  # close() stopped the server
        connect_grpc(listener.address, FP, 10 * S)
    # Something listens but never speaks gRPC: no answer within the timeout.
    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen()
        address = f"grpc://127.0.0.1:{mute.getsockname()[1]}"
        started = time.monotonic()
        with pytest.raises(ChannelTimeout, match=f"{address} within 0.5 s"):
            connect_grpc(address, FP, datetime.timedelta(seconds=0.5))
        assert time.monotonic() - started < 5


def test_a_frame_with_a_foreign_fingerprint_is_refused():
    listener, worker, target = _in_process_pair(target_fp=FP + 1)
    try:
        target.send(MsgType.RELEASE, ReleaseMsg([1]), 10 * S)
        with pytest.raises(ForeignMessage, match=f"fingerprint {FP + 1}"):
            worker.recv(10 * S)
        worker.close()  # what a worker does with a foreign target
        with pytest.raises(ChannelClosed):
            target.recv(10 * S)
    finally:
        target.close()
        listener.close()


def test_a_frame_over_the_message_size_limit_ends_the_session_clearly():
    listener, worker, target = _in_process_pair(max_message_bytes=1 << 16)
    try:
        target.send(MsgType.RELEASE, ReleaseMsg(list(range(1 << 14))), 10 * S)  # 128 KiB of ids
        with pytest.raises(ChannelClosed, match="RESOURCE_EXHAUSTED"):
            target.recv(10 * S)
        with pytest.raises(ChannelClosed):
            worker.recv(10 * S)
    finally:
        target.close()
        listener.close()


@pytest.mark.parametrize(
    "address",
    [
        "grpc://127.0.0.1",
        "torch://127.0.0.1:5",
        "127.0.0.1:5",
        "grpc://:5",
        "grpc://h:port",
        "grpc://h:5/x",
        "grpc://h:99999",
        "grpc://h:5?x=1",
    ],
)
def test_a_malformed_address_is_refused(address):
    with pytest.raises(ValueError, match="grpc://HOST:PORT"):
        connect_grpc(address, FP, S)


def test_addresses_parse():
    assert parse_grpc_address("grpc://10.0.0.2:2345") == ("10.0.0.2", 2345)
    assert parse_grpc_address("grpc://[::1]:2345") == ("::1", 2345)


def test_nothing_listening_is_reported_at_once():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(ChannelClosed, match=f"no draft worker listens at grpc://127.0.0.1:{port}"):
        connect_grpc(f"grpc://127.0.0.1:{port}", FP, 10 * S)
    assert time.monotonic() - started < 6  # the connect timeout is 10 s
