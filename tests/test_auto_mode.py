"""Mode auto (ssd/engine/autopilot.py): each round in whichever of ssd, sd and ar measures the
most tokens per second. The chooser against scripted costs; the engine's output, with switches
forced every few rounds, equal to Hugging Face's greedy output and distributed as the target's
at T=1; and a draft made slow on purpose, or plain decoding made slow, moving the choice."""

from __future__ import annotations

import dataclasses
import random
import time

import pytest
import torch
from ssd_stats import STAT_K, STAT_PROMPT, check_conditionals, sample_with_sources
from test_ssd import (  # noqa: F401 - prompts, tiny_reference, no_leaked_workers: the fixtures of test_ssd
    check_greedy,
    no_leaked_workers,
    prompts,
    tiny_reference,
)

from ssd import LLM, SamplingParams
from ssd.core.config import EngineArgs, available_cpus
from ssd.drafting.sd_proposer import SDProposer
from ssd.drafting.ssd_proposer import SSDProposer
from ssd.engine.autopilot import ModeChooser, bucket_of
from ssd.engine.proposers import round_threads
from ssd.engine.verifier import Verifier

P_MIN = 1e-3
# Switch every few rounds: every round is a probe of the next mode.
SWITCHING = dict(mode="auto", k=4, ssd_budget=12, ssd_autobudget=False, auto_explore_every=2, auto_probe_rounds=1)


# ---- the chooser against scripted costs -------------------------------------------------------


def drive(chooser: ModeChooser, rates, rounds: int, batch: int = 1, seconds=lambda chosen: 1.0) -> list[str]:
    """Run `rounds` rounds where mode m commits rates(m, batch) tokens in seconds(the modes chosen
    so far, this round's last); -> the modes."""
    chosen = []
    for _ in range(rounds):
        mode = chooser.choose(batch)
        chosen.append(mode)
        chooser.record(mode, batch, seconds(chosen), rates(mode, batch))
    return chosen


def test_the_chooser_settles_on_the_fastest_mode_within_its_probes():
    chooser = ModeChooser(explore_every=100, first_period=100, probe_rounds=4, warmup=1)
    chosen = drive(chooser, lambda m, b: {"ssd": 5.0, "sd": 4.0, "ar": 1.0}[m], 100)
    settled = 3 * (1 + 4) + 1  # each mode probed once: a warm-up round (two for ssd) and four measured
    assert chosen[settled:] == ["ssd"] * (100 - settled), chosen
    chooser = ModeChooser(explore_every=100, first_period=100, probe_rounds=4, warmup=1)
    chosen = drive(chooser, lambda m, b: {"ssd": 2.0, "sd": 4.0, "ar": 3.0}[m], 100)
    assert chosen[settled:] == ["sd"] * (100 - settled), chosen


def test_a_stale_estimate_is_measured_again_and_the_choice_follows():
    """sd is best until the draft gets slow; within about twice the averaging window (1/weight
    rounds) the chooser moves to ar."""
    chooser = ModeChooser(explore_every=40, probe_rounds=3, warmup=1, weight=1 / 32)
    drive(chooser, lambda m, b: {"ssd": 3.0, "sd": 4.0, "ar": 2.0}[m], 60)
    assert chooser.current == "sd"
    chosen = drive(chooser, lambda m, b: {"ssd": 1.0, "sd": 1.5, "ar": 2.0}[m], 2 * 32 + 2 * 5 + 30)
    # The last 30 rounds: ar, but for at most one exploration's probes of the two others.
    assert chosen[-30:].count("ar") >= 30 - 2 * (3 + 2), chosen


def test_exploration_is_bounded():
    """Away from the best mode: (modes - 1) x (probe_rounds + warmup) rounds per exploration, the
    explorations first_period apart, then twice that, ..., up to explore_every."""
    chooser = ModeChooser(explore_every=64, first_period=16, probe_rounds=4, warmup=1)
    chosen = drive(chooser, lambda m, b: {"ssd": 5.0, "sd": 4.0, "ar": 1.0}[m], 15 + 64 * 10)
    away = sum(m != "ssd" for m in chosen[15:])
    explorations = 2 + 64 * 10 // 64  # at 16 and 32 rounds, then every 64
    assert 0 < away <= explorations * 2 * (4 + 1), away
    assert chooser.switches <= 3 + 3 * explorations  # out to each probe and back


