"""The fast backup speculator: n-gram prompt lookup in the sequence itself, else random tokens.

Its proposals are deterministic given the sequence (random ones come from the sequence's
generator), so their draft distribution is one-hot: verification accepts token x with
probability target_probs[x] and otherwise samples the residual, which keeps output exact at any
temperature (a greedy shortcut at temperature > 0 would bias it).

The lookup is incremental, so its cost does not grow with the sequence: this backup is chosen
at large batches, where a scan of the history per row and round would dominate the round.
"""

from __future__ import annotations

import torch


class NgramIndex:
    """One sequence's tokens with, for every n-gram (n <= max_n), its latest start position.

    lookup(k) is the continuation (up to k tokens) of the most recent earlier occurrence of the
    longest suffix n-gram, n from max_n down to 1; O(max_n**2 + k) per call, and extend() is
    O(max_n**2) per token. It searches the whole history (a former version scanned only the last
    2048 tokens; the two agree on any shorter sequence).

    Invariant: `latest` holds exactly the n-grams that start at or before len(tokens) - n - 1,
    i.e. that end at or before the second-to-last token. The suffix n-gram itself (which ends at
    the last token) is therefore never its own match, and a hit always has a non-empty
    continuation. Keys of different n are tuples of different lengths, so one dict serves all n.
    """

    def __init__(self, max_n: int = 4) -> None:
        self.max_n = max_n
        self.tokens: list[int] = []
        self.latest: dict[tuple[int, ...], int] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, new_tokens: list[int]) -> None:
        tokens, latest = self.tokens, self.latest
        for tok in new_tokens:
            # The previous last token becomes second-to-last: index the n-grams that end there.
            end = len(tokens)
            for n in range(1, min(self.max_n, end) + 1):
                latest[tuple(tokens[end - n : end])] = end - n
            tokens.append(tok)

    def lookup(self, k: int) -> list[int]:
        tokens = self.tokens
        size = len(tokens)
        for n in range(min(self.max_n, size), 0, -1):
            start = self.latest.get(tuple(tokens[size - n :]))
            if start is not None:
                return tokens[start + n : start + n + k]
        return []


def fast_speculation(
    index: NgramIndex, k: int, vocab: int, generator: torch.Generator, with_probs: bool = True
) -> tuple[list[int], torch.Tensor | None]:
    """-> (k proposed tokens, their one-hot probs [k, vocab], or None without with_probs: a greedy
    row's verification reads none); random tokens fill what lookup lacks."""
    found = index.lookup(k)
    if len(found) < k:
        found = found + torch.randint(vocab, (k - len(found),), generator=generator).tolist()
    if not with_probs:
        return found, None
    probs = torch.zeros(k, vocab)  # [k, vocab]
    probs[torch.arange(k), torch.tensor(found)] = 1.0
    return found, probs
