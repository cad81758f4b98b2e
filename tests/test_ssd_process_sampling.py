"""Sampled exactness of SSD on the path users run by default: the drafter in its own process
(`draft_transport="shm"`: worker processes over shared-memory mailboxes), where trees are cut short when the
outcome arrives first and the worker begins a round on its prediction of the announcement.

Each case samples a fixed prompt thousands of times and tests every emitted token against the
target's exact conditional distribution (tests/ssd_stats.py), by the source of its round. The
drafter's own counters prove that the path under test was taken: trees cut short, predicted
rounds confirmed and taken back. These runs depend on timing (where a tree is cut), so they are
not reproducible sample for sample; P_MIN is set for about 30 p-values per run of the file.

Power: the same check on a drafter that pairs each cached token with the draft probabilities of
the neighbouring branch (tests/forked_targets.py, the entry point the engine forks its workers
with in that test) must fail.
"""

from __future__ import annotations

import time

import forked_targets
import pytest
from ssd_stats import N_SAMPLES, STAT_K, STAT_PROMPT, check_conditionals, sample_with_sources
from workers import live_draft_workers

from ssd import LLM, SamplingParams
from ssd.engine import proposers
from ssd.engine.verifier import Verifier

P_MIN = 1e-5
# The board cases' target waits this long before each verification: slower than its pool, as a
# large target is, so that the trees are on the boards when the outcome is known. Without it, how
# many hits came off boards was a matter of timing: 0.7-1.0 rows a round on one machine, 0.08 on a
# slower one, where the power test's 500 samples once gave only p = 6e-8.
SLOW_TARGET_S = 0.01
SLOW_TARGET = ("four_workers_boards",)
BIG_BATCH = dict(max_num_seqs=4096)  # every sample in one batch: the drafter's trees are the slow side

CASES = {
    # name: (sampling params, engine options, samples)
    # Thousands of rows in one batch: the tree is the slow side, and every round's tree is cut
    # before depth K (in every case here; the first asserts it, with a wide fixed budget).
    "temperature1": (
        SamplingParams(temperature=1.0),
        {**BIG_BATCH, "ssd_budget": 24, "ssd_autobudget": False},
        N_SAMPLES,
    ),
    "top_p0.8": (SamplingParams(temperature=1.5, top_p=0.8), BIG_BATCH, N_SAMPLES),
    "top_k5": (SamplingParams(temperature=1.0, top_k=5), BIG_BATCH, N_SAMPLES),
    "saguaro_c0.3": (SamplingParams(temperature=1.0), {**BIG_BATCH, "saguaro_c": 0.3}, N_SAMPLES),
    # Two rows at a time: rounds in which both hit are common, and the worker predicts the next
    # one; sequences finishing every few rounds make it take predictions back. Most trees here
    # reach depth K, some are cut.
    # 500 samples: ~800 rounds, of which 160-200 predictions confirmed and as many taken back.
    "predicted_rounds": (SamplingParams(temperature=1.0), dict(max_num_seqs=2, ssd_backup="neural"), 500),
    # Two workers, two rows: after an all-hit round the worker that did not hold every hit is
    # told the next round (PREDICT) and builds it before the announcement, as the shard that held every hit does.
    # Split by sequence: each worker drafts half of the rows with whole trees.
    "two_workers_by_sequence": (
        SamplingParams(temperature=1.0),
        {**BIG_BATCH, "draft_workers": 2, "draft_split": "sequences"},
        N_SAMPLES,
    ),
    # A pool of two workers sharing the branch grid (each row's hit comes from either share),
    # with penalties, bias and min_p: each branch drafts with its own history
    # (tree_adjustments.py) and the target verifies each position with its own; the check's
    # distributions apply them. (The pool without processing is the same path: no case of its own.)
    "two_workers_penalties": (
        SamplingParams(
            temperature=1.0,
            frequency_penalty=2.0,
            presence_penalty=1.0,
            repetition_penalty=1.5,
            logit_bias={32: 3.0},
            min_p=0.02,
        ),
        {**BIG_BATCH, "draft_workers": 2},
        N_SAMPLES,
    ),
    # Two rows, two workers: the worker that answered every row of a round (held every hit, or
    # drafted the misses as the backup shard) predicts the next one and builds it before its
    # announcement, which confirms it or makes it stale.
    "two_workers_predicted": (
        SamplingParams(temperature=1.0),
        dict(max_num_seqs=2, ssd_backup="neural", draft_workers=2),
        500,
    ),
    # Four workers, each row's answer from the one shard the target names (ResolveMsg.answering),
    # with top-p: at temperature 1.5 and p = 0.8 every row's distribution is cut.
    "four_workers_top_p": (
        SamplingParams(temperature=1.5, top_p=0.8),
        dict(max_num_seqs=4, ssd_backup="neural", draft_workers=4),
        500,
    ),
    # The same pool over a network transport (gRPC, as served pools on other hosts run), at batch
    # 4 and at batch 1: the grid, the named answers and the backups cross sockets, not mailboxes.
    "four_workers_grpc": (
        SamplingParams(temperature=1.0),
        dict(max_num_seqs=4, ssd_backup="neural", draft_workers=4, draft_transport="grpc"),
        500,
    ),
    # Four workers over shm at batch 4, the target slower than its pool (SLOW_TARGET): most hits
    # are read off their workers' boards (shm_board.py), distributions included (the very tensors
    # each depth drew from, processed or not: the board has no path of its own for processing);
    # the power test below breaks the board alone.
    "four_workers_boards": (
        SamplingParams(temperature=1.0),
        dict(max_num_seqs=4, draft_workers=4, ssd_budget=8, ssd_autobudget=False),
        500,
    ),
    "four_workers_grpc_one_row_top_p": (
        SamplingParams(temperature=1.5, top_p=0.8),
        dict(max_num_seqs=1, ssd_backup="neural", draft_workers=4, draft_transport="grpc"),
        300,
    ),
}


