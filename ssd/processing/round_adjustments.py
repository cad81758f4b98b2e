"""The target's adjustments of the running batch round after round (`RoundAdjustments`, in the
exact form: adjustments.py), as the engine's verifier reads them: at each round's first position
(SD's draft advances them from there) and at every position of the speculation (verification).

A round's verification already tracks every token its rows will commit (the drafts have
columns, only the bonus token may be new), so the next round's first position is carried over
from it (`Adjustments.committed`) instead of being built again from each row's history. A build
costs a fixed ~75 small tensor operations whatever changed (docs/benchmarks.md, "a build");
carrying costs ~20. A build runs when nothing was carried (the first round, a round without
adjusted rows, a round that raised), when the batch gained a row, when a row's output is not
what the round committed (a guard: a stop rule that cuts an append finishes the row, which then
retires), and when the carried columns grew COMPACT_AFTER past the last build's (each round
adds K + 1, padding mostly).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol

import torch

from ssd.processing.adjustments import Adjustments, build
from ssd.processing.request import Processing
from ssd.processing.token_masks import token_masks
from ssd.processing.tracked import TrackedHistory

COMPACT_AFTER = 64  # columns a carried table may gain over its last build before the next build


class Sequence(Protocol):
    """What the round's adjustments read of a running sequence (ssd/core/sequence.py's, a layer
    above this one): its history, its processing and tracked tokens, its grammar's matcher and
    bad words (token_masks.py)."""

    seq_id: int
    prompt_ids: list[int]
    output_ids: list[int]
    processing: Processing
    tracked: TrackedHistory
    matcher: object | None

    @property
    def adjusted(self) -> bool: ...

    @property
    def bad_words(self) -> tuple[tuple[int, ...], ...]: ...


class RoundAdjustments:
    """What `LLMEngine` asks each round: `first` before drafting, `every` before verifying,
    `carry` once the outcome is known (before the commit)."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self.builds = 0  # how many rounds built their table (the rest carried it)
        self._carried: Adjustments | None = None  # the next round's first position, rows _ids
        self._ids: list[int] = []  # seq_id per carried row
        self._lens: list[int] = []  # each carried row's output length once the round commits
        self._width = 0  # columns at the last build

    def first(self, seqs: list[Sequence], masks: bool) -> Adjustments | None:
        """The rows' adjustments at the round's first position (None: no row has any); with the
        grammars' and bad words' masks there if `masks` (only a draft that drafts here reads them)."""
        if not any(s.adjusted for s in seqs):
            self._carried = None
            return None
        adjust = self._carried_for(seqs)
        self._carried = None  # carried once: `carry` gives the next
        none = torch.zeros(len(seqs), 0, dtype=torch.long) if adjust is None or masks else None
        if adjust is None:
            rows = [(s.processing, s.prompt_ids, s.output_ids) for s in seqs]
            adjust = build(rows, none, self.vocab, histories=[s.tracked for s in seqs])
            self._width, self.builds = adjust.ids.shape[1], self.builds + 1
        return replace(adjust, masks=token_masks(seqs, none, self.vocab)) if masks else adjust

    def every(self, first: Adjustments | None, seqs: list[Sequence], drafted: torch.Tensor) -> Adjustments | None:
        """The first position's adjustments -> every position's of the speculation drafted [b, K]
        (host), each processed with its own history. A draft past a row's num_draft may be -1 (a
        device's draw without mass where no verification reads it): it becomes token 0 here, as
        in the target's forward, since a column of -1 could not be gathered."""
        if first is None:
            return None
        drafted = drafted.clamp(min=0)
        return first.speculated(drafted, token_masks(seqs, drafted, self.vocab))

    def carry(
        self, seqs: list[Sequence], every: Adjustments | None, accepted: torch.Tensor, bonus: torch.Tensor
    ) -> None:
        """The round's outcome (accepted [b], bonus [b] on the host), before the commit appends it:
        keep the next round's first position."""
        if every is None:
            return
        self._carried = every.committed(accepted, bonus)
        self._ids = [s.seq_id for s in seqs]
        self._lens = [len(s.output_ids) + n + 1 for s, n in zip(seqs, accepted.tolist())]

    def _carried_for(self, seqs: list[Sequence]) -> Adjustments | None:
        """The carried table for these rows, or None where they need a build."""
        carried = self._carried
        if carried is None or carried.ids.shape[1] > self._width + COMPACT_AFTER:
            return None
        where = {seq_id: r for r, seq_id in enumerate(self._ids)}
        rows = [where.get(s.seq_id) for s in seqs]
        if None in rows or any(len(s.output_ids) != self._lens[r] for s, r in zip(seqs, rows)):
            return None  # a row is new, or a stop rule cut what it appended
        if rows == list(range(len(self._ids))):
            return carried
        none = torch.zeros(len(rows), 0, dtype=torch.long)
        return carried.branched(torch.tensor(rows, dtype=torch.long), none, none.bool())  # rows retired
