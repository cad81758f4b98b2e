"""What shapes an SSD drafter's distributions beyond temperature, top-k and top-p, round by
round: each constrained sequence's grammar (draft_grammars.py) and each sequence's processing
(penalties, bias, allowed tokens, min_tokens, min_p, bad words: draft_processing.py). Both
follow each position's own history: the fork's position k follows s_T[:k], a branch its
candidate and its own draws. A round whose rows have neither costs nothing here.

Shapes: b rows, K speculation length, N branches per row (this drafter's shard), V the target's
vocabulary.
"""

from __future__ import annotations

import torch

from ssd.core.sampling import BatchSampling, SequenceSampling
from ssd.core.token_masks import joined
from ssd.drafting.draft_grammars import Branches, DraftGrammars, masked
from ssd.drafting.draft_processing import RoundProcessing, TreeProcessing, processes


class RoundShaping:
    """One round's grammars and processing at the fork (`glue`), then per branch (`tree`)."""

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
        self.grammars, self.spines, self.allowed, self.processing = grammars, None, None, None
        if grammars.any(seq_ids):  # candidates among the tokens the grammar allows there
            self.spines = grammars.spines(seq_ids, spec)
            self.allowed = grammars.fork_masks(self.spines, k + 1)  # [b, K+1, V]
        if any(processes(s) for s, _ in rows):  # ranked as the target's bonus token is drawn
            self.processing = RoundProcessing(rows, spec_tokens, grammars.vocab)

    @property
    def active(self) -> bool:
        """Whether any row has a grammar or processing (its shaping runs on the host)."""
        return self.spines is not None or self.processing is not None

    def glue(self, logits: torch.Tensor) -> torch.Tensor:
        """The glue's draft logits [b, K+1, V_draft] -> what the fork ranks."""
        if self.processing is not None:
            return self.processing.glue(logits, self.allowed)
        return logits if self.allowed is None else masked(logits, self.allowed)

    def tree(self, cand: torch.Tensor, outcome: torch.Tensor, sampling: BatchSampling) -> TreeShaping | None:
        """The branches' shaping: cand, outcome [b, N] (this shard's); sampling: the rows'.
        None when no row has a grammar or processing."""
        branches = None
        if self.spines is not None:
            branches = self.grammars.branches(self.spines, cand, outcome, self.allowed)
        processing = self.processing.tree(cand, outcome, sampling) if self.processing is not None else None
        return None if branches is None and processing is None else TreeShaping(branches, processing)


class TreeShaping:
    """Per branch, its grammar's matcher and its processing, at the branch's next position."""

    def __init__(self, branches: Branches | None, processing: TreeProcessing | None) -> None:
        self.branches, self.processing = branches, processing

    def probs(self, step: torch.Tensor, sampling: BatchSampling, draft_probs) -> torch.Tensor:
        """One depth's draft logits [b, N, V_draft] -> the branches' probs [b, N, V]: masked by
        their grammars and bad words, processed with their own histories (draft_probs:
        SDProposer.draft_probs)."""
        masks = joined(
            self.branches.masks() if self.branches is not None else None,
            self.processing.masks() if self.processing is not None else None,
        )
        if masks is not None:
            step = masked(step, masks)
        if self.processing is not None:
            return self.processing.probs(step, draft_probs)
        return draft_probs(step, sampling)

    def advance(self, tokens: torch.Tensor) -> None:
        """tokens [b, N]: each branch's drawn token."""
        for follower in (self.branches, self.processing):
            if follower is not None:
                follower.advance(tokens)
