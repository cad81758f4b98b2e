"""The draft form of a batch's adjustments on the host (`HostDraftAdjustments`): for rows a draft
processes on the host, draft_adjustments.py's columns and arithmetic, each step one compiled
loop (numba) instead of a sequence of tensor operations.

Why a second implementation: on a CPU a draft step's processing is a dozen tiny tensor
operations, and inside the engine each one cost 7-15 us, not its 2-4 us in a warm loop: the
draft's forward between two steps evicts the code and data of every distinct operation's
dispatch. A compiled loop is one call with a small footprint (in the engine, an apply 24-26 us
and an advance 28-33 us, against 44-96 and 68-124 in tensor operations; docs/benchmarks.md, "The
host form"). Device rows keep the tensor form: their tensors stay on the device, with no host
read. tests/test_draft_adjustments.py holds both forms to the same reference.

The arrays are numpy views of the host's tensors (no copy); the kernels compile on a process's
first call and numba caches them on disk (`cache=True`: in NUMBA_CACHE_DIR where it is set, else
in __pycache__ beside this file, else in ~/.cache/numba), so later processes load them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np
import torch

from ssd.processing.adjustments import Adjustments, build, masked_in_place, min_p_filtered
from ssd.processing.request import Processing

# The columns' places, spelled here and not imported: numba compiles them into the cached loops
# and checks only this file for changes, so a cache would outlive a change made elsewhere.
# tests/test_draft_adjustments.py holds them to draft_adjustments' and adjustments'.
POS, NEG, SHIFT, OUT, BANNED = range(5)  # DraftAdjustments.columns'
COUNT, SEEN, BIAS, HELD_BACK = range(4)  # Adjustments.columns' (HELD_BACK: its BANNED)


@numba.njit(cache=True)
def _made(columns, repetition, frequency, presence):
    """Adjustments' columns [b, m, 4] (COUNT, SEEN, BIAS, BANNED) and per-row repetition,
    frequency and presence [b, 1, 1] -> (columns [b, m, 5], occurred [b, 3], presence [b]), as
    DraftAdjustments.of computes them."""
    b, m, _ = columns.shape
    out = np.empty((b, m, 5), np.float32)
    occurred = np.empty((b, 3), np.float32)
    minus_presence = np.empty(b, np.float32)
    for r in range(b):
        penalty = repetition[r, 0, 0]
        inverse = np.float32(1.0) / penalty
        occurred[r, 0], occurred[r, 1], occurred[r, 2] = inverse, penalty, -frequency[r, 0, 0]
        minus_presence[r] = -presence[r, 0, 0]
        for c in range(m):
            count, seen = columns[r, c, COUNT], columns[r, c, SEEN] > 0
            out[r, c, POS] = inverse if seen else np.float32(1.0)
            out[r, c, NEG] = penalty if seen else np.float32(1.0)
            out[r, c, SHIFT] = columns[r, c, BIAS] - frequency[r, 0, 0] * count
            out[r, c, OUT] = min(count, np.float32(1.0))
            out[r, c, BANNED] = columns[r, c, HELD_BACK]
    return out, occurred, minus_presence


@numba.njit(cache=True)
def _adjust(logits, ids, columns, presence, short_by):
    """logits [b, 1, V] float32, adjusted where they are at each row's columns. All of a row's
    columns are read before any is written: padding repeats a column, and must not adjust its
    token twice."""
    b, m = ids.shape
    vocab = logits.shape[2]
    picked = np.empty(m, np.float32)
    for r in range(b):
        early = short_by[r] > 0
        for c in range(m):
            token = ids[r, c]
            assert 0 <= token < vocab
            x = logits[r, 0, token]
            scale = columns[r, c, NEG] if x < 0 else columns[r, c, POS]
            x = (columns[r, c, SHIFT] + columns[r, c, OUT] * presence[r]) + x * scale
            picked[c] = -np.inf if early and columns[r, c, BANNED] > 0 else x
        for c in range(m):
            logits[r, 0, ids[r, c]] = picked[c]


@numba.njit(cache=True)
def _advance(ids, columns, tokens, occurred, short_by):
    """After each row appends tokens[r]: (ids [b, m + 1], columns [b, m + 1, 5], short_by [b]).
    A column of the token gets POS and NEG the penalty's, SHIFT occurred[r, 2] more and OUT 1;
    the new column is a new token's (occurred's values, not banned) or repeats the row's first."""
    b, m = ids.shape
    new_ids = np.empty((b, m + 1), ids.dtype)
    new_columns = np.empty((b, m + 1, 5), np.float32)
    new_short_by = np.empty_like(short_by)
    for r in range(b):
        new_short_by[r] = short_by[r] - 1
        tracked = False
        for c in range(m):
            new_ids[r, c] = ids[r, c]
            for v in range(5):
                new_columns[r, c, v] = columns[r, c, v]
            if ids[r, c] == tokens[r]:
                tracked = True
                new_columns[r, c, POS] = occurred[r, 0]
                new_columns[r, c, NEG] = occurred[r, 1]
                new_columns[r, c, SHIFT] += occurred[r, 2]
                new_columns[r, c, OUT] = 1.0
        if tracked:
            new_ids[r, m] = new_ids[r, 0]
            for v in range(5):
                new_columns[r, m, v] = new_columns[r, 0, v]
        else:
            new_ids[r, m] = tokens[r]
            new_columns[r, m, POS] = occurred[r, 0]
            new_columns[r, m, NEG] = occurred[r, 1]
            new_columns[r, m, SHIFT] = occurred[r, 2]
            new_columns[r, m, OUT] = 1.0
            new_columns[r, m, BANNED] = 0.0
    return new_ids, new_columns, new_short_by


