"""An SSD drafter's adjustments: its speculations are processed as verification will process
the target's (penalties, logit_bias, allowed_token_ids, min_tokens, min_p and bad_words; the
glossary is ssd/processing/__init__.py's), so that they are accepted. Its grammars are
draft_grammars.py's; tree_processing.py applies both.

Every position's processing depends on the history before it, and in SSD's tree each position
has its own history:
  - the fork ranks the bonus candidates of outcome j (j drafts accepted) with the committed
    tokens plus s_T[:j] (`ForkAdjustments.glue`: the exact form at K + 1 positions), which is
    the history the target's bonus token is drawn with;
  - each branch then drafts with the committed tokens, s_T[:j], its candidate and its own
    earlier tokens (`BranchAdjustments`): one row per branch in the draft form on the host,
    advanced by the token the branch draws at each depth;
  - the neural backup drafts a miss's speculation position by position, as SD's draft does
    (`first_position`).
Exactness never depends on any of this: verification uses the draft probabilities the drafter
reports, which are the processed ones it drew from, and the engine's own processing of the
target. A drafter whose processing were wrong would only be accepted less often.

A sequence's processing comes with its admission (SequenceSampling.processing, over the wire);
its output is its committed tokens from SequenceSampling.output_from on (what penalties,
min_tokens and bad words count).

Shapes: b rows, K speculation length, N branches per row (this drafter's shard), V the target's
vocabulary.
"""

from __future__ import annotations

import torch

from ssd.core.sampling import BatchSampling, SequenceSampling
from ssd.drafting.sd_proposer import to_vocab
from ssd.processing.adjustments import build
from ssd.processing.bad_words import refused
from ssd.processing.draft_adjustments import draft_form
from ssd.processing.token_masks import joined, token_masks


def processes(sampling: SequenceSampling) -> bool:
    """Whether a sequence's speculations need adjustments beyond the shaping (temperature, top-k,
    top-p; its grammar is draft_grammars.py's)."""
    return sampling.processing.any


class ForkAdjustments:
    """The adjustments of one round's rows at the fork: position j follows the committed tokens
    and s_T[:j]."""

    def __init__(self, rows: list[tuple[SequenceSampling, list[int]]], spec_tokens: torch.Tensor, vocab: int) -> None:
        """rows: per row its sampling and committed tokens; spec_tokens [b, K] (padded: a
        position past a row's speculation is never forked from)."""
        self.vocab = vocab
        self.spec = spec_tokens
        self.words = [s.processing.bad_words for s, _ in rows]
        self.outputs = [tokens[s.output_from :] for s, tokens in rows]
        table = [(s.processing, tokens[: s.output_from], out) for (s, tokens), out in zip(rows, self.outputs)]
        self.adjust = build(table, spec_tokens, vocab)  # K + 1 positions

    def glue(self, logits: torch.Tensor, grammar: torch.Tensor | None) -> torch.Tensor:
        """The glue's logits [b, K+1, V_draft] -> processed [b, K+1, V] (float32): what the fork
        ranks. grammar [b, K+1, V]: the grammar's fork masks, or None."""
        logits = self.adjust.apply(to_vocab(logits, self.vocab))
        masks = joined(grammar, self._bad_word_masks())
        return logits if masks is None else logits.masked_fill(~masks, float("-inf"))

    def _bad_word_masks(self) -> torch.Tensor | None:
        """[b, K+1, V] bool: what bad words leave at each position after s_T[:j], or None."""
        if not any(self.words):
            return None
        b, k = self.spec.shape
        allowed = torch.ones(b, k + 1, self.vocab, dtype=torch.bool)
        spec = self.spec.tolist()
        for r, words in enumerate(self.words):
            tail = _tail(self.outputs[r], _span(words))  # all a word can look back at
            for j in range(k + 1) if words else ():
                allowed[r, j, refused(words, tail + spec[r][:j])] = False
        return allowed

    def tree(self, cand: torch.Tensor, outcome: torch.Tensor, sampling: BatchSampling) -> BranchAdjustments:
        """The branches' adjustments: cand, outcome [b, N] (this shard's); sampling: the rows'."""
        return BranchAdjustments(self, cand, outcome, sampling)


