"""The projection for a draft on its own device (ssd/bench/projection.py): Theorem 7 in absolute
times, checked against cases worked by hand, and its inputs taken from bench records."""

from __future__ import annotations

import math

import pytest

from ssd.bench.projection import (
    ProjectionInputs,
    format_projections,
    inputs_from_records,
    project_runs,
    projected_tokens_per_s,
)


def inputs(**changes) -> ProjectionInputs:
    base = dict(verify_ms=10.0, primary_ms=6.0, backup_ms=12.0, exchange_ms=1.0, p_hit=1.0, e_hit=4.0, e_miss=3.0)
    return ProjectionInputs(**{**base, **changes})


@pytest.mark.parametrize(
    "changes,expected",
    [
        # Every round a hit, the tree ready in time: 4 tokens per verification plus exchange, 11 ms.
        ({}, 4000 / 11),
        # A hit whose tree is late: the round waits for it (15 ms), then the exchange.
        ({"primary_ms": 15.0}, 4000 / 16),
        # Every round a miss: verification, exchange, then the backup: 10 + 1 + 12 = 23 ms for 3 tokens.
        ({"p_hit": 0.0}, 3000 / 23),
        # Half and half: 0.5 * 4 + 0.5 * 3 = 3.5 tokens in 0.5 * 11 + 0.5 * 23 = 17 ms.
        ({"p_hit": 0.5}, 3500 / 17),
        # 0.8 * 5 + 0.2 * 2 = 4.4 tokens in 0.8 * max(8, 9) + 0.2 * (8 + 4) = 9.6 ms, no exchange.
        (dict(verify_ms=8.0, primary_ms=9.0, backup_ms=4.0, exchange_ms=0.0, p_hit=0.8, e_hit=5.0, e_miss=2.0),
         4400 / 9.6),
    ],
)  # fmt: skip
def test_hand_computed_cases(changes, expected):
    assert projected_tokens_per_s(inputs(**changes)) == pytest.approx(expected, rel=1e-12)


def test_without_the_exchange_it_is_theorem_7_times_ar_rate():
    """DESIGN.md's speedup over ar, in units of one verification, times 1 / t_v."""
    p, e_hit, e_miss, t_v, t_p, t_b = 0.7, 4.5, 2.5, 7.0, 9.1, 3.5
    speedup = (p * e_hit + (1 - p) * e_miss) / (p * max(1, t_p / t_v) + (1 - p) * (1 + t_b / t_v))
    got = projected_tokens_per_s(inputs(verify_ms=t_v, primary_ms=t_p, backup_ms=t_b, exchange_ms=0.0,
                                        p_hit=p, e_hit=e_hit, e_miss=e_miss))  # fmt: skip
    assert got == pytest.approx(speedup * 1000 / t_v, rel=1e-12)


@pytest.mark.parametrize("p_hit", [-0.1, 1.5, math.nan])
def test_a_hit_rate_outside_0_1_is_refused(p_hit):
    with pytest.raises(ValueError, match="p_hit"):
        projected_tokens_per_s(inputs(p_hit=p_hit))


def records(batch: int = 1, temperature: float = 0.0) -> list[dict]:
    common = {"setting": "paper", "temperature": temperature, "batch_size": batch, "supported": True}
    sd = {**common, "mode": "sd", "verify_ms_per_round": 10.0, "draft_ms_per_round": 12.0, "tokens_per_round": 3.0,
          "decode_tokens_per_s": 100.0}  # fmt: skip
    ssd = {**common, "mode": "ssd", "cache_hit_rate": 0.5, "target_exchange_ms": 1.0, "tokens_per_round": 3.4,
           "counters": {"hit_steps": 10, "hit_step_tokens": 40},
           "ssd": {"drafter_prepare_ms": 2.0, "drafter_depth_ms": 1.0, "tokens_per_round_on_hit": 9.9}}  # fmt: skip
    ar = {**common, "mode": "ar", "tokens_per_s": 50.0}
    return [ar, sd, ssd]


def test_inputs_come_from_sd_and_ssd_records():
    _, sd, ssd = records()
    got = inputs_from_records(sd, ssd, k=4)
    # t_p = 2 + 4 x 1; E_hit from the run's hit steps (40 / 10), not the live estimate.
    assert got == inputs(primary_ms=6.0, p_hit=0.5, e_hit=4.0)
    del ssd["counters"]
    assert inputs_from_records(sd, ssd, k=4).e_hit == 9.9
    del ssd["ssd"]["drafter_depth_ms"]
    assert inputs_from_records(sd, ssd, k=4) is None


def test_project_runs_pairs_batch_1_ssd_with_its_sd_and_labels_it():
    rows = project_runs(records() + records(batch=4) + records(temperature=1.0)[1:2], k=4)
    assert [(r["temperature"], r["mode"]) for r in rows] == [(0.0, "ssd")]  # T=1 has no ssd, batch 4 no projection
    (row,) = rows
    assert row["projected_tokens_per_s"] == pytest.approx(3500 / 17, abs=1e-3)
    assert row["ratio_to_sd"] == pytest.approx(3500 / 17 / 100, abs=1e-4)
    text = format_projections(rows)
    assert "projection, not a measurement" in text and "PROJECTED 205.9 tok/s" in text
    assert "t_v 10.00 ms, t_p 6.00 ms, t_b 12.00 ms, t_x 1.00 ms, p 0.500, E_hit 4.00, E_miss 3.00" in text
