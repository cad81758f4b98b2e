"""Where a `grpc` transport's draft worker listens and whether it answers: the address form
('grpc://HOST:PORT') and the wait for a connection that grpc_channel.connect_grpc opens with."""

from __future__ import annotations

import datetime
import queue
from urllib.parse import urlsplit

import grpc

from ssd.transport.channel import ChannelClosed, ChannelTimeout


def parse_grpc_address(address: str) -> tuple[str, int]:
    """'grpc://HOST:PORT' -> (host, port); ValueError naming the expected form otherwise."""
    expected = f"bad grpc transport address {address!r}: expected 'grpc://HOST:PORT'"
    try:
        parts = urlsplit(address)
        host, port = parts.hostname, parts.port
    except (ValueError, TypeError, AttributeError) as err:
        raise ValueError(expected) from err
    if parts.scheme != "grpc" or not host or not port or parts.path or parts.query or parts.fragment or parts.username:
        raise ValueError(expected)
    return host, port


def wait_connected(conn: grpc.Channel, address: str, timeout: datetime.timedelta) -> None:
    """Until the connection is up: ChannelClosed at once when refused, ChannelTimeout when no
    answer came in time (grpc.channel_ready_future would retry a refused connection instead)."""
    settled: queue.Queue[grpc.ChannelConnectivity] = queue.Queue()
    ends = (
        grpc.ChannelConnectivity.READY,
        grpc.ChannelConnectivity.TRANSIENT_FAILURE,
        grpc.ChannelConnectivity.SHUTDOWN,
    )

    def watch(state: grpc.ChannelConnectivity) -> None:
        if state in ends:
            settled.put(state)

    conn.subscribe(watch, try_to_connect=True)
    try:
        state = settled.get(timeout=timeout.total_seconds())
    except queue.Empty:
        raise ChannelTimeout(f"no draft worker answered at {address} within {timeout.total_seconds():g} s") from None
    finally:
        conn.unsubscribe(watch)
    if state != grpc.ChannelConnectivity.READY:
        raise ChannelClosed(f"no draft worker listens at {address} (connection failed)")