class BranchAdjustments:
    """One row of adjustments per branch, at the branch's next position (the draft form)."""

    def __init__(self, rnd: ForkAdjustments, cand: torch.Tensor, outcome: torch.Tensor, sampling: BatchSampling):
        b, n = cand.shape
        k = rnd.spec.shape[1]
        self.shape, self.vocab = (b, n), rnd.vocab
        rows = torch.arange(b).repeat_interleave(n)  # [b N]: the row of each branch
        # A branch of outcome j appends s_T[:j], then its candidate, to its row's history.
        spec = torch.cat([rnd.spec, rnd.spec.new_zeros(b, 1)], 1)[rows]  # [b N, K+1]
        places = torch.arange(k + 1)
        j = outcome.reshape(-1, 1)
        prefix = torch.where(places < j, spec, cand.reshape(-1, 1))
        # A tree with adjustments is processed on the host (tree_processing.py): the host form.
        self.adjust = draft_form(rnd.adjust.branched(rows, prefix, places <= j), torch.device("cpu"))
        self.sampling = BatchSampling(sampling.temperature[rows], sampling.top_k[rows], sampling.top_p[rows])
        # Bad words look at a history's last tokens only: each branch keeps that tail.
        self.words = [rnd.words[r] for r in rows.tolist()]
        self.spans = [_span(words) for words in self.words]
        starts = zip(rows.tolist(), prefix.tolist(), j.flatten().tolist())
        self.tails = [
            _tail(_tail(rnd.outputs[r], span) + p[: o + 1], span) if words else []
            for (r, p, o), words, span in zip(starts, self.words, self.spans)
        ]

    def masks(self) -> torch.Tensor | None:
        """[b, N, V] bool: what bad words leave at each branch's next position, or None."""
        if not any(self.words):
            return None
        allowed = torch.ones(len(self.words), self.vocab, dtype=torch.bool)
        for i, (words, tail) in enumerate(zip(self.words, self.tails)):
            if words:
                allowed[i, refused(words, tail)] = False
        return allowed.view(*self.shape, self.vocab)

    def probs(self, step: torch.Tensor, draft_probs) -> torch.Tensor:
        """Draft logits [b, N, V_draft] -> the branches' processed probs [b, N, V] (draft_probs:
        SDProposer.draft_probs, which maps them onto the target's vocabulary and processes)."""
        b, n = self.shape
        flat = draft_probs(step.reshape(b * n, 1, -1), self.sampling.adjusted(self.adjust))
        return flat.view(b, n, -1)

    def advance(self, tokens: torch.Tensor) -> None:
        """tokens [b, N]: each branch's drawn token, now part of its history."""
        flat = tokens.reshape(-1)
        self.adjust = self.adjust.advanced(flat)
        for i, token in enumerate(flat.tolist()):
            if self.words[i]:
                self.tails[i] = _tail(self.tails[i] + [token], self.spans[i])


class DraftView:
    """A sequence as SDProposer.propose reads it, for a drafter's neural backup: its committed
    tokens, the generator its draws come from, its grammar's matcher (None: none), bad words and
    output (ssd/processing/token_masks.py reads them)."""

    def __init__(self, tokens: list[int], sampling: SequenceSampling, generator: torch.Generator, matcher) -> None:
        self.generator, self.matcher = generator, matcher
        self.num_tokens, self._tokens = len(tokens), tokens
        self.bad_words = sampling.processing.bad_words
        self.output_ids = tokens[sampling.output_from :]

    def tokens_from(self, start: int) -> list[int]:
        return self._tokens[start:]


def _span(words: tuple[tuple[int, ...], ...]) -> int:
    """How many tokens of history the words look back at (each word's length less one)."""
    return max((len(w) for w in words), default=1) - 1


def _tail(history: list[int], span: int) -> list[int]:
    return history[max(0, len(history) - span) :]


def first_position(
    views: list[DraftView], rows: list[SequenceSampling], sampling: BatchSampling, vocab: int
) -> BatchSampling:
    """The neural backup's sampling at its first drafted position, with the grammars' and bad
    words' masks (SDProposer advances all of it with each drafted token). rows: the views'
    samplings."""
    none = torch.zeros(len(views), 0, dtype=torch.long)
    masks = token_masks(views, none, vocab)
    table = [(s.processing, v.tokens_from(0)[: s.output_from], v.output_ids) for v, s in zip(views, rows)]
    return sampling.adjusted(build(table, none, vocab, masks))
