"""Host-to-device copies that do not wait for the device.

torch synchronizes the stream after a copy from pageable host memory to a CUDA device
(non_blocking=False), so every `.to("cuda")` of a host tensor makes the host wait for all the
work it has queued. A round that prepares its next device steps while earlier ones run (the SSD
drafter's fork inputs and its tree's mask, uniforms and fan-out) copies through pinned memory
instead: the copy is queued behind that work and the host goes on. The pinned block is torch's
(its caching host allocator reuses it only once the copy has run), so the source may change
right after the call.

The other way, `to_host_async` queues a copy to the host, which the reader may use once an event
recorded after it has completed: the SSD drafter reads its tree's tokens and grid this way, so
answering an outcome never waits for a depth still queued.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """t on `device`, queued behind the device's work where it is a CUDA device and t is on the
    host; elsewhere t.to(device)."""
    if torch.device(device).type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    # contiguous: pinning keeps strides, and an expanded view's pinned copy would overlap itself.
    return t.contiguous().pin_memory().to(device, non_blocking=True)


def to_host_async(t: torch.Tensor) -> torch.Tensor:
    """A host copy of a CUDA tensor t, queued behind the work before it (into pinned memory,
    without a wait): read it only after an event recorded after this call has completed (then
    the copy has too). t itself where it is not on a CUDA device."""
    if t.device.type != "cuda":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


def read_after(done: torch.cuda.Event | None, device: torch.device, read: Callable[[], T]) -> T:
    """read(), which copies device tensors to the host, on a side stream of `device` that waits
    for the event `done` alone: not for work queued on the current stream after it. read() as it
    is where done is None (the host, or nothing queued). Its tensors must have been made before
    `done` was recorded; what it allocates is the side stream's, freed once read() has synced."""
    if done is None:
        return read()
    side = torch.cuda.Stream(device)
    with torch.cuda.stream(side):
        side.wait_event(done)
        return read()
