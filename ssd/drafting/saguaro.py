"""Saguaro's three answers (Kumar, Dao, May, ICLR 2026): fan-out, sampling, backup choice.

Glossary:
    a        per-token acceptance rate of the draft (geometric model of accepted length)
    r        miss exponent of the fitted miss law  1 - p_hit(F) = F^(-r)
    B        speculation-cache budget: branches per sequence, B = sum_k F_k
    F_k      fan-out at verification outcome k (bonus candidates cached for k accepted tokens)
    C        Saguaro sampling constant in [0, 1]; 1 = plain sampling
    T_p, T_b primary (cache) and backup latency, relative to one verification
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import torch


def geometric_fanout(budget: int, k: int, a: float, r: float, caps: list[int] | None = None) -> list[int]:
    """Theorem 12: F_j proportional to a^(j/(1+r)) for j < K and a^(K/(1+r)) (1-a)^(-1/(1+r))
    for j = K, scaled so that sum F_j = budget, rounded by largest remainders.

    caps[j] bounds F_j (a bonus candidate must be a token other than the drafted one)."""
    a = min(max(a, 1e-3), 1 - 1e-3)
    r = max(r, 1e-3)
    weights = [a ** (j / (1 + r)) for j in range(k)]
    weights.append(a ** (k / (1 + r)) * (1 - a) ** (-1 / (1 + r)))
    return _round_to_budget(weights, budget, caps)


def uniform_fanout(budget: int, k: int, caps: list[int] | None = None) -> list[int]:
    return _round_to_budget([1.0] * (k + 1), budget, caps)


def row_fanout(fanout: list[int], length: int, vocab: int) -> list[int]:
    """The fan-out of one sequence whose speculation holds `length` tokens, from the round's
    fan-out over K+1 outcomes. A speculation cut short (length < K) can only end in outcomes
    0..length, so the branches of the outcomes past it go to j = length, full acceptance, the
    outcome they stood for. The sum stays the same (the tree is one batch of B branches per
    sequence): what exceeds a position's cap (vocab at full acceptance, vocab - 1 elsewhere,
    which excludes the drafted token) spills to the positions below it, and the rest, only
    possible with a budget near length * vocab, goes back to the unreachable outcomes, whose
    branches are decoded and never looked up."""
    k = len(fanout) - 1
    if length >= k:
        return list(fanout)
    out = list(fanout[: length + 1]) + [0] * (k - length)
    spill = sum(fanout[length + 1 :])
    for j in [*range(length, -1, -1), *range(k, length, -1)]:
        moved = min((vocab if j == length else vocab - 1) - out[j], spill)
        out[j] += moved
        spill -= moved
    assert spill == 0, "the round's fan-out exceeded the caps geometric_fanout keeps"
    return out


def _round_to_budget(weights: list[float], budget: int, caps: list[int] | None) -> list[int]:
    caps = caps or [budget] * len(weights)
    budget = min(budget, sum(caps))
    alloc = [0] * len(weights)
    free = list(range(len(weights)))
    left = budget
    # Water-filling: share what is left among uncapped positions until nothing exceeds its cap.
    while left > 0 and free:
        total = sum(weights[j] for j in free)
        shares = {j: left * weights[j] / total for j in free}
        over = [j for j in free if alloc[j] + shares[j] >= caps[j]]
        if over:
            for j in over:
                left -= caps[j] - alloc[j]
                alloc[j] = caps[j]
                free.remove(j)
            continue
        floors = {j: int(math.floor(shares[j])) for j in free}
        for j in free:
            alloc[j] += floors[j]
        left -= sum(floors.values())
        for j in sorted(free, key=lambda j: shares[j] - floors[j], reverse=True)[:left]:
            alloc[j] += 1
        left = 0
    return alloc


def saguaro_probs(probs: torch.Tensor, fanout: torch.Tensor, c: float) -> torch.Tensor:
    """Definition 14 on a processed draft distribution: scale the top-F_k probabilities of each
    position by C and renormalize. probs [b, n, V], fanout [n] or [b, n] long -> [b, n, V].

    Rejected draft tokens then leave residual mass on the top-F tokens, which are exactly the
    cached bonus candidates, so the hit rate rises (acceptance falls a little)."""
    if c >= 1.0:
        return probs
    vocab = probs.shape[-1]
    fanout = fanout.expand(probs.shape[:-1]) if fanout.dim() == 1 else fanout
    rank = probs.argsort(-1, descending=True).argsort(-1)  # [b, n, V] rank of each token
    in_top = rank < fanout.unsqueeze(-1).clamp(max=vocab)
    scaled = torch.where(in_top, probs * c, probs)
    total = scaled.sum(-1, keepdim=True)
    # If every token with mass is in the top-F set and C = 0, fall back to the plain distribution.
    return torch.where(total > 0, scaled / total.clamp(min=1e-30), probs)


@dataclass
class OnlineEstimates:
    """Running estimates of a and r from rounds already run (exponentially weighted).

    Feed every sequence-round with observe_round (acceptance) and observe_hit (miss law); the
    miss exponent is refitted by fit_r, once per round (a fit costs a grid over the window)."""

    a: float = 0.7
    r: float = 0.6
    decay: float = 0.995
    window: int = 256
    _accepted: float = 0.0
    _stops: float = 0.0
    _obs: deque | None = None  # (log F, hit, observation index), the latest `window`
    _seen: int = 0

    def observe_round(self, accepted: int, k: int) -> None:
        """One sequence-round: `accepted` of k draft tokens accepted."""
        self._accepted = self._accepted * self.decay + accepted
        self._stops = self._stops * self.decay + (1.0 if accepted < k else 0.0)
        # Maximum likelihood for a geometric law truncated at k, with a weak prior at 0.7.
        self.a = (self._accepted + 0.7 * 4) / (self._accepted + self._stops + 4)

    def observe_hit(self, fanout: int, hit: bool) -> None:
        """The real outcome had `fanout` cached candidates at its k; it hit or missed. F = 1
        says nothing under the law (it predicts a miss whatever r), so it is not recorded."""
        if fanout <= 1:
            return
        if self._obs is None:
            self._obs = deque(maxlen=self.window)
        self._obs.append((math.log(fanout), 1.0 if hit else 0.0, self._seen))
        self._seen += 1

    def fit_r(self) -> float:
        """Grid maximum likelihood of r (0.025..3.0) over the window, newer observations
        weighted more (decay per observation), with a weak prior at 0.6."""
        if not self._obs:
            return self.r
        grid = torch.arange(1, 121, dtype=torch.float64) * 0.025  # [G]
        obs = torch.tensor(list(self._obs), dtype=torch.float64)  # [n, 3]
        log_f, hit, index = obs.unbind(1)
        weight = self.decay ** (self._seen - 1 - index)  # [n]
        p_miss = torch.exp(-grid.unsqueeze(1) * log_f.unsqueeze(0))  # [G, n]
        ll = -0.5 * (grid - 0.6) ** 2
        ll = ll + (weight * ((1 - hit) * p_miss.clamp(min=1e-9).log() + hit * (1 - p_miss).clamp(min=1e-9).log())).sum(1)
        self.r = float(grid[int(ll.argmax())])
        return self.r


def ssd_speedup(p_hit: float, e_hit: float, e_miss: float, t_primary: float, t_backup: float) -> float:
    """Theorem 7: tokens per unit of verification time, relative to autoregressive decoding."""
    return (p_hit * e_hit + (1 - p_hit) * e_miss) / (p_hit * max(1.0, t_primary) + (1 - p_hit) * (1 + t_backup))


def prefer_fast_backup(batch: int, p_hit: float, e_hit: float, e_neural: float, t_neural: float,
                       e_fast: float, t_fast: float, t_primary: float) -> bool:
    """Theorem 17: a round skips drafting only if all `batch` sequences hit (p_hit^batch); pick
    the backup whose speedup model is larger at this batch size."""
    p_all = p_hit**batch
    neural = ssd_speedup(p_all, e_hit, e_neural, t_primary, t_neural)
    fast = ssd_speedup(p_all, e_hit, e_fast, t_primary, t_fast)
    return fast > neural


def backup_threshold(p_hit: float, e_hit: float, e_neural: float, t_neural: float,
                     e_fast: float, t_fast: float, t_primary: float, max_batch: int = 1024) -> int | None:
    """b*: the smallest batch size at which the fast backup wins (None if it never does)."""
    for b in range(1, max_batch + 1):
        if prefer_fast_backup(b, p_hit, e_hit, e_neural, t_neural, e_fast, t_fast, t_primary):
            return b
    return None
