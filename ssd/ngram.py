"""The fast backup speculator: n-gram prompt lookup in the sequence itself, else random tokens.

Its proposals are deterministic given the sequence (random ones come from the sequence's
generator), so their draft distribution is one-hot: verification accepts token x with
probability target_probs[x] and otherwise samples the residual, which keeps output exact at any
temperature (a greedy shortcut at temperature > 0 would bias it).
"""

from __future__ import annotations

import torch


def ngram_lookup(tokens: list[int], k: int, max_n: int = 4, min_n: int = 1, window: int = 2048) -> list[int]:
    """Continuation (up to k tokens) of the most recent earlier match of the longest suffix n-gram."""
    start = max(0, len(tokens) - window)
    for n in range(max_n, min_n - 1, -1):
        if len(tokens) - start <= n:
            continue
        suffix = tokens[-n:]
        for i in range(len(tokens) - n - 1, start - 1, -1):
            if tokens[i : i + n] == suffix:
                return tokens[i + n : i + n + k]
    return []


def fast_speculation(tokens: list[int], k: int, vocab: int, generator: torch.Generator) -> tuple[list[int], torch.Tensor]:
    """-> (k proposed tokens, one-hot probs [k, vocab]); random tokens fill what lookup lacks."""
    found = ngram_lookup(tokens, k)
    if len(found) < k:
        found = found + torch.randint(vocab, (k - len(found),), generator=generator).tolist()
    probs = torch.zeros(k, vocab)
    probs[torch.arange(k), torch.tensor(found)] = 1.0
    return found, probs
