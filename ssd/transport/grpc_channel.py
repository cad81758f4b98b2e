"""The `grpc` transport: a `Channel` over one gRPC bidirectional stream per session, and the
listener a target connects to (a draft worker on any host).

Design
- protos/ssd_draft.proto: service DraftWorker, rpc Session(stream Frame) returns (stream Frame). A
  Frame is the frame of ssd/transport/wire.py, header as typed fields, the two bodies as raw
  little-endian bytes: every transport carries one encoding (body layouts: wire.py). The stubs
  are generated at build time (`make protos`) into ssd/transport/_proto/.
- `GrpcListener` serves on a port the OS picks and publishes `grpc://host:port`. Each Session call
  is one target's session, held until the worker accept()s it; the worker then sends the initial
  metadata `ssd-session: open`, which `connect_grpc` waits for. While a session is pending or
  open, another Session call is refused with RESOURCE_EXHAUSTED (the target raises WorkerBusy).
- Either end is a `GrpcChannel`: a thread moves incoming frames from the stream into a queue
  (poll() = the queue is not empty, recv() takes from it); outgoing frames go into a bounded queue
  that the stream's writer drains (the request iterator on the target, the response generator on
  the worker). A peer that stops reading stalls the writer (gRPC flow control), so send() times
  out once the queue is full. Copies: tensor -> bytes on send, bytes -> one bytearray on receive.

Invariants
- poll() never blocks and takes nothing; frames arrive whole and in order, and those that arrived
  before the stream ended are delivered before ChannelClosed.
- The end of the stream or a cancelled/failed RPC (the peer closed, exited, was killed, or its host
  went silent past the keepalive) queues an end marker behind the frames: recv() then raises
  ChannelClosed (a killed peer's socket closes: milliseconds on loopback), and send() does too.
- ChannelTimeout does not end the session: the stream is intact.
- A frame with another fingerprint (or magic) is dropped and raises wire.ForeignMessage from
  recv(); ending the session then is the caller's decision (the worker does).
- close() is graceful: frames sent before it are flushed, then the stream ends and the peer's
  recv() raises ChannelClosed; a stream not over CLOSE_GRACE_S later is cancelled.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import queue
import threading
import time
from concurrent import futures

import grpc
import torch

from ssd.core.protocol import MsgType
from ssd.transport.channel import ChannelClosed, ChannelTimeout, WorkerBusy
from ssd.transport.grpc_address import parse_grpc_address, wait_connected
from ssd.transport.wire import MAGIC, WireCounts, body_size, encode, unframe

try:
    import ssd.transport._proto.ssd_draft_pb2 as pb
    import ssd.transport._proto.ssd_draft_pb2_grpc as pb_grpc
except ModuleNotFoundError as err:
    if not (err.name or "").startswith("ssd.transport._proto"):
        raise
    raise ImportError(
        "the gRPC stubs ssd/transport/_proto/ssd_draft_pb2*.py are missing: they are generated at build "
        "time from protos/ssd_draft.proto; run `make protos` (it needs grpcio-tools: "
        "`pip install grpcio-tools`, which `make install` installs)"
    ) from err

logger = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 128 << 20  # a dense reply [b=8, K=8, V=128k] float32 is ~33 MB
# Each end pings the other this often and gives up after as long without an answer: how a session
# learns that the peer's host is gone (a dead process closes its socket, which is seen at once).
KEEPALIVE = datetime.timedelta(seconds=10)
CLOSE_GRACE_S = 1.0
SESSION_KEY = "ssd-session"  # initial metadata: the worker accepted the session
_WAKE_S = 0.2  # a writer or sender waiting on a queue checks this often whether the session is over
_QUEUED = 64  # outgoing frames a channel holds while the peer is not reading
_STOP = object()  # behind the last outgoing frame: end the stream


def _options(max_message_bytes: int, keepalive: datetime.timedelta) -> list[tuple[str, int]]:
    ms = max(1, int(keepalive.total_seconds() * 1000))
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", ms),
        ("grpc.keepalive_timeout_ms", ms),
        ("grpc.http2.ping_timeout_ms", ms),
        ("grpc.http2.max_pings_without_data", 0),  # an idle session keeps pinging, and the server allows it:
        ("grpc.http2.min_recv_ping_interval_without_data_ms", ms // 2),
        ("grpc.http2.max_ping_strikes", 0),
    ]


def _seconds(timeout: datetime.timedelta | None) -> float | None:
    return None if timeout is None else max(0.0, timeout.total_seconds())


class _End(str):
    """Behind the last incoming frame: why the stream ended."""


class GrpcChannel:
    """The `Channel` protocol (ssd/transport/channel.py) over one Session stream, either end."""

    def __init__(self, fp: int | None, name: str) -> None:
        self.fp, self.name = fp, name  # the worker's end gets its fp at accept()
        self._in: queue.Queue = queue.Queue()
        self._out: queue.Queue = queue.Queue(_QUEUED)
        self._lock = threading.Lock()
        self._closed: str | None = None  # why this end closed
        self._over: str | None = None  # why the stream ended (the peer closed or is gone, the RPC ended)
        self._stalled = False  # the last send or receive timed out: the peer may be unreachable (a partition)
        self.finished = threading.Event()  # the RPC is over
        self.accepted = threading.Event()  # the worker's end: accept() took it
        self._cancel = self._release = lambda: None  # cancel the RPC; close the target's grpc.Channel
        self.counts = WireCounts()  # wire.py's frame bytes, as every transport counts them

    @property
    def over(self) -> bool:
        return self._closed is not None or self._over is not None

    def send(self, kind: MsgType, msg=None, timeout: datetime.timedelta | None = None) -> None:
        """Queues the frame for the stream; ChannelTimeout when the peer has not taken the frames
        before it in time, ChannelClosed once the session is over."""
        round_id, ints, floats = encode(kind, msg)
        frame = pb.Frame(
            magic=MAGIC,
            kind=int(kind),
            round_id=int(round_id),
            fingerprint=self.fp,
            ints=ints.detach().to("cpu", torch.long).contiguous().numpy().tobytes(),
            floats=floats.detach().to("cpu", torch.float32).contiguous().numpy().tobytes(),
        )
        wait = _seconds(timeout)
        deadline = time.monotonic() + (wait if wait is not None else float("inf"))
        while not self.over:
            try:
                self._out.put(frame, timeout=max(0.0, min(_WAKE_S, deadline - time.monotonic())))
            except queue.Full:
                if time.monotonic() >= deadline:
                    self._stalled = True
                    raise ChannelTimeout(f"{self.name}: the peer took no message within {wait:g} s") from None
                continue
            self.counts.on_send(kind, len(frame.ints) + len(frame.floats))
            self._stalled = False
            return
        raise ChannelClosed(f"{self.name}: {self._closed or self._over}")

    def poll(self) -> bool:
        """Whether a frame (or the end of the stream) is waiting; never blocks, takes nothing."""
        return self._closed is not None or not self._in.empty()

    def recv(self, timeout: datetime.timedelta | None = None) -> tuple[MsgType, object]:
        """-> (kind, message; None for READY and SHUTDOWN)"""
        if self._closed is not None:
            raise ChannelClosed(f"{self.name} is closed ({self._closed})")
        try:
            item = self._in.get(timeout=_seconds(timeout))
        except queue.Empty:
            self._stalled = True
            raise ChannelTimeout(f"{self.name}: the peer sent nothing within {_seconds(timeout):g} s") from None
        self._stalled = False
        if isinstance(item, _End):
            self._in.put(item)  # every later recv() says so too
            raise ChannelClosed(f"{self.name}: {item}")
        (n_ints, odd), (n_floats, odd_floats) = divmod(len(item.ints), 8), divmod(len(item.floats), 4)
        if odd or odd_floats:
            raise ValueError(f"{self.name}: malformed frame (bodies of {len(item.ints)} and {len(item.floats)} bytes)")
        header = torch.tensor([item.magic, item.kind, item.round_id, n_ints, n_floats, item.fingerprint, 0, 0])
        body_size(header, self.fp)  # ForeignMessage unless the frame is this pair's
        body = bytearray().join((item.ints, item.floats))  # one copy, into memory the message's tensors own
        kind, msg = unframe(
            header, torch.frombuffer(body, dtype=torch.uint8) if body else torch.zeros(0, dtype=torch.uint8)
        )
        self.counts.on_receive(kind, len(body))
        return kind, msg

    def close(self, peer_exited: bool = False) -> None:
        """Flushes what was sent, ends the stream, releases the connection (the target's end; the
        same whether or not the peer exited: nothing here waits on it)."""
        with self._lock:
            if self._closed is not None:
                return
            self._closed = "closed by this end"
        self._in.put(_End(self._closed))  # wakes a recv() waiting in another thread
        self._stop_writer()  # (a full queue: the writer stops once it drained it, or is cancelled below)
        # A stalled peer gets no grace: the caller (the target's round, after a deadline passed)
        # must not wait on a stream that may be cut off.
        if self._stalled or not self.finished.wait(CLOSE_GRACE_S):
            logger.info("%s: the stream did not end within %g s of close(): cancelling it", self.name, CLOSE_GRACE_S)
            self._cancel()
        self._release()

    # ---- the stream's side ----------------------------------------------------------------------

    def _stop_writer(self) -> None:
        with contextlib.suppress(queue.Full):
            self._out.put_nowait(_STOP)

    def _ended(self, reason: str, finished: bool = False) -> None:
        """The incoming stream ended (the whole RPC, when finished): queue one end marker."""
        with self._lock:
            first, self._over = self._over is None, self._over or reason
        if first:
            self._in.put(_End(reason))
            self._stop_writer()
            logger.info("%s ended: %s", self.name, reason)
        if finished:
            self.finished.set()

    def _frames_out(self):
        """The stream's writer: frames as they are sent, until close() or the end of the session."""
        while True:
            try:
                item = self._out.get(timeout=_WAKE_S)
            except queue.Empty:
                item = _STOP if self.over or self.finished.is_set() else None
            if item is _STOP:
                return
            if item is not None:
                yield item

    def _pump(self, requests) -> None:
        """The worker's end: the target's frames into the queue."""
        try:
            for frame in requests:
                self._in.put(frame)
            reason = "the target closed the session"
        except Exception as err:  # noqa: BLE001 - grpc raises several kinds for a cancelled RPC
            reason = f"the target is gone ({type(err).__name__}: {err})"
        self._ended(reason)

    def _read(self, call, opened: threading.Event) -> None:
        """The target's end: waits for the worker to accept or refuse, then its frames into the queue."""
        try:
            call.initial_metadata()
            opened.set()
            for frame in call:
                self._in.put(frame)
            reason = "the draft worker ended the session"
        except grpc.RpcError as err:
            reason = f"the draft worker is gone ({err.code().name}: {err.details()})"
        except Exception as err:  # noqa: BLE001 - anything else still ends the session
            reason = f"the stream failed ({type(err).__name__}: {err})"
        opened.set()
        self._ended(reason, finished=True)


