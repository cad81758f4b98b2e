"""The transports a target connects to, by name: a worker listens (`make_listener`) and
publishes an address; a target reaches it (`connect_channel`) from anywhere."""

from __future__ import annotations

import datetime

from ssd.transport.channel import Channel, Listener


def make_listener(transport: str, host: str, device: str = "cpu") -> Listener:
    """The worker's end of a connectable transport: "torch" (a torch.distributed pair group per
    session) or "grpc" (a bidirectional stream per session). host: the address targets reach
    this worker at."""
    if transport == "torch":
        from ssd.transport.torch_channel import TorchListener

        return TorchListener(host, device)
    if transport == "grpc":
        from ssd.transport.grpc_channel import GrpcListener

        return GrpcListener(host)
    raise ValueError(f"draft transport {transport!r} cannot be listened on: choose 'torch' or 'grpc'")


def connect_channel(address: str, fp: int, timeout: datetime.timedelta, device: str = "cpu") -> Channel:
    """A channel to a listening worker at `address` ("torch://host:port" or "grpc://host:port")."""
    scheme = address.split("://", 1)[0]
    if scheme == "torch":
        from ssd.transport.torch_channel import connect_torch

        return connect_torch(address, fp, timeout, device)
    if scheme == "grpc":
        from ssd.transport.grpc_channel import connect_grpc

        return connect_grpc(address, fp, timeout)
    raise ValueError(f"draft worker address {address!r}: expected torch://host:port or grpc://host:port")