def test_the_choice_is_per_batch_size():
    """A large batch rarely hits in every row, so ssd loses there while it wins alone."""

    def rates(mode, batch):
        return {"ssd": 5.0 if batch == 1 else 3.0, "sd": 4.0, "ar": 1.0}[mode] * batch

    chooser = ModeChooser(explore_every=1000, first_period=1000, probe_rounds=3, warmup=1)
    assert drive(chooser, rates, 40, batch=1)[-5:] == ["ssd"] * 5
    # A batch of 16 is judged by the bucket of 1 for a few rounds (a batch passing through a
    # bucket is not worth probing), then measured: settle_rounds + 2 probes.
    at_16 = drive(chooser, rates, 60, batch=16)
    assert at_16[:16] == ["ssd"] * 16 and at_16[-5:] == ["sd"] * 5, at_16
    assert drive(chooser, rates, 10, batch=1)[-5:] == ["ssd"] * 5  # the bucket of 1 was kept
    assert [bucket_of(b) for b in (1, 2, 3, 4, 5, 16, 17)] == [1, 2, 4, 4, 8, 16, 32]


def test_greedy_and_sampled_batches_are_judged_apart():
    """SSD's hit rate falls most from greedy to sampled rows: a replica whose traffic moves between
    them picks each regime's best mode, and back in a regime it measured, its best at once (one
    set of estimates for both moved only a long window's way, 1/weight rounds, after a change)."""

    def drive_regime(chooser, greedy: bool, rounds: int) -> list[str]:
        chosen = []
        for _ in range(rounds):
            mode = chooser.choose(1, greedy)
            chosen.append(mode)
            chooser.record(mode, 1, 1.0, {"ssd": 5.0 if greedy else 3.0, "sd": 4.0, "ar": 1.0}[mode], greedy)
        return chosen

    chooser = ModeChooser(explore_every=1000, first_period=1000, probe_rounds=3, warmup=1)
    assert drive_regime(chooser, True, 40)[-5:] == ["ssd"] * 5
    # Judged by the greedy bucket for settle_rounds, then measured in ssd and sd (ar is far behind).
    sampled = drive_regime(chooser, False, 60)
    assert sampled[-5:] == ["sd"] * 5 and "ar" not in sampled, sampled
    assert drive_regime(chooser, True, 10) == ["ssd"] * 10
    assert drive_regime(chooser, False, 10) == ["sd"] * 10
    # Each regime's estimate is its own rounds' rate, untouched by the other's.
    estimates = {g: chooser.stats(1, greedy=g)["modes"]["ssd"]["estimated_tokens_per_second"] for g in (True, False)}
    assert estimates == {True: 5.0, False: 3.0}, estimates


def test_a_new_bucket_is_probed_only_in_the_modes_not_far_behind():
    """ar, far behind sd and ssd where the batch was 1, is not probed when the batch settles at
    16 (a served batch wanders over buckets); an exploration that probes far modes measures it
    there later, and where it has become the best the choice follows."""

    def rates(ar_at_16: float):
        return lambda mode, batch: {"ssd": 5.0, "sd": 4.0, "ar": 1.0 if batch == 1 else ar_at_16}[mode] * batch

    chooser = ModeChooser(explore_every=1000, first_period=1000, probe_rounds=3, warmup=1)
    drive(chooser, rates(1.0), 40, batch=1)
    at_16 = drive(chooser, rates(1.0), 200, batch=16)
    assert "ar" not in at_16 and "sd" in at_16 and at_16[-5:] == ["ssd"] * 5, at_16
    # The bucket of 16 judges the bucket of 8 (the nearest): ar, skipped there, stays skipped.
    assert "ar" not in drive(chooser, rates(1.0), 60, batch=8)
    # Explorations every 16 rounds: within far_every (4) of them, one probes the far modes.
    chooser = ModeChooser(explore_every=16, first_period=16, probe_rounds=3, warmup=1)
    drive(chooser, rates(8.0), 40, batch=1)
    at_16 = drive(chooser, rates(8.0), 4 * 16 + 48, batch=16)
    assert at_16[-48:].count("ar") >= 48 - 3 * (3 + 2), at_16  # but for one exploration's probes