class _Servicer(pb_grpc.DraftWorkerServicer):
    def __init__(self, serve) -> None:
        self.Session = serve


class GrpcListener:
    """The worker's end (the `Listener` protocol): a gRPC server on a port the OS picked. host: the
    address targets reach this worker at; the keywords should match the targets' (connect_grpc)."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        *,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        keepalive: datetime.timedelta = KEEPALIVE,
    ) -> None:
        self.host = host
        self._lock = threading.Lock()
        self._arrivals: queue.Queue[GrpcChannel | None] = queue.Queue()  # sessions waiting for accept()
        self._current: GrpcChannel | None = None  # the session pending or open: others are refused
        self._open: GrpcChannel | None = None  # the last one accept() returned
        self._sessions, self._closed = 0, False
        bind = f"[{host}]" if ":" in host else host
        # Threads: the open session's writer, one pending session, refusals.
        self._threads = futures.ThreadPoolExecutor(4, thread_name_prefix="ssd-grpc-worker")
        self._server = grpc.server(
            self._threads, options=[*_options(max_message_bytes, keepalive), ("grpc.so_reuseport", 0)]
        )
        pb_grpc.add_DraftWorkerServicer_to_server(_Servicer(self._serve), self._server)
        port = self._server.add_insecure_port(f"{bind}:0")
        if not port:
            raise RuntimeError(f"grpc transport: cannot listen on {host}")
        self._server.start()
        self.address = f"grpc://{bind}:{port}"

    def accept(self, fp: int, timeout: datetime.timedelta | None = None) -> GrpcChannel:
        """Ends the previous session (closes its channel), then the next target's session."""
        if self._open is not None:
            self._open.close()
            self._open = None
        wait = _seconds(timeout)
        deadline = None if wait is None else time.monotonic() + wait
        while not self._closed:
            try:
                channel = self._arrivals.get(
                    timeout=None if deadline is None else max(0.0, deadline - time.monotonic())
                )
            except queue.Empty:
                raise ChannelTimeout(f"no target connected to {self.address} within {wait:g} s") from None
            if channel is not None and not channel.over:  # else close() woke us, or the target gave up
                channel.fp, self._open = fp, channel
                channel.accepted.set()
                logger.info("%s open", channel.name)
                return channel
        raise ChannelClosed(f"listener {self.address} is closed")

    @property
    def pending(self) -> bool:
        """A target's session waits for accept(). A target that gave up is dropped once its RPC's
        end reaches the server, a moment after it gave up: until then accept() may still hand
        that session out (its first receive then raises ChannelClosed)."""
        current = self._current
        return current is not None and not current.over and not current.accepted.is_set()

    def close(self) -> None:
        """Ends the open session, if any, refuses new ones and stops the server."""
        self._closed = True
        if self._open is not None:
            self._open.close()
            self._open = None
        self._arrivals.put(None)
        self._server.stop(grace=None).wait(5)
        self._threads.shutdown(wait=False)

    def _serve(self, requests, context):
        """One Session call: refused while another is pending or open, else held until accept()."""
        with self._lock:
            self._sessions += 1
            channel = GrpcChannel(None, f"session {self._sessions} on {self.address}")
            refused = self._closed or (self._current is not None and not self._current.over)
            if not refused:
                self._current = channel
        if refused:
            context.set_code(grpc.StatusCode.UNAVAILABLE if self._closed else grpc.StatusCode.RESOURCE_EXHAUSTED)
            context.set_details(
                "the draft worker is shutting down"
                if self._closed
                else "the draft worker is busy with another target: it serves one session at a time"
            )
            return
        channel._cancel = context.cancel
        if not context.add_callback(lambda: channel._ended("the target's RPC ended", finished=True)):
            channel._ended("the target's RPC ended", finished=True)
        self._arrivals.put(channel)
        while not channel.accepted.wait(_WAKE_S):
            if channel.over:  # the target gave up, or the listener closed
                return
        context.send_initial_metadata(((SESSION_KEY, "open"),))
        threading.Thread(target=channel._pump, args=(requests,), name="ssd-grpc-recv", daemon=True).start()
        yield from channel._frames_out()


