"""CUDA graphs of a round's device steps: the sampling and verification between forwards.

Between the target's forward and the round's one copy to the host, a device round processes the
logits and runs the verification rule: a few dozen small kernels (a sort, softmaxes, cumsums,
gathers). An SD draft step runs a dozen more between two draft forwards. On a GPU each of them
costs the host a launch and Python's dispatch, more than the GPU takes to run it: measured on an
H200 with the demo pair, ar's round took 1.97 ms of which its GPU kernels 1.15 ms. Captured once
per signature, a step replays as one launch.

What may be captured: a pure function of tensors (None allowed in place of one) returning a tuple
of tensors, with no host reads and the same kernels for the same input shapes: the device
functions of ssd/core/sampling.py and ssd/engine/verify.py are written so, and
tests/test_device_round.py traces them with fullgraph=True. Anything a function decides on the
host (a batch being all greedy, say) and every constant bound into it (the vocabulary, Saguaro's
C) goes into the step's name, which is part of its key.

    key      (name, each input's shape and dtype, or None), rows padded
    inputs   static device buffers; a call copies its inputs in (host ones through pinned memory,
             without waiting for the device)
    outputs  what the capture allocated; a call returns copies of its rows

Dimension 0 of every input and output is the batch's rows, b, and a step is captured for b
rounded up to a power of two (as the forwards' buckets are): a server meets a handful of
buckets, not every batch size, and at a 128k vocabulary the verification's [b, K+1, V] logits
buffer is 3.6 MB a row. Rows past b hold zeros or an earlier call's rows: computed, and dropped.

All graphs of one StepGraphs share a memory pool (their replays never overlap: one stream). A
later capture may reuse memory an earlier graph only needs while it runs, so a replay may
overwrite another graph's outputs: that is why callers get copies. At most MAX_GRAPHS are
captured; a call with another signature after that runs eagerly, counted in the stats, as does
a step whose capture failed (with a warning that says why).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ssd.model.cuda_graphs import GraphStats, padded, record

MAX_GRAPHS = 64  # signatures per StepGraphs: batch sizes x a few names in practice
_UNSEEN = object()  # a signature not met yet (None in StepGraphs.steps: met, and not capturable)

logger = logging.getLogger(__name__)


@dataclass
class _Step:
    inputs: tuple[torch.Tensor | None, ...]  # static buffers, one per input (None stays None)
    replay: Callable[[], None]
    outputs: tuple[torch.Tensor, ...] = ()  # written by each replay


def _rows(inputs: tuple) -> int:
    """The batch's rows: dimension 0 of every input given."""
    rows = {t.shape[0] for t in inputs if t is not None}
    assert len(rows) == 1, f"a step's inputs share their rows (dimension 0): {rows}"
    return rows.pop()


def _signature(inputs: tuple, rows: int) -> tuple:
    return tuple(None if t is None else ((rows, *t.shape[1:]), t.dtype) for t in inputs)


class StepGraphs:
    """The captured device steps of one runner's device.

    capture=False runs each step eagerly on its static buffers instead of replaying a graph (the
    same copies in and out on any device), which is how CPU tests check the mechanics."""

    def __init__(self, device: torch.device, stats: GraphStats, capture: bool = True) -> None:
        self.device = device
        self.stats = stats
        self.capture = capture
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.stream = torch.cuda.Stream(device) if capture else None
        self.steps: dict[tuple, _Step | None] = {}

    def __call__(self, name: str, fn: Callable[..., tuple], *inputs: torch.Tensor | None) -> tuple:
        """fn(*inputs) by a graph replay (captured on the signature's first call) -> copies of its
        outputs, on this device."""
        b = _rows(inputs)
        key = (name, _signature(inputs, padded(b)))
        step = self.steps.get(key, _UNSEEN)
        if step is _UNSEEN and len(self.steps) < MAX_GRAPHS:
            step = self.steps[key] = self._captured(name, fn, inputs, padded(b))
        elif step is not _UNSEEN and step is not None:
            self._fill(step, inputs)
        if step is _UNSEEN or step is None:  # past the limit, or not capturable
            self.stats.step_eager += 1
            return fn(*(None if t is None else t.to(self.device, non_blocking=True) for t in inputs))
        step.replay()
        self.stats.step_replays += 1
        return tuple(t[:b].clone() for t in step.outputs)

    def _fill(self, step: _Step, inputs: tuple) -> None:
        for buffer, t in zip(step.inputs, inputs):
            if t is None:
                continue
            if t.device.type == "cpu" and self.capture:
                t = t.contiguous().pin_memory()  # from pageable memory a copy waits for every queued kernel
            buffer[: t.shape[0]].copy_(t, non_blocking=True)

    def _captured(self, name: str, fn: Callable[..., tuple], inputs: tuple, rows: int) -> _Step | None:
        """_capture, or None where the step cannot be captured (a kernel that a capture refuses):
        said once, and the signature's calls run eagerly (counted in step_eager)."""
        try:
            return self._capture(fn, inputs, rows)
        except RuntimeError as err:
            logger.warning("the device step %r could not be captured, so it runs eagerly: %s", name, err)
            return None

    def _capture(self, fn: Callable[..., tuple], inputs: tuple, rows: int) -> _Step:
        """Record fn on buffers of `rows` rows, filled with this call's inputs before the warm-up
        run that CUDA libraries need ahead of a capture (the caller's replay then computes them)."""
        started = time.perf_counter()
        buffers = tuple(
            None if t is None else torch.zeros((rows, *t.shape[1:]), dtype=t.dtype, device=self.device) for t in inputs
        )
        step = _Step(buffers, replay=lambda: None)
        self._fill(step, inputs)
        if not self.capture:

            def run() -> None:
                step.outputs = tuple(fn(*buffers))

            step.replay = run
        else:
            step.replay, outputs = record(lambda: fn(*buffers), self.device, self.stream, self.pool)
            step.outputs = tuple(outputs)
        self.stats.step_captures += 1
        self.stats.capture_s += time.perf_counter() - started
        return step


def run_step(
    steps: StepGraphs | None, device: torch.device, name: str, fn: Callable[..., tuple], *inputs: torch.Tensor | None
) -> tuple:
    """fn(*inputs) on `device`: through `steps` where the runner has them (on a CUDA device with
    graphs on), else eagerly."""
    if steps is not None:
        return steps(name, fn, *inputs)
    return fn(*(None if t is None else t.to(device, non_blocking=True) for t in inputs))
