"""Saguaro's three answers (Kumar, Dao, May, ICLR 2026): fan-out, sampling, backup choice.

Glossary:
    a        per-token acceptance rate of the draft (geometric model of accepted length)
    m, r     intercept and exponent of the fitted miss law  1 - p_hit(F) = m F^(-r), F >= 1
             (the paper's law is m = 1, which predicts no hit at F = 1; a draft whose top
             candidate is often the target's bonus token needs m < 1. The fan-out that maximizes
             the expected hit rate depends on r only: m scales every outcome's gain alike.)
    B        speculation-cache budget: branches per sequence, B = sum_j F_j
    F_j      fan-out at verification outcome j (bonus candidates cached for j accepted tokens)
    C        Saguaro sampling constant in [0, 1]; 1 = plain sampling
    T_p, T_b primary (cache) and backup latency, relative to one verification
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass

import torch

# The miss exponent before any observation, and the fit's weak prior on it.
R_PRIOR = 0.6


def geometric_fanout(budget: int, k: int, a: float, r: float, caps: list[int] | None = None) -> list[int]:
    """Theorem 12: F_j proportional to a^(j/(1+r)) for j < K and a^(K/(1+r)) (1-a)^(-1/(1+r))
    for j = K, scaled so that sum F_j = budget, rounded by largest remainders.

    caps[j] bounds F_j (a bonus candidate must be a token other than the drafted one)."""
    a = min(max(a, 1e-3), 1 - 1e-3)
    r = max(r, 1e-3)
    weights = [a ** (j / (1 + r)) for j in range(k)]
    weights.append(a ** (k / (1 + r)) * (1 - a) ** (-1 / (1 + r)))
    return _round_to_budget(weights, budget, caps)


def marginal_fanout(budget: int, k: int, a: float, m: float, r: float, caps: list[int] | None = None) -> list[int]:
    """The integer fan-out with the largest expected hit rate sum_j P_j p_hit(F_j) under the
    intercepted miss law (p_hit(0) = 0, p_hit(F) = 1 - m F^-r) and the geometric outcome law
    (P_j = a^j (1 - a) for j < K, a^K at K), spending min(budget, sum caps) branches.

    Theorem 12 solves the continuous problem (where m does not matter) and rounds; rounding can
    leave an outcome at F = 0, which forfeits its whole first-branch gain P_j (1 - m). Here: past
    the first branch an outcome's gains P_j m (F^-r - (F+1)^-r) fall with F, so once it is
    settled which outcomes get a first branch, taking the largest remaining gains (a greedy
    marginal allocation) is optimal; and an optimal allocation never gives a first branch to an
    outcome while a likelier one has none (swap their fan-outs), so the candidates are the s
    likeliest outcomes, s = 1..K+1, and the best of those K+1 greedy answers is the optimum.
    That swap needs the likelier outcome's cap to hold the other's fan-out: always so when no
    cap is below the budget (caps are vocab - 1 and vocab); with tighter caps the answer is
    still a valid allocation, within those caps."""
    a = min(max(a, 1e-3), 1 - 1e-3)
    r, m = max(r, 1e-3), min(max(m, 0.0), 1.0)
    caps = caps or [budget] * (k + 1)
    budget = min(budget, sum(caps))
    p = [a**j * (1 - a) for j in range(k)] + [a**k]
    order = sorted(range(k + 1), key=lambda j: -p[j])  # likeliest outcome first (stable)
    miss = [f**-r for f in range(1, budget + 1)]  # miss[F - 1] = F^-r
    # gains[j]: what each of outcome j's branches 2..cap adds, falling with F
    gains = [[p[j] * m * (miss[f - 1] - miss[f]) for f in range(1, min(caps[j], budget))] for j in range(k + 1)]
    best, best_s, merged = -math.inf, 0, []
    for s in range(1, min(k + 1, budget) + 1):  # a first branch each for the s likeliest outcomes
        if caps[order[s - 1]] < 1:
            break
        merged = sorted(merged + gains[order[s - 1]], reverse=True)  # two sorted runs: linear
        if len(merged) >= budget - s:
            value = (1 - m) * sum(p[j] for j in order[:s]) + sum(merged[: budget - s])
            best, best_s = (value, s) if value > best else (best, best_s)
    first = order[:best_s]
    alloc = [int(j in first) for j in range(k + 1)]
    for _, outcome in heapq.nlargest(budget - best_s, ((g, j) for j in first for g in gains[j])):
        alloc[outcome] += 1
    return alloc


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
    """Definition 14 on a processed draft distribution: scale the top-F_j probabilities of each
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


