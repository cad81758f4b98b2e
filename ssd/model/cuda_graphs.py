"""CUDA graphs of the lean forward: one captured forward per (rows, tokens, width) bucket.

On a GPU a small model's forward is launch-bound: the bundled 10-layer target launches a few
hundred kernels per forward, and the host takes longer to issue them than the GPU to run them.
A CUDA graph issues the whole forward as one launch. A graph replays fixed shapes at fixed
addresses, so each captured forward works on padded, static buffers:

    packed  [B, 4, n] long   tokens, positions, write columns, valid (0/1), one host copy per call
    mask    [B, 1, n, W]     a scratch forward's given mask (a default forward builds its mask
                             inside the graph from the write columns and valid)
    logits  [B, n, V] float  what the replay leaves; the caller gets a copy of its first b rows

with B = b rounded up to a power of two and W = the forward's attention width rounded up to a
power of two (at least 256). Padding rows b..B-1 write into cache rows no live row uses (a full
cache's rows past its batch are free) and their logits are dropped; columns past a row's width
are masked, so a row's logits equal the eager forward's up to the order of the additions that
a different attention width gives (tests compare greedy output with Hugging Face).

Graphs are captured lazily, the first time a bucket is met, against one cache's buffers: they
live in the cache's storage (StaticKVCache.captured), which drops them whenever its buffers move
(growth), and the key names the rotary table's version, which the graphed forward reads. All of
one runner's graphs share one memory pool: their replays never overlap (one stream), and each
output is copied out before the next replay.

Outside the buckets (a prefill, a window over rows being admitted, more than MAX_TOKENS rows x
tokens, a cache with no buffers yet) the forward runs eagerly, and GraphStats counts it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ssd.model.kv_cache import StaticKVCache, default_mask

WIDTH_FLOOR = 256  # smallest attention width a graph is captured for
MAX_TOKENS = 1024  # rows x tokens of the largest captured forward (B x n after padding)
MAX_NEW_TOKENS = 64  # tokens per row of the largest captured forward (a verification, a tree depth)


@dataclass
class GraphStats:
    """What a runner's graphs did: replays, eager forwards (outside the buckets), captures; and
    the same for its device steps (ssd/model/step_graphs.py). capture_s counts both."""

    replays: int = 0
    eager_forwards: int = 0
    captures: int = 0
    capture_s: float = 0.0
    step_replays: int = 0
    step_captures: int = 0
    step_eager: int = 0  # device steps run eagerly: past step_graphs.MAX_GRAPHS, or not capturable


@dataclass
class _Captured:
    packed: torch.Tensor  # [B, 4, n] long: tokens, positions, write columns, valid
    mask: torch.Tensor | None  # [B, 1, n, W] attention dtype, for a scratch forward; None: built in the graph
    replay: Callable[[], None] | None = None  # runs the bucket's forward on the buffers above
    logits: torch.Tensor | None = None  # [B, n, V] float32, written by each replay


def record(run: Callable[[], object], device: torch.device, stream, pool) -> tuple[Callable[[], None], object]:
    """A CUDA graph of run() on `stream`, its memory in `pool`, after one warm-up run there (CUDA
    libraries need one before a capture) -> (the graph's replay, what run() returned during the
    capture: the tensors each replay rewrites)."""
    current = torch.cuda.current_stream(device)
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        run()
    current.wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    # thread_local: another thread of this process (a channel's receiver) may use CUDA meanwhile.
    with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
        out = run()
    return graph.replay, out


def padded(x: int, floor: int = 1) -> int:
    """The bucket of x: the next power of two, at least floor."""
    return max(floor, 1 << (max(1, x) - 1).bit_length())


class CudaGraphs:
    """The captured forwards of one runner (one lean model on one CUDA device).

    capture=False runs each bucket's padded forward eagerly instead of replaying a graph: the same
    buffers, padding and in-graph mask on any device, which is how CPU tests check them."""

    def __init__(self, lean, device: torch.device, attention_dtype: torch.dtype, capture: bool = True) -> None:
        self.lean = lean
        self.device = device
        self.attention_dtype = attention_dtype
        self.capture = capture
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.stream = torch.cuda.Stream(device) if capture else None  # captures and their warm-ups run here
        self.stats = GraphStats()

    def forward(
        self,
        cache: StaticKVCache,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        columns: torch.Tensor,
        new_valid: torch.Tensor,
        attn_mask: torch.Tensor | None,
        width: int,
    ) -> torch.Tensor | None:
        """The forward's logits [b, n, V] (float32, on the device, a copy of its own) by a graph
        replay, or None where no graph applies (the caller runs it eagerly). tokens, positions,
        columns and new_valid are [b, n], on the host or the device; columns are where each token
        is written, after cache.begin_forward reserved them; attn_mask [b, 1, n, width] is a
        scratch forward's (None: a default forward's, built in the graph)."""
        b, n = tokens.shape
        rows, wide = padded(b), padded(width, WIDTH_FLOOR)
        if n > MAX_NEW_TOKENS or rows * n > MAX_TOKENS or cache.captured() is None:
            return None
        cache.reserve(rows, wide)  # may move the buffers, which drops the graphs recorded on them
        captured = cache.captured()
        key = (rows, n, wide, attn_mask is not None, self.lean.rope_version)
        entry = captured.get(key)
        inputs = (tokens, positions, columns, new_valid.long())  # each [b, n], on the host or the device
        if entry is None:
            entry = captured[key] = self._capture(cache, key, inputs, attn_mask, width)
        else:
            self._fill(entry, inputs, attn_mask, width)
        entry.replay()
        self.stats.replays += 1
        return entry.logits[:b].clone()

    def _fill(self, entry: _Captured, inputs: tuple, attn_mask: torch.Tensor | None, width: int) -> None:
        """Copy a call's inputs into the bucket's buffers without waiting for the device: host
        tensors go through pinned memory (a blocking copy from pageable memory would wait for
        every queued kernel, the graph replays before it included)."""
        b = inputs[0].shape[0]
        if all(t.device.type == "cpu" for t in inputs):
            staged = torch.stack(inputs, 1)  # one copy to the device
            entry.packed[:b].copy_(staged.pin_memory() if self.capture else staged, non_blocking=True)
        else:  # a device round's tokens are on the device already; its positions and columns are not
            # Not pinned: SD's draft steps come here (3 host inputs a step), and with each one
            # pinned SD ran 728-831 tok/s against 864-876 unpinned (H200 under MPS, one A/B of
            # three runs each, 2026-11-26); pinning the all-host branch made no difference (H100).
            for i, t in enumerate(inputs):
                entry.packed[:b, i].copy_(t, non_blocking=True)
        if entry.mask is not None:
            entry.mask[:b, :, :, :width].copy_(attn_mask, non_blocking=True)
            entry.mask[:b, :, :, width:].fill_(torch.finfo(entry.mask.dtype).min)

    def _capture(self, cache, key, inputs: tuple, attn_mask: torch.Tensor | None, width: int) -> _Captured:
        """Record the bucket's forward. Its inputs are filled first with this call's, so the
        warm-up run (which CUDA libraries need before a capture) writes only where this call's
        replay writes next."""
        started = time.perf_counter()
        rows, n, wide, given, _ = key
        entry = _Captured(
            packed=torch.zeros(rows, 4, n, dtype=torch.long, device=self.device),
            mask=torch.zeros(rows, 1, n, wide, dtype=self.attention_dtype, device=self.device) if given else None,
        )
        # Padding rows write at columns 0..n-1 of their free cache rows.
        entry.packed[inputs[0].shape[0] :, 2] = torch.arange(n, device=self.device)
        self._fill(entry, inputs, attn_mask, width)

        def run() -> torch.Tensor:
            tokens, positions, columns, valid = entry.packed.unbind(1)
            view = cache.static_view(rows, columns, wide)
            # A default forward writes at lengths + 0..n-1: its first column is the row's length.
            mask = entry.mask if given else default_mask(columns[:, 0], valid.bool(), wide, self.attention_dtype)
            return self.lean(tokens, mask, positions, view).float()

        if not self.capture:
            entry.replay = lambda: setattr(entry, "logits", run())
        else:
            entry.replay, entry.logits = record(run, self.device, self.stream, self.pool)
        self.stats.captures += 1
        self.stats.capture_s += time.perf_counter() - started
        return entry
