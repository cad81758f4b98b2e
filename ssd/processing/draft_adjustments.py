"""The draft form of a batch's adjustments (`DraftAdjustments`, on the draft's device; its host
twin is host_draft_adjustments.py): one position at a time, each drafted token appended to the
history before the next position is processed (the SD draft, SSD's tree branches and neural
backup). `draft_form` chooses between the two by where a draft's rows are processed.

`Adjustments` (adjustments.py, the exact form) keeps per column what the reference's steps read
(counts, seen, bias, banned) and derives each column's factor and shift in every `apply`: 17
tensor operations at one position. A draft applies K times a round and advances K - 1 times, and at
batch 1 each operation costs 3-4 us in the engine whatever its size, so this form keeps the
derived values instead, which `apply` reads in 7 operations and `advanced` updates in 13:

    column = (POS, NEG, SHIFT, OUT, BANNED)
    adjusted logit = logit * (NEG if logit < 0 else POS) + SHIFT - presence * OUT
    POS, NEG:  1 / repetition_penalty and repetition_penalty where the token was seen, else 1
    SHIFT:     logit_bias - frequency_penalty * (occurrences in the output)
    OUT:       1 where the output holds the token, else 0 (what presence_penalty reads)
    BANNED:    1 for EOS and the stop ids (held back while the output is short of min_tokens)

Not bit-exact with `Adjustments`: a repetition penalty multiplies a positive logit by its inverse
instead of dividing by it, and SHIFT sums one -frequency per occurrence instead of multiplying
the count. A draft may differ by such roundings: verification reads the draft probabilities the
draft reports (the ones it drew from) and processes the target's exactly, so only acceptance
could notice, by a rounding.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from ssd.processing.adjustments import Adjustments, masked_in_place, min_p_filtered, moved

if TYPE_CHECKING:
    from ssd.processing.host_draft_adjustments import HostDraftAdjustments

POS, NEG, SHIFT, OUT, BANNED = range(5)  # the values of a column (DraftAdjustments.columns)


@dataclass(frozen=True)
class DraftAdjustments:
    """b rows at one position each (position j of a draft follows the row's history plus its
    first j drafted tokens). Made from the first position's `Adjustments` (`of`)."""

    ids: torch.Tensor  # [b, 1, m] long, the tokens a row adjusts (padding repeats the row's first column)
    columns: torch.Tensor  # [b, 1, m, 5] float, per column POS, NEG, SHIFT, OUT, BANNED (module doc)
    # [b, 1, 1, 5] float: a column once its token occurs in the output (again): POS and NEG the
    # penalty's, SHIFT -frequency_penalty more than it was, OUT 1, BANNED as it was. A new token's
    # column is that of an untracked one (no bias, not banned): `occurred` itself.
    occurred: torch.Tensor
    kept: torch.Tensor  # [b, 1, 1, 5] float, 1 for the values an occurrence adds to (SHIFT, BANNED), else 0
    presence: torch.Tensor  # [b, 1, 1] float, minus the presence penalty
    short_by: torch.Tensor | None  # [b] long, as Adjustments.short_by
    min_p: torch.Tensor | None  # [b, 1, 1] float, as Adjustments.min_p
    allowed: torch.Tensor | None  # [b, V] bool, as Adjustments.allowed
    masks: torch.Tensor | None = None  # [b, 1, V] bool, this position's token masks (as Adjustments.masks)

    @classmethod
    def of(cls, first: Adjustments) -> "DraftAdjustments":
        """A round's (or a branch's) first position's adjustments in this form."""
        assert first.drafted.shape[1] == 0, "a draft starts from a first position's adjustments"
        counts, seen, bias, banned = first.columns.unsqueeze(1).unbind(-1)  # [b, 1, m] each
        penalty, seen = first.repetition, seen.bool()  # [b, 1, 1], [b, 1, m]
        inverse, ones, zeros = penalty.reciprocal(), torch.ones_like(penalty), torch.zeros_like(penalty)
        columns = torch.stack(
            [torch.where(seen, inverse, ones), torch.where(seen, penalty, ones), bias - first.frequency * counts,
             counts.clamp(max=1), banned], -1,
        )  # fmt: skip
        return cls(
            first.ids.unsqueeze(1),
            columns,
            torch.stack([inverse, penalty, -first.frequency, ones, zeros], -1),
            torch.stack([zeros, zeros, ones, zeros, ones], -1),
            -first.presence,
            first.short_by,
            first.min_p,
            first.allowed,
            first.masks,
        )

    def apply(self, logits: torch.Tensor, in_place: bool = False) -> torch.Tensor:
        """logits [b, 1, V] -> adjusted logits [b, 1, V] (float32); in_place as Adjustments.apply."""
        owned = in_place
        if logits.dtype != torch.float32:
            logits, owned = logits.float(), True
        picked = logits.gather(-1, self.ids)  # [b, 1, m]
        pos, neg, shift, out, banned = self.columns.unbind(-1)  # [b, 1, m] each
        scale = torch.where(picked.signbit(), neg, pos)
        picked = torch.addcmul(torch.addcmul(shift, out, self.presence), picked, scale)
        if self.short_by is not None:
            early = (self.short_by > 0).view(-1, 1, 1)
            picked = picked.masked_fill(early & banned.bool(), float("-inf"))
        logits = logits.scatter_(-1, self.ids, picked) if owned else logits.scatter(-1, self.ids, picked)
        return masked_in_place(logits, self.allowed, self.masks)

    def advanced(self, tokens: torch.Tensor, masks: torch.Tensor | None = None) -> "DraftAdjustments":
        """After each row appends tokens [b] to its history: the next position's adjustments.
        A token the row does not track yet gets a column of its own. masks [b, 1, V]: the next
        position's token masks, required where this has any (the caller's matchers know them)."""
        assert (masks is None) == (self.masks is None), "the next position's token masks are the caller's"
        tokens = tokens.view(-1, 1, 1)
        hit = self.ids == tokens  # [b, 1, m]
        tracked = hit.any(-1, keepdim=True)  # [b, 1, 1]
        columns = torch.where(hit.unsqueeze(-1), torch.addcmul(self.occurred, self.columns, self.kept), self.columns)
        return replace(
            self,
            ids=torch.cat([self.ids, torch.where(tracked, self.ids[..., :1], tokens)], -1),
            columns=torch.cat([columns, torch.where(tracked.unsqueeze(-1), columns[..., :1, :], self.occurred)], -2),
            short_by=None if self.short_by is None else self.short_by - 1,
            masks=masks,
        )

    def to(self, device: torch.device) -> "DraftAdjustments":
        return DraftAdjustments(*(moved(getattr(self, f), device) for f in self.__dataclass_fields__))

    def min_p_filtered(self, scaled: torch.Tensor) -> torch.Tensor:
        """As Adjustments.min_p_filtered."""
        return min_p_filtered(self.min_p, scaled)


def draft_form(first: Adjustments, device: torch.device) -> DraftAdjustments | HostDraftAdjustments:
    """first's draft form for a draft whose rows are processed on `device` (the same methods): on
    the host, compiled loops (host_draft_adjustments.py); elsewhere tensor operations (above)."""
    if device.type != "cpu":
        return DraftAdjustments.of(first).to(device)
    # Imported here: numba takes ~0.4 s to import, which only a process drafting with adjusted
    # rows on the host pays.
    try:
        from ssd.processing.host_draft_adjustments import HostDraftAdjustments
    except RuntimeError as e:  # numba's, where it finds no writable place for its cache
        if "cannot cache" not in str(e):
            raise
        raise RuntimeError(
            f"{e}. The draft's compiled loops need a writable cache: set NUMBA_CACHE_DIR to a "
            "writable directory (numba tries __pycache__ beside the module, then ~/.cache/numba)"
        ) from e
    return HostDraftAdjustments.of(first)