def miss_law_hit_rate(fanout: torch.Tensor, m: float, r: float) -> torch.Tensor:
    """p_hit(F) = 1 - m F^(-r) for F >= 1, and 0 at F = 0 (nothing cached). fanout [n] -> [n]."""
    f = fanout.to(torch.float64)
    return torch.where(f >= 1, 1 - m * f.clamp(min=1).pow(-r), torch.zeros_like(f))


def hit_interval(fanout: int, hit: bool) -> tuple[float, float]:
    """What a hit or miss at fan-out F says of the bonus token's rank: [0, F) or [F, inf)."""
    return (0.0, float(fanout)) if hit else (float(fanout), math.inf)


def rank_interval(rank: int, cap: int) -> tuple[float, float]:
    """What a rank says: exactly `rank` ([rank, rank + 1)), or at least `cap` when censored there."""
    return (float(cap), math.inf) if rank >= cap else (float(rank), float(rank) + 1)


def fit_miss_law(
    lo: torch.Tensor,
    hi: torch.Tensor,
    weight: torch.Tensor | None = None,
    r_prior: float = R_PRIOR,
    intercept: bool = True,
) -> tuple[float, float]:
    """Grid maximum likelihood of (m, r) in 1 - p_hit(F) = m F^(-r), i.e. P(rank >= F) = m F^(-r)
    for the bonus token's rank among the candidates (F >= 1): m in 0.01..1 (1 alone without
    `intercept`: the paper's law), r in 0.025..3, with a weak Gaussian prior on r at r_prior
    (which alone sets r when the data cannot).

    Each observation is an interval [lo, hi) that holds the rank (hi may be inf): a hit at F is
    [0, F), a miss [F, inf), a known rank j [j, j + 1), a rank censored at c [c, inf); its
    likelihood is P(rank >= lo) - P(rank >= hi). lo [n], hi [n], weight [n] (default 1) -> (m, r).
    Intervals that say nothing ([0, inf): a miss at F = 0) are left out. Observations are summed
    per distinct interval first, so a fit costs the grid times the number of distinct intervals."""
    lo, hi = lo.to(torch.float64), hi.to(torch.float64)
    weight = torch.ones(lo.shape, dtype=torch.float64) if weight is None else weight.to(torch.float64)
    keep = (weight > 0) & ~((lo == 0) & torch.isinf(hi))
    if not bool(keep.any()):
        return 1.0, r_prior
    lo, hi, weight = lo[keep], hi[keep], weight[keep]
    # One key per interval (ranks and fan-outs are integers below 2^20 - 1; inf as 2^20 - 1): a
    # 1-D unique is several times faster than torch.unique(dim=0).
    keys, index = torch.unique(lo * 2**20 + hi.clamp(max=2**20 - 1), return_inverse=True)  # [U], [n]
    ends = keys.remainder(2**20)
    pairs = torch.stack(
        [keys.div(2**20, rounding_mode="floor"), torch.where(ends == 2**20 - 1, math.inf, ends)], 1
    )  # [U, 2]
    w = torch.zeros(len(pairs), dtype=torch.float64).index_add_(0, index, weight)  # [U]
    # Coarse grid, then a fine one around its best: the answer of the full fine grid
    # (m step 0.01, r step 0.025) unless the likelihood has two far-apart peaks.
    m, r = _best(pairs, w, _steps(0.05, 0.05, 1.0) if intercept else _ONE, _steps(0.1, 0.1, 3.0), r_prior)
    m_fine = _steps(max(0.01, m - 0.04), 0.01, min(1.0, m + 0.04)) if intercept else _ONE
    return _best(pairs, w, m_fine, _steps(max(0.025, r - 0.075), 0.025, min(3.0, r + 0.075)), r_prior)


_ONE = torch.ones(1, dtype=torch.float64)


def _steps(start: float, step: float, stop: float) -> torch.Tensor:
    return torch.arange(round(start / step), round(stop / step) + 1, dtype=torch.float64) * step


