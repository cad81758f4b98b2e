"""Unit tests of Saguaro's formulas (ssd/drafting/saguaro.py): fan-out, sampling, the miss law, Theorems 7 and 17."""

from __future__ import annotations

import pytest
import torch

from ssd.drafting.saguaro import (
    R_PRIOR,
    OnlineEstimates,
    backup_threshold,
    fit_miss_law,
    geometric_fanout,
    hit_interval,
    marginal_fanout,
    miss_law_hit_rate,
    prefer_fast_backup,
    rank_interval,
    row_fanout,
    saguaro_probs,
    ssd_speedup,
    uniform_fanout,
)


def outcome_probs(k: int, a: float) -> list[float]:
    """The verification outcome's law when each draft token is accepted with probability a:
    P(j) = a^j (1 - a) for j < K, a^K for j = K."""
    return [a**j * (1 - a) for j in range(k)] + [a**k]


@pytest.mark.parametrize("k,a,r", [(4, 0.7, 0.6), (6, 0.8, 0.3), (3, 0.5, 1.5), (5, 0.9, 0.6), (8, 0.6, 0.4)])
def test_geometric_fanout_maximizes_the_expected_hit_rate(k, a, r):
    """Theorem 12 is the optimum of sum_j P(j) p_hit(F_j) under the miss law p_hit = 1 - F^-r at a
    fixed budget: there, one more branch gains the same at every outcome, P(j) r F_j^(-r-1). Checked
    from that condition (not the closed form) at a budget where rounding is negligible."""
    fan = geometric_fanout(10**6, k, a, r)
    gains = [p * r * f ** (-r - 1) for p, f in zip(outcome_probs(k, a), fan)]
    assert max(gains) / min(gains) < 1.01, (fan, gains)


@pytest.mark.parametrize(
    "budget,k,a,r", [(12, 4, 0.7, 0.6), (16, 6, 0.8, 0.3), (40, 3, 0.5, 1.5), (7, 5, 0.9, 0.6), (64, 8, 0.6, 0.4)]
)
def test_geometric_fanout_is_a_valid_allocation(budget, k, a, r):
    fan = geometric_fanout(budget, k, a, r)
    assert len(fan) == k + 1
    assert sum(fan) == budget
    assert all(isinstance(f, int) and f >= 0 for f in fan)
    assert all(fan[j] >= fan[j + 1] for j in range(k - 1)), fan  # non-increasing for j < K


def test_geometric_fanout_end_weight():
    # Full acceptance (j = K) outweighs j = K-1 when a > 1/2 and not when a < 1/2.
    high = geometric_fanout(100, 4, 0.9, 0.5)
    assert high[4] > high[3] and high[4] == max(high), high
    low = geometric_fanout(100, 4, 0.3, 0.5)
    assert low[4] < low[3], low
    # a larger r flattens the allocation
    steep, flat = geometric_fanout(60, 5, 0.5, 0.1), geometric_fanout(60, 5, 0.5, 3.0)
    assert steep[0] - steep[4] > flat[0] - flat[4]


def test_geometric_fanout_respects_caps():
    caps = [3, 3, 3, 3, 50]
    fan = geometric_fanout(30, 4, 0.5, 0.6, caps)
    assert sum(fan) == 30 and all(f <= c for f, c in zip(fan, caps)), fan
    assert fan[:4] == [3, 3, 3, 3]  # the capped head gives its excess to the tail
    fan = geometric_fanout(100, 4, 0.7, 0.6, [2, 2, 2, 2, 2])
    assert fan == [2, 2, 2, 2, 2]  # the budget cannot exceed what the caps allow
    fan = geometric_fanout(20, 3, 0.95, 0.6, [10, 10, 10, 4])
    assert sum(fan) == 20 and fan[3] == 4 and all(f <= 10 for f in fan), fan
    # the engine's caps (vocab - 1 candidates at k < K, vocab at K) never bind for a small vocab budget
    assert sum(geometric_fanout(12, 4, 0.7, 0.6, [2] * 4 + [3])) == 11


def test_geometric_fanout_extreme_estimates_stay_valid():
    for a in (0.0, 1e-6, 0.5, 1.0):
        for r in (0.0, 1e-6, 10.0):
            fan = geometric_fanout(12, 4, a, r)
            assert sum(fan) == 12 and min(fan) >= 0, (a, r, fan)


