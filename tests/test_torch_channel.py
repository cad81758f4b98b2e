"""The torch transport: a worker listening on a port the OS picked, targets connecting to it by
address, over real processes and gloo on loopback."""

from __future__ import annotations

import datetime
import socket
import struct
import threading
import time

import pytest
from messages import every_message, same_message
from workers import Proc

from ssd.core.protocol import (
    ReleaseMsg,
)
from ssd.transport.channel import ChannelClosed, ChannelTimeout
from ssd.transport.torch_channel import TorchListener, WorkerBusy, connect_torch, parse_torch_address
from ssd.transport.wire import ForeignMessage, MsgType

FP = 4242
S = datetime.timedelta(seconds=1)

# A worker that echoes every message of every session and reports how each session ended.
ECHO_WORKER = """
import sys, time, torch
from ssd.transport.torch_channel import TorchListener
listener = TorchListener()
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
from ssd.transport.torch_channel import connect_torch
channel = connect_torch(sys.argv[1], int(sys.argv[2]), datetime.timedelta(seconds=30))
print("CONNECTED", flush=True)
time.sleep(600)
"""


@pytest.fixture(scope="module")
def echo():
    """(worker process, its address); sessions run one after another."""
    worker = Proc(ECHO_WORKER, FP)
    yield worker, worker.line()
    worker.kill()


def _end(worker: Proc) -> list[str]:
    """Skip to the worker's report of how the current session ended."""
    while not (line := worker.line()).startswith("END"):
        pass
    return line.split()


def test_every_message_type_round_trips_and_poll_sees_arrival(echo):
    worker, address = echo
    channel = connect_torch(address, FP, 30 * S)
    try:
        for kind, msg in every_message():
            assert not channel.poll()
            channel.send(kind, msg, 10 * S)
            deadline = time.monotonic() + 10
            while not channel.poll() and time.monotonic() < deadline:
                time.sleep(0.001)
            assert channel.poll(), "the echo arrived but poll() did not see it"
            back_kind, back = channel.recv(10 * S)
            assert back_kind == kind and same_message(msg, back), (msg, back)
    finally:
        channel.close()
    assert _end(worker)[1] == "ChannelClosed"


def test_sessions_in_a_row_and_a_second_target_refused_while_one_is_open(echo):
    worker, address = echo
    first = connect_torch(address, FP, 30 * S)
    started = time.monotonic()
    with pytest.raises(WorkerBusy, match=f"busy.*{address}|{address}.*busy"):
        connect_torch(address, FP, 30 * S)
    assert time.monotonic() - started < 5
    first.send(MsgType.RELEASE, ReleaseMsg([7]), 10 * S)
    assert first.recv(10 * S)[1].seq_ids == [7]
    first.close()
    # The next target right after: the session ended with the first target's close().
    second = connect_torch(address, FP, 30 * S)
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
        assert kind == "ChannelClosed" and float(when) - killed < 3
        # ... and the worker takes the next target.
        channel = connect_torch(address, FP, 30 * S)
        channel.send(MsgType.RELEASE, ReleaseMsg([9]), 10 * S)
        assert channel.recv(10 * S)[1].seq_ids == [9]
        channel.close()
    finally:
        target.kill()


def test_a_killed_worker_raises_channel_closed_at_once():
    worker = Proc(ECHO_WORKER, FP)
    try:
        channel = connect_torch(worker.line(), FP, 30 * S)
        assert worker.line() == "OPEN"
        threading.Timer(0.3, worker.kill).start()
        started = time.monotonic()
        with pytest.raises(ChannelClosed, match="peer is gone"):
            channel.recv(30 * S)
        assert time.monotonic() - started < 10  # the recv's timeout is 30 s
        with pytest.raises(ChannelClosed):  # and so does everything after
            channel.send(MsgType.RELEASE, ReleaseMsg([1]), 10 * S)
        channel.close()
    finally:
        worker.kill()


@pytest.mark.parametrize("peer_exited", [True, False])
def test_a_target_that_saw_its_worker_exit_closes_without_calling_its_store(capfd, peer_exited):
    """Once the worker's process has exited (its owner saw it: WorkerLink passes peer_exited), a
    close does not free the worker's owner key: the store went with the process, and the attempt
    made c10d print a warning with a C++ stack at every close of an offline engine over the torch
    transport. A close that does not know it (peer_exited False) still tries, and warns."""
    worker = Proc(ECHO_WORKER, FP)
    try:
        channel = connect_torch(worker.line(), FP, 30 * S)
        assert worker.line() == "OPEN"
    finally:
        worker.kill()  # and waits for the exit
    capfd.readouterr()
    channel.close(peer_exited=peer_exited)
    assert ("TCPStore" in capfd.readouterr().err) is not peer_exited