@dataclass(frozen=True)
class HostDraftAdjustments:
    """DraftAdjustments' fields, as arrays, for b rows on the host; the same methods."""

    ids: np.ndarray  # [b, m] int64
    columns: np.ndarray  # [b, m, 5] float32, POS, NEG, SHIFT, OUT, BANNED
    occurred: np.ndarray  # [b, 3] float32: 1 / penalty, penalty, -frequency_penalty (what an occurrence sets or adds)
    presence: np.ndarray  # [b] float32, minus the presence penalty
    short_by: np.ndarray  # [b] int64, as Adjustments.short_by (all 0 where it is None)
    min_p: torch.Tensor | None  # [b, 1, 1] float, as Adjustments.min_p
    allowed: torch.Tensor | None  # [b, V] bool, as Adjustments.allowed
    masks: torch.Tensor | None = None  # [b, 1, V] bool, this position's token masks

    @classmethod
    def of(cls, first: Adjustments) -> "HostDraftAdjustments":
        """A round's (or a branch's) first position's adjustments (on the host) in this form."""
        assert first.drafted.shape[1] == 0, "a draft starts from a first position's adjustments"
        b = first.ids.shape[0]
        short_by = np.zeros(b, np.int64) if first.short_by is None else first.short_by.numpy()
        made = _made(first.columns.numpy(), first.repetition.numpy(), first.frequency.numpy(), first.presence.numpy())
        return cls(
            first.ids.numpy(),
            *made,
            short_by,
            first.min_p,
            first.allowed,
            first.masks,
        )

    def apply(self, logits: torch.Tensor, in_place: bool = False) -> torch.Tensor:
        """logits [b, 1, V] on the host -> adjusted logits [b, 1, V] (float32); in_place as
        Adjustments.apply."""
        if logits.dtype != torch.float32:
            logits = logits.float()  # a copy of our own
        elif not in_place:
            logits = logits.clone()
        # numba checks no bounds: the rows must be this form's (the token ids, _adjust checks).
        assert logits.shape[0] == self.ids.shape[0] and logits.shape[1] == 1, "one position of this form's rows"
        _adjust(logits.numpy(), self.ids, self.columns, self.presence, self.short_by)
        return masked_in_place(logits, self.allowed, self.masks)

    def advanced(self, tokens: torch.Tensor, masks: torch.Tensor | None = None) -> "HostDraftAdjustments":
        """As DraftAdjustments.advanced: tokens [b] (host) appended to each row's history."""
        assert (masks is None) == (self.masks is None), "the next position's token masks are the caller's"
        assert tokens.shape == self.short_by.shape, "a token per row"  # numba checks no bounds
        ids, columns, short_by = _advance(self.ids, self.columns, tokens.numpy(), self.occurred, self.short_by)
        return HostDraftAdjustments(
            ids, columns, self.occurred, self.presence, short_by, self.min_p, self.allowed, masks
        )

    def to(self, device: torch.device) -> "HostDraftAdjustments":
        assert device.type == "cpu", "the host form stays on the host (draft_form chooses it for host rows only)"
        return self

    def min_p_filtered(self, scaled: torch.Tensor) -> torch.Tensor:
        """As Adjustments.min_p_filtered."""
        return min_p_filtered(self.min_p, scaled)


def compile_loops() -> None:
    """Compiles the loops (or loads them from numba's cache) for the inputs a draft passes:
    logits contiguous or strided (a draft vocabulary wider than the target's is cut), rows with
    and without min_tokens. The Dockerfile runs this at build time."""
    rows = [(Processing(repetition_penalty=1.1, min_tokens=2, stop_token_ids=(0,)), [1], [2]), (Processing(), [3], [])]
    for kept in (rows, rows[1:]):
        form = HostDraftAdjustments.of(build(kept, torch.zeros(len(kept), 0, dtype=torch.long), 8))
        form = form.advanced(torch.arange(len(kept)))
        form.apply(torch.randn(len(kept), 1, 8))
        form.apply(torch.randn(len(kept), 1, 16)[..., :8], in_place=True)
