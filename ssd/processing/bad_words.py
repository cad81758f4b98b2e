"""bad_words (vLLM's): word sequences a request's output must not contain, as token masks.

A word is banned by refusing its last token wherever the output so far ends with the word's
other tokens (a one-token word is refused everywhere). The history is the output's, not the
prompt's, as vLLM counts it; in a speculation it includes the earlier draft tokens, so each
position gets its own mask, built on the host (the words are few, the check a tail compare) and
applied with the grammar's (`Adjustments.masks`), which keeps verification exact.
"""

from __future__ import annotations

import torch

# Bounds on one request's words (checked in SamplingParams).
MAX_BAD_WORDS = 64
MAX_BAD_WORD_CHARS = 256


def word_tokens(tokenizer, words: list[str]) -> tuple[tuple[int, ...], ...]:
    """Each word's token ids, as written and after a space (how it reads inside a sentence under a
    BPE tokenizer), without duplicates, as vLLM tokenizes them."""
    out: dict[tuple[int, ...], None] = {}
    for word in words:
        for text in (word, " " + word.lstrip()):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if ids:
                out[ids] = None
    return tuple(out)


def refused(words: tuple[tuple[int, ...], ...], history: list[int]) -> list[int]:
    """The tokens that would complete one of the words after `history`."""
    return [
        w[-1] for w in words if len(w) == 1 or (len(history) >= len(w) - 1 and tuple(history[1 - len(w) :]) == w[:-1])
    ]


def bad_word_masks(
    rows: list[tuple[tuple[tuple[int, ...], ...], list[int]] | None],
    drafted: torch.Tensor,
    vocab: int,
    last_only: bool = False,
) -> torch.Tensor:
    """rows: per row (its words' token ids, its output ids) or None; drafted [b, j] ->
    allowed [b, j + 1, V] bool (or [b, 1, V], the last position's, with last_only)."""
    b, j = drafted.shape
    n = 1 if last_only else j + 1
    allowed = torch.ones(b, n, vocab, dtype=torch.bool)
    spec = drafted.tolist()
    for r, row in enumerate(rows):
        if row is None:
            continue
        words, output = row
        for i in range(j + 1 - n, j + 1):
            banned = refused(words, output + spec[r][:i])
            if banned:
                allowed[r, i - (j + 1 - n), torch.tensor(banned, dtype=torch.long)] = False
    return allowed
