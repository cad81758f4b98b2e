"""Log-probabilities of the tokens a request emits (and of its prompt), from the target.

Glossary:
    chosen   the token that was emitted (or, for a prompt, the prompt's own token)
    rank     1 + how many tokens the distribution puts strictly above the chosen one
    top      the `n` most likely tokens of the distribution, best first (n = the request's logprobs)
    raw      the model's own distribution, log_softmax of its logits (what OpenAI and vLLM report)
    processed the distribution the token was drawn from: the request's temperature, top-k and
             top-p applied (greedy rows: all mass on the argmax, so 0 and -inf)

Speculation does not change these numbers: every emitted token was verified against the target's
distribution at its own position, and that distribution is the one reported, whether the token
came from the draft (accepted) or from the target (bonus), in every mode.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The most alternatives per token a request may ask for (OpenAI's chat API allows 20).
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class Logprob:
    token_id: int
    logprob: float
    text: str  # the token decoded on its own


@dataclass(frozen=True)
class TokenLogprobs:
    """One position: the chosen token, its rank, and the most likely tokens (best first)."""

    chosen: Logprob
    rank: int
    top: tuple[Logprob, ...]


@dataclass(frozen=True)
class PositionLogprobs:
    """Log-probabilities at n positions of b rows, still tensors (host or device)."""

    chosen: torch.Tensor  # [b, n] float32, log-probability of each chosen token
    rank: torch.Tensor  # [b, n] long, 1 = the most likely token
    top_ids: torch.Tensor  # [b, n, t] long, best first
    top: torch.Tensor  # [b, n, t] float32

    def to_host(self) -> "PositionLogprobs":
        """One copy to the host: the four as one float64 tensor [b, n, 2 + 2t] (token ids and
        ranks are below 2^53, exact in float64)."""
        t = self.top.shape[-1]
        parts = (self.chosen.unsqueeze(-1), self.rank.unsqueeze(-1), self.top_ids, self.top)
        host = torch.cat([x.double() for x in parts], -1).cpu()
        chosen, rank, top_ids, top = host.split([1, 1, t, t], -1)
        return PositionLogprobs(chosen.squeeze(-1).float(), rank.squeeze(-1).long(), top_ids.long(), top.float())


def log_probs(logits: torch.Tensor, processed: torch.Tensor | None = None) -> torch.Tensor:
    """Raw (log_softmax of logits [..., V]) or, given the processed probabilities, their log."""
    if processed is not None:
        return processed.float().log()
    return torch.log_softmax(logits.float(), dim=-1)


def position_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, num_top: int) -> PositionLogprobs:
    """logprobs [b, n, V], chosen [b, n] long -> PositionLogprobs with t = num_top. No host read:
    it runs where the logits are."""
    picked = logprobs.gather(-1, chosen.unsqueeze(-1))  # [b, n, 1]
    rank = (logprobs > picked).sum(-1) + 1  # [b, n]
    top = logprobs.topk(num_top, dim=-1) if num_top > 0 else None
    b, n = chosen.shape
    empty_ids = torch.zeros(b, n, 0, dtype=torch.long, device=chosen.device)
    return PositionLogprobs(
        picked.squeeze(-1),
        rank,
        top.indices if top is not None else empty_ids,
        top.values if top is not None else empty_ids.float(),
    )


def entries(found: PositionLogprobs, row: int, tokens: list[int], num_top: int, decode) -> list[TokenLogprobs]:
    """Row `row`'s first len(tokens) positions (tokens: the chosen ids there) as TokenLogprobs with
    its own num_top alternatives (found holds the batch's largest). found is on the host;
    decode(token_id) -> the token's text."""
    count = len(tokens)
    chosen = found.chosen[row, :count].tolist()
    rank = found.rank[row, :count].tolist()
    top_ids = found.top_ids[row, :count, :num_top].tolist()
    top = found.top[row, :count, :num_top].tolist()
    return [
        TokenLogprobs(
            Logprob(tokens[i], chosen[i], decode(tokens[i])),
            rank[i],
            tuple(Logprob(t, v, decode(t)) for t, v in zip(top_ids[i], top[i])),
        )
        for i in range(count)
    ]