def test_the_chooser_takes_any_walk_of_batch_sizes():
    """A served batch wanders: random walks over 1..32 rows with noisy rates never fail a round
    (a skipped mode at a judging bucket once raised a KeyError and took the replica down)."""
    rng = random.Random(7)
    for _ in range(20):
        chooser = ModeChooser(explore_every=64, first_period=8, probe_rounds=3, warmup=1, settle_rounds=4)
        base = {m: rng.uniform(0.5, 5.0) for m in ("ssd", "sd", "ar")}
        batch = 1
        for _ in range(1500):
            batch = min(32, max(1, batch + rng.choice((-1, 0, 0, 1))))
            mode = chooser.choose(batch)
            chooser.record(mode, batch, rng.uniform(0.5, 1.5), base[mode] * batch ** rng.uniform(0.5, 1.0))
        assert chooser.stats(batch)["mode"] in ("ssd", "sd", "ar")


def test_a_probe_of_ar_is_short():
    """ar commits exactly the batch's tokens a round, so its probe averages fewer rounds."""
    chooser = ModeChooser(explore_every=1000, first_period=1000, probe_rounds=12, steady_probe_rounds=4, warmup=1)
    chosen = drive(chooser, lambda m, b: {"ssd": 5.0, "sd": 4.0, "ar": 1.0}[m], 60)
    assert chosen[:40] == ["ssd"] * 14 + ["sd"] * 13 + ["ar"] * 5 + ["ssd"] * 8, chosen


def test_a_mode_in_use_at_a_new_bucket_is_judged_by_all_its_rounds_there():
    """The batch grows from 1 to 8 in ssd, the best mode at both; ssd's first round at 8 rows is
    slow (its drafters prefill the new rows). Its estimate there is the mean of its rounds, so the
    probe of sd when the bucket settles leaves ssd in use; an estimate that gave its first round
    the weight of 1/weight rounds judged ssd at a third of its speed and moved to sd."""
    chooser = ModeChooser(explore_every=1000, first_period=1000, probe_rounds=3, warmup=1, settle_rounds=16)
    drive(chooser, lambda m, b: {"ssd": 5.0, "sd": 4.0, "ar": 1.0}[m], 30)
    assert chooser.current == "ssd"
    rates = {"ssd": 6.0, "sd": 4.0, "ar": 1.0}
    chosen = drive(chooser, lambda m, b: rates[m], 60, batch=8, seconds=lambda chosen: 3.0 if len(chosen) == 1 else 1.0)
    assert chosen[-30:] == ["ssd"] * 30 and "sd" in chosen, chosen


def test_an_interrupted_round_does_not_decide_a_probe():
    """sd is the best mode, but one round of its first probe takes seven times as long (the OS, a
    collector): that round is left out of the probe's mean, so sd is chosen, not judged far behind
    (and then seldom probed again)."""
    chooser = ModeChooser(explore_every=1000, first_period=1000, probe_rounds=12, warmup=1)
    rates = {"ssd": 3.5, "sd": 4.0, "ar": 1.0}

    def seconds(chosen: list[str]) -> float:  # sd's sixth round is interrupted
        return 7.0 if chosen[-1] == "sd" and chosen.count("sd") == 6 else 1.0

    drive(chooser, lambda m, b: rates[m], 60, batch=8, seconds=seconds)
    assert chooser.current == "sd", chooser.stats(8)
    assert chooser.stats(8)["modes"]["sd"]["estimated_tokens_per_second"] == 4.0


# ---- the engine ---------------------------------------------------------------------------------


def test_ssd_drafters_are_sent_nothing_while_other_modes_run(tiny_pair, prompts, tiny_reference):
    """Out of ssd, an auto engine's draft workers let go of the batch and get no admissions and
    releases as requests come and go (on shared cores their work slowed the rounds that ran);
    back in ssd they rejoin, and their trees hit again."""
    with LLM(*tiny_pair, mode="auto", k=4, ssd_budget=12, ssd_autobudget=False, max_num_seqs=2) as llm:
        llm.engine.chooser = ModeChooser(("sd",))  # a chooser with one mode: every round in sd
        llm.generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=4))
        sent = dict(llm.metrics()["ssd"]["wire_bytes_sent"])
        check_greedy(llm, prompts, tiny_reference)
        m = llm.metrics()
        assert m["ssd"]["wire_bytes_sent"] == sent and m["rounds_by_mode"].get("ssd", 0) == 0, m
        llm.engine.chooser = ModeChooser(("ssd",))
        check_greedy(llm, prompts, tiny_reference)
        m = llm.metrics()
    assert m["ssd"]["wire_bytes_sent"]["ADMIT"] > sent["ADMIT"] and m["cache_hits"] > 0, m


