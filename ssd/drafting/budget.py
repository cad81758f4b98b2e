"""Sizing the speculation-cache budget B to what the drafter builds within one verification.

The drafter's build time is not proportional to B: the glue forward and the K tree forwards
cost a fixed amount each (on a CPU, about 1 ms of framework time per forward for the bundled
draft), and only the tokens in them grow with B. So the sizer fits, over recent rounds,

    build / verify  ~=  c0 + c1 * B        (c0: fixed share of a verification, c1: per branch)

and moves B toward the largest value whose predicted build fits in `target` verifications.
While every recent round used the same B the slope is unknown; the sizer then steps B up
while there is room and down while there is not, which also gives the fit its spread.
Rounds far slower than usual (the first build after a load, a burst from another process) would
drag a least-squares line anywhere, so observations above twice the window's median ratio are
left out of the fit, and a fit with a negative fixed share is not trusted (steps are used).
B never goes below `min_budget` (the proposer uses K+1: one candidate per outcome); fewer
branches leave whole outcomes uncached, and a drafter too slow even for that is better served
by waiting a little than by a cache that rarely hits.
"""

from __future__ import annotations

from collections import deque


class BudgetSizer:
    def __init__(self, max_budget: int, min_budget: int = 1, target: float = 1.0, window: int = 48) -> None:
        assert 1 <= min_budget <= max_budget
        self.max_budget, self.min_budget = max_budget, min_budget
        self.target = target  # build time allowed, in verifications
        self.obs: deque[tuple[float, float]] = deque(maxlen=window)  # (B, build / verify)
        self.budget = float(max_budget)
        self.c0: float | None = None
        self.c1: float | None = None

    def observe(self, budget_used: int, build_ratio: float) -> float:
        """Record one round (the B it used, its build time over its verification time) and
        return the budget for the next round (a float; callers round it)."""
        if build_ratio <= 0 or budget_used <= 0:
            return self.budget
        self.obs.append((float(budget_used), build_ratio))
        fit = self._fit()
        if fit is None:
            step = 1.15 if build_ratio < self.target else 0.85
            wanted = self.budget * step
        else:
            self.c0, self.c1 = fit
            wanted = (self.target - self.c0) / self.c1
        # Damped move: single rounds are noisy (other processes, cache effects).
        self.budget = min(
            float(self.max_budget), max(float(self.min_budget), self.budget + 0.3 * (wanted - self.budget))
        )
        return self.budget

    def _fit(self) -> tuple[float, float] | None:
        """Least squares of ratio on B over the window less its outliers; None while B has
        (almost) no spread, or when the line puts the fixed share below zero (not a real build)."""
        if len(self.obs) < 8:
            return None
        median = sorted(r for _, r in self.obs)[len(self.obs) // 2]
        obs = [(b, r) for b, r in self.obs if r <= 2 * median]
        n = len(obs)
        mean_b = sum(b for b, _ in obs) / n
        mean_r = sum(r for _, r in obs) / n
        var_b = sum((b - mean_b) ** 2 for b, _ in obs) / n
        if var_b < 0.25:
            return None
        cov = sum((b - mean_b) * (r - mean_r) for b, r in obs) / n
        # The build cannot get cheaper with more branches; a floor keeps the target finite.
        c1 = max(cov / var_b, 1e-3)
        c0 = mean_r - c1 * mean_b
        return (c0, c1) if c0 >= 0 else None