def connect_grpc(
    address: str,
    fp: int,
    timeout: datetime.timedelta,
    *,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    keepalive: datetime.timedelta = KEEPALIVE,
) -> GrpcChannel:
    """The target's end: a session with the worker listening at `address` ('grpc://HOST:PORT').
    ValueError: malformed address. ChannelClosed: nothing listens there, or the worker refused
    the session. ChannelTimeout: no answer, or the session not accepted, within `timeout`.
    WorkerBusy: it serves another target."""
    host, port = parse_grpc_address(address)
    deadline = time.monotonic() + timeout.total_seconds()
    conn = grpc.insecure_channel(
        f"[{host}]:{port}" if ":" in host else f"{host}:{port}", options=_options(max_message_bytes, keepalive)
    )
    call = None
    try:
        wait_connected(conn, address, timeout)
        channel = GrpcChannel(fp, f"session with the draft worker at {address}")
        call = pb_grpc.DraftWorkerStub(conn).Session(channel._frames_out())
        channel._cancel, channel._release = call.cancel, conn.close
        opened = threading.Event()
        threading.Thread(target=channel._read, args=(call, opened), name="ssd-grpc-recv", daemon=True).start()
        if not opened.wait(max(0.0, deadline - time.monotonic())):
            raise ChannelTimeout(
                f"the draft worker at {address} did not accept the session within {timeout.total_seconds():g} s"
            )
        if not any(key == SESSION_KEY for key, _ in call.initial_metadata() or ()):
            code, details = call.code(), call.details()
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise WorkerBusy(f"draft worker at {address} refused the session: {details}")
            raise ChannelClosed(f"draft worker at {address} refused the session ({code.name}: {details})")
    except BaseException:
        if call is not None:
            call.cancel()
        conn.close()
        raise
    logger.info("%s open", channel.name)
    return channel