def _send_soon(channel, msg: ReleaseMsg) -> list:
    """Send a RELEASE from a thread of its own (a gloo send completes only once the peer posts its
    receive) -> [the thread, then the exception the send raised, if any]."""
    out: list = []

    def send() -> None:
        try:
            channel.send(MsgType.RELEASE, msg, 10 * S)
        except RuntimeError as err:
            out.append(err)

    out.append(threading.Thread(target=send, daemon=True))
    out[0].start()
    return out


def _in_process_pair(target_fp: int = FP):
    """(listener, worker channel, target channel), both ends in this process."""
    listener = TorchListener()
    accepted: list = []
    thread = threading.Thread(target=lambda: accepted.append(listener.accept(FP, 30 * S)))
    thread.start()
    target = connect_torch(listener.address, target_fp, 30 * S)
    thread.join(30)
    return listener, accepted[0], target


def test_timeouts_end_the_session_for_both_ends():
    listener, worker, target = _in_process_pair()
    try:
        started = time.monotonic()
        with pytest.raises(ChannelTimeout):
            target.recv(datetime.timedelta(seconds=0.3))
        assert time.monotonic() - started < 5
        assert target.poll()  # never blocks nor raises: the recv() that follows says what happened
        with pytest.raises(ChannelClosed):
            worker.recv(10 * S)
        with pytest.raises(ChannelClosed):
            target.recv(10 * S)
    finally:
        target.close()
        listener.close()
    listener, worker, target = _in_process_pair()
    try:  # the same through a receive that poll() posted
        assert not worker.poll()
        with pytest.raises(ChannelTimeout):
            worker.recv(datetime.timedelta(seconds=0.3))
        assert worker.poll()  # the session is over: the next recv() says so
        with pytest.raises(ChannelClosed):
            worker.recv(10 * S)
        with pytest.raises(ChannelClosed):
            target.recv(10 * S)
    finally:
        target.close()
        listener.close()


def test_listener_and_connect_time_out():
    listener = TorchListener()
    try:
        with pytest.raises(ChannelTimeout, match="no target connected"):
            listener.accept(FP, datetime.timedelta(seconds=0.3))
        # Claimed, but the worker never accepts: the target gives up and frees the worker.
        with pytest.raises(ChannelTimeout, match=f"{listener.address} did not join"):
            connect_torch(listener.address, FP, datetime.timedelta(seconds=1))
        accepted: list = []
        thread = threading.Thread(target=lambda: accepted.append(listener.accept(FP, 30 * S)))
        thread.start()
        target = connect_torch(listener.address, FP, 30 * S)
        thread.join(30)
        _send_soon(target, ReleaseMsg([3]))
        assert accepted[0].recv(10 * S)[1].seq_ids == [3]
        target.close()
    finally:
        listener.close()
    with pytest.raises(ChannelClosed, match="no draft worker listens"):  # close() stopped the store
        connect_torch(listener.address, FP, 10 * S)


def test_a_frame_with_a_foreign_fingerprint_is_refused():
    listener, worker, target = _in_process_pair(target_fp=FP + 1)
    try:
        sending = _send_soon(target, ReleaseMsg([1]))
        with pytest.raises(ForeignMessage):
            worker.recv(10 * S)
        sending[0].join(10)
        assert isinstance(sending[1], ChannelClosed)  # the body was never taken
        with pytest.raises(ChannelClosed):  # the stream is unusable: the session ended
            target.recv(10 * S)
    finally:
        target.close()
        listener.close()


@pytest.mark.parametrize(
    "address",
    [
        "torch://127.0.0.1",
        "grpc://127.0.0.1:5",
        "127.0.0.1:5",
        "torch://:5",
        "torch://h:port",
        "torch://h:5/x",
        "torch://h:99999",
    ],
)
def test_a_malformed_address_is_refused(address):
    with pytest.raises(ValueError, match="torch://HOST:PORT"):
        connect_torch(address, FP, S)


def test_addresses_parse():
    assert parse_torch_address("torch://10.0.0.2:2345") == ("10.0.0.2", 2345)
    assert parse_torch_address("torch://[::1]:2345") == ("::1", 2345)


def test_nothing_listening_is_reported_at_once():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(ChannelClosed, match=f"torch://127.0.0.1:{port}"):
        connect_torch(f"torch://127.0.0.1:{port}", FP, 10 * S)
    assert time.monotonic() - started < 6  # the connect timeout is 10 s