def test_row_fanout_moves_unreachable_outcomes_to_full_acceptance():
    """Regression: a speculation cut short to L < K tokens kept the round's fan-out, whose
    branches for outcomes past L can never be looked up; with a = 1 (all budget at j = K) every
    short speculation missed."""
    assert row_fanout([0, 0, 0, 0, 12], 2, 258) == [0, 0, 12, 0, 0]
    assert row_fanout([4, 3, 2, 1, 6], 1, 258) == [4, 12, 0, 0, 0]
    assert row_fanout([4, 3, 2, 1, 6], 4, 258) == [4, 3, 2, 1, 6]  # full length: unchanged
    # Caps: vocab at full acceptance, vocab - 1 below (the drafted token is excluded); the
    # rest goes back to unreachable outcomes, so every row still has B branches.
    assert row_fanout([1, 1, 1, 1, 6], 1, 4) == [3, 4, 0, 0, 3]
    for fan in ([5, 4, 3, 2, 1], [0, 0, 0, 0, 40], [9, 9, 9, 9, 9]):
        for length in range(5):
            got = row_fanout(fan, length, 10)
            assert sum(got) == sum(fan) and got[length] >= fan[length], (fan, length, got)


@pytest.mark.parametrize("budget,k", [(12, 4), (16, 6), (5, 5), (3, 6), (100, 7)])
def test_uniform_fanout(budget, k):
    fan = uniform_fanout(budget, k)
    assert len(fan) == k + 1 and sum(fan) == budget
    assert max(fan) - min(fan) <= 1
    assert sum(uniform_fanout(budget, k, [1] * (k + 1))) == min(budget, k + 1)


def test_saguaro_probs_c1_is_identity():
    probs = torch.rand(2, 3, 17).softmax(-1)
    out = saguaro_probs(probs, torch.tensor([1, 2, 5]), 1.0)
    assert torch.equal(out, probs)


@pytest.mark.parametrize("c", [0.0, 0.3, 0.9])
def test_saguaro_probs_scales_exactly_the_top_f(c):
    gen = torch.Generator().manual_seed(0)
    probs = torch.rand(2, 3, 17, generator=gen).softmax(-1)
    fanout = torch.tensor([0, 2, 5])
    out = saguaro_probs(probs, fanout, c)
    assert out.shape == probs.shape
    torch.testing.assert_close(out.sum(-1), torch.ones(2, 3))
    for b in range(2):
        for n in range(3):
            p = probs[b, n].double()
            top = set(p.argsort(descending=True)[: int(fanout[n])].tolist())
            scale = torch.tensor([c if t in top else 1.0 for t in range(17)], dtype=torch.float64)
            want = p * scale / (p * scale).sum()
            torch.testing.assert_close(out[b, n].double(), want, rtol=1e-5, atol=1e-7)
    # per-row fan-outs [b, n] agree with the same F given row by row
    per_row_fan = torch.tensor([[1, 1, 1], [3, 0, 2]])
    per_row = saguaro_probs(probs, per_row_fan, c)
    for b in range(2):
        for n in range(3):
            alone = saguaro_probs(probs[b : b + 1, n : n + 1], per_row_fan[b, n : n + 1], c)[0, 0]
            torch.testing.assert_close(per_row[b, n], alone)
    torch.testing.assert_close(per_row[1, 1], probs[1, 1])  # F = 0: unchanged


def test_saguaro_probs_all_mass_in_top_f_with_c0_falls_back():
    one_hot = torch.zeros(1, 1, 9)
    one_hot[0, 0, 4] = 1.0
    out = saguaro_probs(one_hot, torch.tensor([1]), 0.0)
    assert torch.equal(out, one_hot)
    # C = 0 with mass outside the top-F: the top-F tokens get nothing
    probs = torch.tensor([[[0.5, 0.3, 0.2]]])
    out = saguaro_probs(probs, torch.tensor([1]), 0.0)
    torch.testing.assert_close(out, torch.tensor([[[0.0, 0.6, 0.4]]]))


def simulate_rounds(est: OnlineEstimates, a: float, k: int, rounds: int, gen: torch.Generator) -> None:
    for _ in range(rounds):
        accepted = 0
        while accepted < k and float(torch.rand(1, generator=gen)) < a:
            accepted += 1
        est.observe_round(accepted, k)


@pytest.mark.parametrize("a", [0.3, 0.6, 0.85])
def test_online_acceptance_estimate_converges(a):
    est = OnlineEstimates()
    simulate_rounds(est, a, 5, 3000, torch.Generator().manual_seed(1))
    assert est.a == pytest.approx(a, abs=0.05)


def test_online_acceptance_estimate_tracks_a_change():
    est, gen = OnlineEstimates(), torch.Generator().manual_seed(2)
    simulate_rounds(est, 0.9, 4, 2000, gen)
    assert est.a == pytest.approx(0.9, abs=0.05)
    simulate_rounds(est, 0.4, 4, 2000, gen)
    assert est.a == pytest.approx(0.4, abs=0.05)


