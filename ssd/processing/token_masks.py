"""The tokens each position of a speculation may take under a row's grammar and bad words
(grammar.py, bad_words.py), as one mask: what `Adjustments.masks` holds."""

from __future__ import annotations

import torch

from ssd.processing.bad_words import bad_word_masks
from ssd.processing.grammar import grammar_masks


def token_masks(seqs: list, drafted: torch.Tensor, vocab: int, last_only: bool = False) -> torch.Tensor | None:
    """seqs: the rows' Sequences; drafted [b, j] -> allowed [b, j + 1, V] bool (or [b, 1, V] with
    last_only), None when no row has a grammar or bad words."""
    grammar = bad = None
    if any(s.matcher is not None for s in seqs):
        grammar = grammar_masks([s.matcher for s in seqs], drafted, vocab, last_only)
    if any(s.bad_words for s in seqs):
        rows = [(s.bad_words, s.output_ids) if s.bad_words else None for s in seqs]
        bad = bad_word_masks(rows, drafted, vocab, last_only)
    return joined(grammar, bad)


def joined(grammar: torch.Tensor | None, bad: torch.Tensor | None) -> torch.Tensor | None:
    """A grammar's masks and bad words' [..., V] bool (either None) -> the tokens both allow.
    Where the grammar allows only banned words the grammar wins (a distribution needs a token)."""
    if grammar is None or bad is None:
        return grammar if bad is None else bad
    both = grammar & bad
    dead = ~both.any(-1, keepdim=True)
    return torch.where(dead, grammar, both)