def test_the_sd_draft_prefills_nothing_while_other_modes_run(tiny_pair, prompts, tiny_reference):
    """Out of sd, an auto engine admits requests without the SD draft's prefill (a draft forward
    on the engine's thread, for rounds that may never come); once sd runs, its first proposal
    feeds a deferred row's whole sequence, and the output is still the target's."""
    with LLM(*tiny_pair, mode="auto", k=4, ssd_budget=12, ssd_autobudget=False, max_num_seqs=2) as llm:
        runner = llm.engine.proposers["sd"].runner
        forwards, original = [], runner.forward

        def counted(cache, tokens, *args, **kwargs):
            forwards.append(tokens.shape)
            return original(cache, tokens, *args, **kwargs)

        runner.forward = counted
        llm.engine.chooser = ModeChooser(("ssd",))
        check_greedy(llm, prompts, tiny_reference)
        assert forwards == [], forwards
        llm.engine.chooser = ModeChooser(("ssd", "sd"), explore_every=4, probe_rounds=2, first_period=4)
        check_greedy(llm, prompts, tiny_reference)
        m = llm.metrics()
    assert m["rounds_by_mode"]["sd"] > 10 and max(shape[1] for shape in forwards) > 4, (m["rounds_by_mode"], forwards)


def test_auto_greedy_matches_hf_with_switches_every_few_rounds(tiny_pair, prompts, tiny_reference):
    with LLM(*tiny_pair, max_num_seqs=2, **SWITCHING) as llm:
        # Every exploration probes both other modes: on the tiny pair ar runs ~2x ssd, so ssd can
        # fall below `far` x ar and be probed every fourth exploration only, as timing decides.
        llm.engine.chooser.far = 0.0
        check_greedy(llm, prompts, tiny_reference)
        m = llm.metrics()
    by_mode = m["rounds_by_mode"]
    assert set(by_mode) == {"ssd", "sd", "ar"} and min(by_mode.values()) > 10, by_mode
    # ~90 rounds, an exploration every ~8 with two or three switches each: 21-24 switches measured
    # (a CI run read 20, with ssd probed less often); a switch every 7 rounds still exercises rejoins.
    assert m["auto"]["switches"] > 12 and m["ssd"]["draft_worker_failures"] == 0, m["auto"]
    assert m["cache_hits"] > 0, m  # ssd rounds after a rejoin still hit


def test_auto_samples_follow_the_target_distribution_with_switches(peaked_pair, peaked_target):
    """Chi-square at T=1 over the emitted tokens of 3000 seeded requests, rounds in all three modes."""
    params = SamplingParams(temperature=1.0)
    with LLM(*peaked_pair, **{**SWITCHING, "k": STAT_K, "max_num_seqs": 16}) as llm:
        prompt_ids = llm.tokenizer.encode(STAT_PROMPT, add_special_tokens=False)
        samples = sample_with_sources(llm, prompt_ids, params, seed_base=9_100_000)
        m = llm.metrics()
    assert min(m["rounds_by_mode"].get(mode, 0) for mode in ("ssd", "sd", "ar")) > 100, m["rounds_by_mode"]
    p, tested, _ = check_conditionals(peaked_target, prompt_ids, samples, params)["all"]
    assert p > P_MIN and tested > 10_000, (p, tested)


def _slowed(cls, name: str, seconds: float, when=lambda *a: True):
    original = getattr(cls, name)

    def slow(self, *args, **kwargs):
        if when(*args):
            time.sleep(seconds)
        return original(self, *args, **kwargs)

    return slow