def test_online_miss_law_estimate():
    """(m, r) from simulated hits with 1 - p_hit(F) = m F^(-r), fitted once on the final window
    (a long one here, to test the fit rather than the window's noise). F = 1 is an observation
    like any other (it measures m); F = 0 is not recorded."""
    gen = torch.Generator().manual_seed(3)
    fits = {}
    for m_true, r_true in ((1.0, 0.3), (0.4, 1.2), (0.15, 0.5)):
        est = OnlineEstimates(window=2000, decay=0.9995)
        for _ in range(2000):
            fan = int(torch.randint(1, 7, (1,), generator=gen))
            hit = float(torch.rand(1, generator=gen)) < 1 - m_true * fan ** (-r_true)
            est.observe_hit(fan, hit)
        fits[m_true, r_true] = est.fit()
        assert est.m == pytest.approx(m_true, abs=0.07) and est.r == pytest.approx(r_true, abs=0.25), (
            m_true,
            r_true,
            fits,
        )
    assert fits[1.0, 0.3][1] < fits[0.4, 1.2][1]
    est = OnlineEstimates()
    est.observe_hit(0, True)
    assert est.fit() == (OnlineEstimates().m, OnlineEstimates().r)


def _intervals(fanout: torch.Tensor, hit: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    lo_hi = [hit_interval(int(f), bool(h)) for f, h in zip(fanout, hit)]
    return torch.tensor([x for x, _ in lo_hi]), torch.tensor([y for _, y in lo_hi])


def _ranks(n: int, m: float, r: float, gen: torch.Generator) -> torch.Tensor:
    """Ranks with P(rank >= F) = m F^(-r) (F >= 1), by inversion."""
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    return torch.where(u >= m, torch.zeros_like(u), (u / m).pow(-1 / r).floor()).long()


def test_miss_law_fit_from_hits_at_small_fanouts_predicts_wider_trees():
    """fit_miss_law on hits and misses at small fan-outs (a budget of one worker) predicts the
    hit rate at the fan-outs of a tree 2 and 4 times wider."""
    gen = torch.Generator().manual_seed(4)
    m_true, r_true = 0.25, 0.7
    fanout = torch.randint(1, 5, (4000,), generator=gen)
    hit = torch.rand(4000, generator=gen) < miss_law_hit_rate(fanout, m_true, r_true)
    m, r = fit_miss_law(*_intervals(fanout, hit))
    assert m == pytest.approx(m_true, abs=0.05) and r == pytest.approx(r_true, abs=0.2), (m, r)
    for wider in (2, 4):
        f = fanout * wider
        truth = float(miss_law_hit_rate(f, m_true, r_true).mean())
        assert float(miss_law_hit_rate(f, m, r).mean()) == pytest.approx(truth, abs=0.02)
    # Only one fan-out seen: m is measured, r stays at its prior.
    ones = torch.ones(500, dtype=torch.long)
    m1, r1 = fit_miss_law(*_intervals(ones, torch.rand(500, generator=gen) < 0.8))
    assert m1 == pytest.approx(0.2, abs=0.05) and r1 == pytest.approx(R_PRIOR, abs=0.03)
    assert float(miss_law_hit_rate(torch.tensor([0, 1]), 0.5, 1.0)[0]) == 0.0
    # A miss at F = 0 says nothing; with no informative observation the fit is the prior law.
    assert fit_miss_law(*_intervals(torch.tensor([0, 0]), torch.tensor([False, False]))) == (1.0, R_PRIOR)


@pytest.mark.parametrize("m_true,r_true,cap", [(0.3, 0.8, 128), (0.1, 1.5, 128), (0.6, 0.3, 8)])
def test_miss_law_fit_from_ranks_recovers_the_law(m_true, r_true, cap):
    """One rank per round (the bonus token's place among the candidates, censored at the cap)
    tells the hit at every fan-out: 2000 of them pin (m, r) down, the paper's law (m = 1) does
    not fit them, and the fitted law predicts the hit rate at fan-outs 1..64."""
    gen = torch.Generator().manual_seed(5)
    ranks = _ranks(2000, m_true, r_true, gen)
    lo_hi = [rank_interval(int(x), cap) for x in ranks]
    lo, hi = torch.tensor([x for x, _ in lo_hi]), torch.tensor([y for _, y in lo_hi])
    m, r = fit_miss_law(lo, hi)
    assert m == pytest.approx(m_true, abs=0.04) and r == pytest.approx(r_true, abs=0.15), (m, r)
    f = torch.arange(1, 65)
    empirical = (ranks.unsqueeze(0) < f.unsqueeze(1)).double().mean(1)  # [64] hit rate at each F
    assert (miss_law_hit_rate(f, m, r) - empirical).abs().max() < 0.04
    _, r_paper = fit_miss_law(lo, hi, intercept=False)
    assert (miss_law_hit_rate(f, 1.0, r_paper) - empirical).abs().max() > 0.1
    est = OnlineEstimates(window=2000, decay=1.0)
    for x in ranks.tolist():
        est.observe_rank(x, cap)
    assert est.fit() == (m, r)


def test_ssd_speedup_theorem_7():
    assert ssd_speedup(1.0, 3.0, 1.0, 0.5, 9.0) == pytest.approx(3.0)  # T_p < 1 is hidden
    assert ssd_speedup(1.0, 3.0, 1.0, 2.0, 9.0) == pytest.approx(1.5)
    p, eh, em, tp, tb = 0.7, 3.2, 2.1, 1.1, 0.4
    want = (p * eh + (1 - p) * em) / (p * max(1, tp) + (1 - p) * (1 + tb))
    assert ssd_speedup(p, eh, em, tp, tb) == pytest.approx(want)


def test_backup_threshold_falls_with_hit_rate():
    """Corollary 16: a round skips drafting only if all b rows hit (p_hit^b), so the larger the
    batch the more rounds pay the backup; with a slow neural backup the fast one wins from b*
    on, and b* falls as p_hit falls."""
    live = dict(e_hit=3.0, e_neural=3.0, t_neural=1.2, e_fast=1.5, t_fast=0.01, t_primary=3.0)
    hit_rates = (0.99, 0.97, 0.95, 0.9, 0.8, 0.6)
    thresholds = [backup_threshold(p, **live) for p in hit_rates]
    assert all(b is not None and b >= 1 for b in thresholds), thresholds
    assert thresholds == sorted(thresholds, reverse=True), thresholds
    assert thresholds[0] > 10 * thresholds[-1], thresholds
    for p, b_star in zip(hit_rates, thresholds):
        # neural below b*, fast from b* on (the model's decision in the engine)
        if b_star > 1:
            assert not prefer_fast_backup(b_star - 1, p, 3.0, 3.0, 1.2, 1.5, 0.01, 3.0)
        assert all(prefer_fast_backup(b, p, 3.0, 3.0, 1.2, 1.5, 0.01, 3.0) for b in range(b_star, b_star + 20))
    # A neural backup as cheap as the fast one and better is never beaten.
    assert backup_threshold(0.9, **{**live, "t_neural": 0.01}) is None
    assert backup_threshold(0.9, **live, max_batch=thresholds[3] - 1) is None


def expected_hits(fan: list[int], k: int, a: float, m: float, r: float) -> float:
    return sum(p * (1 - m * f**-r if f >= 1 else 0.0) for p, f in zip(outcome_probs(k, a), fan))


def every_allocation(budget: int, slots: int, caps: list[int]):
    if slots == 1:
        if budget <= caps[0]:
            yield [budget]
        return
    for f in range(min(budget, caps[0]) + 1):
        for rest in every_allocation(budget - f, slots - 1, caps[1:]):
            yield [f, *rest]


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("budget", [1, 4, 7, 12])
@pytest.mark.parametrize("a,m,r", [(0.7, 0.4, 0.6), (0.9, 1.0, 0.6), (0.5, 0.1, 2.0), (0.3, 0.8, 0.2), (0.8, 0.0, 0.6)])
def test_marginal_fanout_is_the_integer_optimum(k, budget, a, m, r):
    """Against every allocation of the budget (brute force), with and without caps that bind."""
    for caps in ([budget] * (k + 1), [2] * k + [3]):
        best = max(expected_hits(f, k, a, m, r) for f in every_allocation(min(budget, sum(caps)), k + 1, caps))
        fan = marginal_fanout(budget, k, a, m, r, caps)
        assert sum(fan) == min(budget, sum(caps)) and all(0 <= f <= c for f, c in zip(fan, caps)), fan
        assert expected_hits(fan, k, a, m, r) == pytest.approx(best, rel=1e-12, abs=1e-15), (fan, caps)


def test_marginal_fanout_gives_every_outcome_a_first_branch_when_the_intercept_pays():
    """Theorem 12's rounding leaves an outcome without a branch at B = K + 1; under a miss law
    whose first candidate often hits (m small), one branch per outcome is worth more."""
    assert 0 in geometric_fanout(7, 6, 0.9, 0.6)
    assert marginal_fanout(7, 6, 0.9, 0.1, 0.6) == [1] * 7
    assert expected_hits(marginal_fanout(7, 6, 0.9, 0.1, 0.6), 6, 0.9, 0.1, 0.6) > expected_hits(
        geometric_fanout(7, 6, 0.9, 0.6), 6, 0.9, 0.1, 0.6
    )