# Cases whose every row is answered by the one shard the target names for it (a pool of rows).
NAMED_ANSWERS = ("two_workers_predicted", "four_workers_top_p", "four_workers_grpc", "four_workers_grpc_one_row_top_p")


@pytest.fixture(autouse=True)
def no_leaked_workers():
    yield
    assert live_draft_workers() == []


def run_case(pair, params: SamplingParams, options: dict, n: int, seed_base: int):
    with LLM(*pair, mode="ssd", k=STAT_K, **options) as llm:
        assert llm.engine.config.draft_transport == options.get("draft_transport", "shm")
        prompt_ids = llm.tokenizer.encode(STAT_PROMPT, add_special_tokens=False)
        samples = sample_with_sources(llm, prompt_ids, params, seed_base=seed_base, n=n)
        metrics = llm.metrics()
    return prompt_ids, samples, metrics


@pytest.mark.parametrize("case", list(CASES))
def test_process_transport_samples_follow_target_distribution(peaked_pair, peaked_target, case, monkeypatch):
    params, options, n = CASES[case]
    if case in SLOW_TARGET:
        slow_target(monkeypatch)
    prompt_ids, samples, m = run_case(
        peaked_pair, params, options, n, seed_base=7_000_000 * (1 + list(CASES).index(case))
    )
    result = check_conditionals(peaked_target, prompt_ids, samples, params)
    assert result.get("cache_later", (1.0, 0, 0))[1] >= 0.1 * n, result
    for subset, (p, tested, df) in result.items():
        assert p > P_MIN, (subset, result)
    ssd = m["ssd"]
    workers = options.get("draft_workers", 1)
    assert ssd["draft_workers_live"] == workers and ssd["draft_worker_failures"] == 0, ssd
    assert 0 < m["accepted_tokens"] < m["draft_tokens"], m
    assert m["cache_hits"] > 0 and m["backup_neural_rounds"] + m["backup_fast_rounds"] > 0, m
    rounds = ssd["drafter_rounds"]
    if case == "temperature1":
        assert ssd["drafter_rounds_cut"] > 0.5 * rounds, ssd
    if "draft_workers" in options:
        assert min(ssd["draft_shard_hits"]) > 0, ssd
    if case in NAMED_ANSWERS:
        assert ssd["draft_grids_missed"] == 0 and ssd["replies_awaited"] < workers, ssd
        # Over shm the target reads hits off their workers' boards (shm_board.py). How many is a
        # matter of timing (a depth published before the outcome is known): two_workers_predicted
        # read 0.0967 a round in one CI-like run, so only "some" is asserted here; the case built
        # for boards (four_workers_boards, 1.6 measured with its slow target) asserts a share.
        assert (ssd["board_reads"] > 0) == (options.get("draft_transport", "shm") == "shm"), ssd
    if case == "four_workers_boards":
        assert ssd["board_reads"] > 1.0, ssd  # 1.6 measured (of ~3.6 rows a round that hit)
    if case == "two_workers_predicted":
        assert ssd["drafter_predicted_confirmed"] > 0.1 * rounds, ssd
    if case == "predicted_rounds":
        # Predictions confirmed are a sizeable share of the rounds built (a bug confined to them
        # would show in the cache subset), and some were taken back.
        assert ssd["drafter_predicted_confirmed"] > 0.1 * rounds, ssd
        assert ssd["drafter_predicted_taken_back"] > 20, ssd


def test_the_check_fails_on_a_drafter_that_sends_the_wrong_distribution(peaked_pair, peaked_target, monkeypatch):
    # The engine forks its workers running this entry point instead of the worker's own.
    monkeypatch.setattr(proposers, "run_forked", forked_targets.neighbour_branch_worker)
    params, options, n = CASES["temperature1"]
    prompt_ids, samples, m = run_case(
        peaked_pair, params, {**options, "ssd_budget": 8, "ssd_autobudget": False}, n, 123
    )
    result = check_conditionals(peaked_target, prompt_ids, samples, params)
    assert m["cache_hits"] > 0.3 * m["rounds"], m
    assert min(p for p, _, _ in result.values()) < 1e-8, result


def test_the_check_fails_on_a_board_that_publishes_the_wrong_distribution(peaked_pair, peaked_target, monkeypatch):
    """The same power test for the hits the target reads off a worker's board (the worker's
    replies right, its board wrong): the pool of four_workers_boards, its target as slow. The p
    value varies far more than its sample count does: 500 samples gave 1e-28 to 1e-39 alone and
    6e-8 in a CI run (without the slow target); 300 gave 1e-14 to 1e-25 alone and 2e-8 in a full
    run here. So 500 samples, and a bar 10x below the suite's P_MIN rather than a far one: what
    this test shows is that the check run by the suite fails."""
    monkeypatch.setattr(proposers, "run_forked", forked_targets.neighbour_board_worker)
    slow_target(monkeypatch)
    params, options, n = CASES["four_workers_boards"]
    prompt_ids, samples, m = run_case(peaked_pair, params, options, n, 321)
    result = check_conditionals(peaked_target, prompt_ids, samples, params)
    assert m["ssd"]["board_reads"] > 1.0, m["ssd"]
    assert min(p for p, _, _ in result.values()) < P_MIN / 10, result


def slow_target(monkeypatch) -> None:
    """The engine's verifications wait SLOW_TARGET_S before the target's forward."""
    verify = Verifier.verify

    def slow_verify(self, *args):
        time.sleep(SLOW_TARGET_S)
        return verify(self, *args)

    monkeypatch.setattr(Verifier, "verify", slow_verify)