def _best(
    pairs: torch.Tensor, w: torch.Tensor, m_grid: torch.Tensor, r_grid: torch.Tensor, r_prior: float
) -> tuple[float, float]:
    """The (m, r) of the grids with the largest log-likelihood plus prior. pairs [U, 2], w [U]."""

    def survival(x: torch.Tensor) -> torch.Tensor:  # P(rank >= x), [Gm, Gr, U]
        power = m_grid[:, None, None] * torch.exp(-r_grid[None, :, None] * x.clamp(min=1).log()[None, None, :])
        return torch.where(x == 0, torch.ones_like(power), torch.where(torch.isinf(x), torch.zeros_like(power), power))

    p = survival(pairs[:, 0]) - survival(pairs[:, 1])  # [Gm, Gr, U]
    ll = (w * p.clamp(min=1e-12).log()).sum(-1) - 0.5 * (r_grid - r_prior) ** 2  # [Gm, Gr]
    best = int(ll.argmax())
    return float(m_grid[best // len(r_grid)]), float(r_grid[best % len(r_grid)])


@dataclass
class OnlineEstimates:
    """Running estimates of a, m and r from rounds already run (exponentially weighted).

    Feed every sequence-round with observe_round (acceptance) and observe_rank (the bonus
    token's rank among the candidates, when the drafter reports it) or observe_hit (hit or miss
    at the fan-out); the miss law is refitted by fit (fit_miss_law over the
    window)."""

    a: float = 0.7
    r: float = R_PRIOR
    m: float = 1.0  # the paper's law until observations arrive
    decay: float = 0.995
    window: int = 256
    _accepted: float = 0.0
    _stops: float = 0.0
    _obs: deque | None = None  # (lo, hi, observation index), the latest `window`
    _seen: int = 0

    def observe_round(self, accepted: int, k: int) -> None:
        """One sequence-round: `accepted` of k draft tokens accepted."""
        self._accepted = self._accepted * self.decay + accepted
        self._stops = self._stops * self.decay + (1.0 if accepted < k else 0.0)
        # Maximum likelihood for a geometric law truncated at k, with a weak prior at 0.7.
        self.a = (self._accepted + 0.7 * 4) / (self._accepted + self._stops + 4)

    def observe_hit(self, fanout: int, hit: bool) -> None:
        """The real outcome had `fanout` cached candidates; it hit or missed. F = 0 is a certain
        miss whatever the law, so it is not recorded."""
        if fanout >= 1:
            self._observe(*hit_interval(fanout, hit))

    def observe_rank(self, rank: int, cap: int) -> None:
        """The real bonus token was the candidate of rank `rank` (0 = first) at its outcome, or
        of rank `cap` or beyond."""
        self._observe(*rank_interval(rank, cap))

    def _observe(self, lo: float, hi: float) -> None:
        if self._obs is None:
            self._obs = deque(maxlen=self.window)
        self._obs.append((lo, hi, self._seen))
        self._seen += 1

    def fit(self) -> tuple[float, float]:
        """(m, r) by fit_miss_law over the window, newer observations weighted more (decay per
        observation), with the prior on r at R_PRIOR."""
        if not self._obs:
            return self.m, self.r
        obs = torch.tensor(list(self._obs), dtype=torch.float64)  # [n, 3]
        lo, hi, index = obs.unbind(1)
        self.m, self.r = fit_miss_law(lo, hi, self.decay ** (self._seen - 1 - index), R_PRIOR)
        return self.m, self.r


def ssd_speedup(p_hit: float, e_hit: float, e_miss: float, t_primary: float, t_backup: float) -> float:
    """Theorem 7: tokens per unit of verification time, relative to autoregressive decoding."""
    return (p_hit * e_hit + (1 - p_hit) * e_miss) / (p_hit * max(1.0, t_primary) + (1 - p_hit) * (1 + t_backup))


def prefer_fast_backup(batch: int, *live: float) -> bool:
    """Theorem 17: pick the backup whose speedup model is larger at this batch size (live:
    backup_speedups' figures, p_hit to t_primary)."""
    neural, fast = backup_speedups(batch, *live)
    return fast > neural


def backup_speedups(
    batch: int,
    p_hit: float,
    e_hit: float,
    e_neural: float,
    t_neural: float,
    e_fast: float,
    t_fast: float,
    t_primary: float,
) -> tuple[float, float]:
    """Theorem 17's speedup models (neural, fast) at this batch size: a round skips drafting
    only if all `batch` sequences hit (p_hit^batch)."""
    p_all = p_hit**batch
    return (
        ssd_speedup(p_all, e_hit, e_neural, t_primary, t_neural),
        ssd_speedup(p_all, e_hit, e_fast, t_primary, t_fast),
    )


def backup_threshold(
    p_hit: float,
    e_hit: float,
    e_neural: float,
    t_neural: float,
    e_fast: float,
    t_fast: float,
    t_primary: float,
    max_batch: int = 1024,
) -> int | None:
    """b*: the smallest batch size at which the fast backup wins (None if it never does)."""
    for b in range(1, max_batch + 1):
        if prefer_fast_backup(b, p_hit, e_hit, e_neural, t_neural, e_fast, t_fast, t_primary):
            return b
    return None
