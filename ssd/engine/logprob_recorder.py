"""The engine's log-probability bookkeeping: what requests that ask for logprobs get, per prompt
token (from the prefill's logits) and per emitted token (from the verification's logits).

Only rows that asked pay: the others are never gathered. The numbers come from the target's
logits at each token's own position (ssd/core/logprobs.py says which distribution), computed
where the logits are (on the device in a device round) and copied to the host once per round.
"""

from __future__ import annotations

import torch

from ssd.core.logprobs import PositionLogprobs, TokenLogprobs, entries, log_probs, position_logprobs
from ssd.core.sampling import BatchSampling, process_logits
from ssd.core.sequence import Sequence


class LogprobRecorder:
    """mode: "raw" (the model's distribution) or "processed" (the request's sampling applied).
    tokenizer: decodes each reported token on its own (cached per id)."""

    def __init__(self, mode: str, tokenizer) -> None:
        assert mode in ("raw", "processed"), mode
        self.mode = mode
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}  # at most one entry per vocabulary id

    def decode(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def prompt(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """Set prompt_logprobs of the rows that asked. logits [b, L, V]: the prefill of each row's
        prompt but its last token, so position i predicts prompt token i + 1. One row at a time:
        a long prompt's [L, V] log-probabilities are the largest tensor here."""
        for r, seq in enumerate(seqs):
            top = seq.params.prompt_logprobs
            if top is None:
                continue
            predicted = seq.prompt_ids[1:]
            seq.prompt_logprobs = [None]
            if not predicted:
                continue
            n = len(predicted)
            processed = None
            if self.mode == "processed":
                processed = process_logits(logits[r : r + 1, :n], BatchSampling.of([seq.sampling]))
            lp = log_probs(logits[r : r + 1, :n], processed)  # [1, n, V]
            chosen = torch.tensor([predicted], dtype=torch.long, device=lp.device)
            found = position_logprobs(lp, chosen, top).to_host()
            seq.prompt_logprobs += entries(found, 0, predicted, top, self.decode)

    def round(
        self,
        seqs: list[Sequence],
        logits: torch.Tensor,
        target_probs: torch.Tensor,
        drafted: torch.Tensor,
        num_accepted: torch.Tensor,
        bonus_tokens: torch.Tensor,
    ) -> dict[int, tuple[PositionLogprobs, int]] | None:
        """The round's log-probabilities for the rows that asked, or None when none did.
        logits / target_probs [b, K+1, V] (device), drafted [b, K], num_accepted / bonus_tokens [b]
        (host). -> {row: (its PositionLogprobs on the host, its index there)}."""
        rows = [r for r, s in enumerate(seqs) if s.params.logprobs is not None]
        if not rows:
            return None
        b, k = drafted.shape
        # The emitted tokens at positions 0..accepted: the accepted drafts, then the bonus token
        # (positions past it are never read).
        emitted = torch.cat([drafted, torch.zeros(b, 1, dtype=torch.long)], 1)
        emitted.scatter_(1, num_accepted.unsqueeze(1), bonus_tokens.unsqueeze(1))
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        processed = target_probs.index_select(0, index) if self.mode == "processed" else None
        lp = log_probs(logits.index_select(0, index), processed)  # [n, K+1, V]
        top = max(seqs[r].params.logprobs for r in rows)
        found = position_logprobs(lp, emitted[rows].to(logits.device), top).to_host()
        return {r: (found, i) for i, r in enumerate(rows)}

    def commit(self, seq: Sequence, found: tuple[PositionLogprobs, int], tokens: list[int]) -> None:
        """Append the entries of the tokens the stop rules let through (a prefix of the row's)."""
        table, i = found
        seq.logprobs += entries(table, i, tokens, seq.params.logprobs, self.decode)


def output_logprobs(seq: Sequence, sent_tokens: int) -> tuple[list[TokenLogprobs] | None, list[TokenLogprobs] | None]:
    """(all, since sent_tokens) of a sequence's output logprobs, or (None, None) if it did not ask."""
    if seq.params.logprobs is None:
        return None, None
    return list(seq.logprobs), seq.logprobs[sent_tokens:]