@pytest.mark.parametrize("slow", ["draft", "plain"])
def test_a_slow_draft_moves_auto_to_plain_decoding_and_slow_plain_decoding_to_speculation(tiny_pair, monkeypatch, slow):
    if slow == "draft":  # every speculative round waits 60 ms for its draft
        monkeypatch.setattr(SDProposer, "propose", _slowed(SDProposer, "propose", 0.06))
        monkeypatch.setattr(SSDProposer, "propose", _slowed(SSDProposer, "propose", 0.06))
    else:  # a round without speculation waits 60 ms
        monkeypatch.setattr(Verifier, "verify", _slowed(Verifier, "verify", 0.06, lambda seqs, spec, *_: spec.k == 0))
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    with LLM(*tiny_pair, mode="auto", k=4, auto_explore_every=32, auto_probe_rounds=3) as llm:
        llm.generate(["def add(a, b):"], params)
        auto = llm.metrics()["auto"]
    expected = {"ar"} if slow == "draft" else {"ssd", "sd"}
    assert auto["mode"] in expected, auto
    rounds = {mode: figures["rounds"] for mode, figures in auto["modes"].items()}
    chosen = sum(rounds[m] for m in expected)
    assert chosen >= 0.6 * sum(rounds.values()), auto


@pytest.fixture
def every_core():
    """torch's default threads in this process (the suite runs on one: conftest), restored after."""
    previous = torch.get_num_threads()
    torch.set_num_threads(available_cpus())
    yield available_cpus()
    torch.set_num_threads(previous)


@pytest.mark.skipif(available_cpus() < 2, reason="one core: SSD's rounds and the others get the same threads")
def test_ssd_rounds_leave_the_draft_workers_their_cores(tiny_pair, prompts, tiny_reference, every_core):
    """With num_threads unset and the draft workers on this host, an SSD round runs the target on
    the cores the workers' threads leave (on every core, an SSD round at batch 2 took 3x as long
    on 2 cores); an auto engine's sd and ar rounds take the process's threads, and close() puts
    them back. (A num_threads given is kept: test_threads_beside_workers_...)"""
    beside = max(1, every_core - 1)  # one worker of one thread
    with LLM(*tiny_pair, mode="auto", k=4, ssd_budget=12, ssd_autobudget=False, max_num_seqs=2) as llm:
        for mode, threads in (("sd", every_core), ("ssd", beside), ("ar", every_core), ("ssd", beside)):
            llm.engine.chooser = ModeChooser((mode,))
            llm.generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=4))
            assert torch.get_num_threads() == threads, mode
        check_greedy(llm, prompts, tiny_reference)  # its last rounds in ssd
    assert torch.get_num_threads() == every_core


def test_threads_beside_workers_are_the_cores_the_workers_leave():
    config = EngineArgs(mode="ssd", draft_workers=2, draft_num_threads=2).to_config()
    assert config.threads_beside_workers(16) == 12
    assert dataclasses.replace(config, tensor_parallel_size=2).threads_beside_workers(16) == 6
    assert config.threads_beside_workers(2) == 1  # never none
    # Never more than the process had (OMP_NUM_THREADS, the caller's setting), whatever the cores.
    assert round_threads(config, None, 1) == {"ssd": 1, "sd": 1, "ar": 1}
    assert round_threads(dataclasses.replace(config, num_threads=3), None, 8) == {}


def test_pinned_draft_workers_take_the_highest_cores_and_leave_the_target_one():
    config = EngineArgs(mode="ssd", draft_workers=2, draft_num_threads=2, draft_worker_cpus="pinned").to_config()
    assert config.draft_cpu_sets(list(range(16))) == [(12, 13), (14, 15)]
    assert config.draft_cpu_sets([0, 2, 4, 6, 8]) == [(2, 4), (6, 8)]  # the cores this process may use
    with pytest.raises(ValueError, match="draft_worker_cpus='pinned'.*5 in all; this process may use 4"):
        config.draft_cpu_sets(list(range(4)))
    assert dataclasses.replace(config, draft_worker_cpus="shared").draft_cpu_sets(list(range(16))) == []
    split = dataclasses.replace(config, draft_tensor_parallel_size=2, draft_num_threads=1)
    assert split.draft_cpu_sets(list(range(8))) == [(4, 5), (6, 7)]  # a worker's ranks share its cores
