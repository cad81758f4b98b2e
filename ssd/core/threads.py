"""A process's torch thread count, set in one place where the process starts."""

from __future__ import annotations

import torch


def set_process_threads(threads: int | None) -> None:
    """Set this process's torch intra-op threads, once, where the process starts: an engine's
    (ssd/engine/factory.py), a draft worker's (ssd/worker/main.py, the Ray pool member), a
    tensor-parallel rank's (ssd/model/tp_launch.py), a bench worker's. None keeps what the process
    has: torch's default, OMP_NUM_THREADS, or its caller's setting. The only other setter is the
    round's own switch between modes (ssd/engine/mode_policy.py), which restores this on close."""
    if threads is not None:
        torch.set_num_threads(threads)
