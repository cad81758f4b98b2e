"""An SSD drafter's processing beyond the shaping (temperature, top-k, top-p), round by round:
each constrained sequence's grammar (draft_grammars.py) and each sequence's adjustments
(penalties, bias, allowed tokens, min_tokens, min_p, bad words: tree_adjustments.py). Both
follow each position's own history: the fork's position j follows s_T[:j], a branch its
candidate and its own draws (`ForkProcessing`, then `BranchProcessing`). A round whose rows have
neither costs nothing here. The glossary is ssd/processing/__init__.py's.

Shapes: b rows, K speculation length, N branches per row (this drafter's shard), V the target's
vocabulary.
"""

from __future__ import annotations

import torch

from ssd.core.sampling import BatchSampling, SequenceSampling
from ssd.drafting.draft_grammars import Branches, DraftGrammars, masked
from ssd.drafting.tree_adjustments import BranchAdjustments, ForkAdjustments, processes
from ssd.processing.token_masks import joined


class ForkProcessing:
    """One round's grammars and adjustments at the fork (`glue`), then per branch (`tree`)."""

    def __init__(
        self,
        grammars: DraftGrammars,
        seq_ids: list[int],
        rows: list[tuple[SequenceSampling, list[int]]],
        spec: list[list[int]],
        spec_tokens: torch.Tensor,
        k: int,
    ) -> None:
        """rows: per row its sampling and committed tokens; spec: s_T per row (real tokens);
        spec_tokens [b, K] (padded)."""
        self.grammars, self.spines, self.allowed, self.adjustments = grammars, None, None, None
        if grammars.any(seq_ids):  # candidates among the tokens the grammar allows there
            self.spines = grammars.spines(seq_ids, spec)
            self.allowed = grammars.fork_masks(self.spines, k + 1)  # [b, K+1, V]
        if any(processes(s) for s, _ in rows):  # ranked as the target's bonus token is drawn
            self.adjustments = ForkAdjustments(rows, spec_tokens, grammars.vocab)

    @property
    def active(self) -> bool:
        """Whether any row has a grammar or adjustments (its processing runs on the host)."""
        return self.spines is not None or self.adjustments is not None

    def glue(self, logits: torch.Tensor) -> torch.Tensor:
        """The glue's draft logits [b, K+1, V_draft] -> what the fork ranks."""
        if self.adjustments is not None:
            return self.adjustments.glue(logits, self.allowed)
        return logits if self.allowed is None else masked(logits, self.allowed)

    def tree(self, cand: torch.Tensor, outcome: torch.Tensor, sampling: BatchSampling) -> BranchProcessing | None:
        """The branches' processing: cand, outcome [b, N] (this shard's); sampling: the rows'.
        None when no row has a grammar or adjustments."""
        branches = None
        if self.spines is not None:
            branches = self.grammars.branches(self.spines, cand, outcome, self.allowed)
        adjustments = self.adjustments.tree(cand, outcome, sampling) if self.adjustments is not None else None
        return None if branches is None and adjustments is None else BranchProcessing(branches, adjustments)


class BranchProcessing:
    """Per branch, its grammar's matcher and its adjustments, at the branch's next position."""

    def __init__(self, branches: Branches | None, adjustments: BranchAdjustments | None) -> None:
        self.branches, self.adjustments = branches, adjustments

    def probs(self, step: torch.Tensor, sampling: BatchSampling, draft_probs) -> torch.Tensor:
        """One depth's draft logits [b, N, V_draft] -> the branches' probs [b, N, V]: masked by
        their grammars and bad words, processed with their own histories (draft_probs:
        SDProposer.draft_probs)."""
        masks = joined(
            self.branches.masks() if self.branches is not None else None,
            self.adjustments.masks() if self.adjustments is not None else None,
        )
        if masks is not None:
            step = masked(step, masks)
        if self.adjustments is not None:
            return self.adjustments.probs(step, draft_probs)
        return draft_probs(step, sampling)

    def advance(self, tokens: torch.Tensor) -> None:
        """tokens [b, N]: each branch's drawn token."""
        for follower in (self.branches, self.adjustments):
            if follower is not None:
                follower.advance(tokens)