def _resetting_server(hold_first: bool):
    """A port whose connections are accepted and then reset (a worker being killed). With
    hold_first, the first connection (connect_torch's probe) is held open and only the later
    ones (the store client's) are reset. -> (port, stop)"""
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()
    held = []

    def serve():
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            if hold_first and not held:
                held.append(conn)
                continue
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = RST
            conn.close()
        for conn in held:
            conn.close()
        server.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()

    def close():
        stop.set()
        thread.join(5)

    return server.getsockname()[1], close


@pytest.mark.parametrize("hold_first", [False, True], ids=["probe-reset", "store-reset"])
def test_a_worker_whose_port_accepts_then_resets_is_given_up_in_seconds(hold_first, monkeypatch):
    """A worker being killed still accepts connections for a moment and resets them; the store
    client retries such connections until its timeout. A target that leased it must give up in
    seconds with ChannelClosed, not after the 180 s connect timeout (its refill thread was stuck
    there while the pool had live workers again), and never with a raw OSError: the reset can
    hit the probe connection (ConnectionResetError, which once escaped as such) or the store's.
    The store's timeout is 2 s here, not 5 (the same path, in less time)."""
    from ssd.transport import torch_channel

    monkeypatch.setattr(torch_channel, "STORE_CONNECT_TIMEOUT", datetime.timedelta(seconds=2))
    port, close = _resetting_server(hold_first)
    started = time.monotonic()
    try:
        with pytest.raises(ChannelClosed, match=f"torch://127.0.0.1:{port}"):
            connect_torch(f"torch://127.0.0.1:{port}", FP, datetime.timedelta(seconds=180))
        assert time.monotonic() - started < 10  # the store's 2 s, retried at most once more
    finally:
        close()


def test_a_store_that_never_connects_after_the_probe_is_a_worker_going_away(monkeypatch):
    """Regression (a CI run of the test above): the store client retries reset connections until
    its 5 s and then reports either the last reset or the time out, by where its retry loop
    stood; the time out came out as ChannelTimeout. With the caller's own deadline the shorter,
    a time out stays the caller's."""
    import torch.distributed as dist

    from ssd.transport import torch_channel

    def never_connects(*args, **kwargs):
        raise dist.DistNetworkError("The client socket has timed out after 5000ms while trying to connect to (h, 1).")

    monkeypatch.setattr(torch_channel.dist, "TCPStore", never_connects)
    with socket.create_server(("127.0.0.1", 0)) as server:  # takes the probe
        address = f"torch://127.0.0.1:{server.getsockname()[1]}"
        with pytest.raises(ChannelClosed, match="going away"):
            connect_torch(address, FP, datetime.timedelta(seconds=180))
        with pytest.raises(ChannelTimeout):
            connect_torch(address, FP, datetime.timedelta(seconds=2))


def test_nccl_between_two_processes_on_one_gpu_is_refused_before_any_starts():
    """NCCL refuses two ranks on one GPU (ncclInvalidUsage, seen on the one-GPU H100 machine, after
    the workers had loaded): the engine says what to change before starting any."""
    from dataclasses import replace

    from ssd.core.config import EngineArgs
    from ssd.engine.proposers import resolve_provider, warm_fork_server

    config = EngineArgs(mode="ssd", draft_transport="torch", device="cuda").to_config()
    for start in (warm_fork_server, resolve_provider):
        with pytest.raises(ValueError, match="refuses two processes on one GPU .cuda:0.*draft_device"):
            start(config, None)
    for other in ({"draft_device": "cuda:1"}, {"draft_transport": "grpc"}, {"device": "cpu", "draft_device": "cpu"}):
        assert callable(resolve_provider(replace(config, **other), None))


def test_draft_workers_sharing_the_targets_gpu_without_mps_are_warned_of(tmp_path, monkeypatch, caplog):
    """Without CUDA MPS a GPU time-slices between processes, and SSD with its workers on the
    target's GPU ran at 0.37x SD on the H200 (0.67x with MPS): the engine says so, and what to
    change, where it starts the workers; not with MPS up, nor for other GPUs."""
    from dataclasses import replace

    from ssd.core.config import EngineArgs
    from ssd.engine import proposers

    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    config = EngineArgs(mode="ssd", device="cuda").to_config()

    def warned(config) -> bool:
        caplog.clear()
        with caplog.at_level("WARNING", logger="ssd.engine.proposers"):
            proposers.resolve_provider(config, None)
        return any("nvidia-cuda-mps-control -d" in r.getMessage() for r in caplog.records)

    assert warned(config) and not proposers.mps_running()
    assert not warned(replace(config, draft_device="cuda:1"))
    assert not warned(replace(config, device="cpu", draft_device="cpu"))
    (tmp_path / "control").touch()  # the daemon's control pipe
    assert proposers.mps_running() and not warned(config)
