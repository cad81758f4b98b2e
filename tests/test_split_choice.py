"""draft_split auto (ssd/engine/split_policy.py): the engine measures both ways a pool of draft
workers can share the work and runs each SSD round in the faster; a change of split (detach,
JOIN to every worker, rejoin) keeps the output exact and is counted on the wire.

A chooser that changes split every few rounds stands in for the measured one, so a short
generation crosses many switches (the measured choice itself is autopilot.ModeChooser's, tested
in test_auto_mode.py)."""

from __future__ import annotations

from test_ssd import (  # noqa: F401 - prompts, tiny_reference, no_leaked_workers: the fixtures of test_ssd
    check_greedy,
    no_leaked_workers,
    prompts,
    ssd_llm,
    tiny_reference,
)

from ssd.engine.autopilot import ModeChooser

SPLITS = ("outcomes", "sequences")


def restless(splits=SPLITS) -> ModeChooser:
    """A chooser that probes each split for two rounds every few rounds: many switches."""
    return ModeChooser(splits, explore_every=4, probe_rounds=2, first_period=2, steady=(), rebuilt=splits)


def test_switching_splits_keeps_greedy_exact_and_joins_every_worker_again(tiny_pair, prompts, tiny_reference):
    target, draft = tiny_pair
    with ssd_llm(target, draft, draft_workers=2, ssd_backup="neural", max_num_seqs=2) as llm:
        splitter = llm.engine.policy.splitter
        assert splitter is not None and llm.engine.config.draft_split == "auto"
        splitter.chooser = restless()
        joined = llm.metrics()["ssd"]["wire_bytes_sent"]["JOIN"]  # each of the 2 workers' JOIN at start
        check_greedy(llm, prompts, tiny_reference)
        m = llm.metrics()
    ssd, split = m["ssd"], m["draft_split"]
    assert split["switches"] >= 6 and all(split["splits"][s]["rounds"] > 0 for s in SPLITS), split
    assert ssd["draft_resplits"] >= 6 and ssd["draft_worker_failures"] == 0, ssd
    # Every worker is sent JOIN again at each resplit (JOIN frames all have one size).
    assert ssd["wire_bytes_sent"]["JOIN"] == joined * (1 + ssd["draft_resplits"]), ssd
    assert m["cache_hits"] > 0 and min(ssd["draft_shard_hits"]) > 0, m


def test_auto_mode_puts_the_split_in_place_as_it_enters_ssd(tiny_pair, prompts, tiny_reference):
    """Mode auto between ssd and sd, the split changing too: each entry into ssd rejoins once,
    in the split chosen for it."""
    target, draft = tiny_pair
    with ssd_llm(target, draft, mode="auto", draft_workers=2, ssd_backup="neural", max_num_seqs=2) as llm:
        policy = llm.engine.policy
        policy.chooser = ModeChooser(("ssd", "sd"), explore_every=6, probe_rounds=3, first_period=3)
        policy.splitter.chooser = restless()
        check_greedy(llm, prompts, tiny_reference)
        m = llm.metrics()
    assert m["auto"]["switches"] >= 4 and m["draft_split"]["switches"] >= 2, (m["auto"], m["draft_split"])
    assert all(m["draft_split"]["splits"][s]["rounds"] > 0 for s in SPLITS), m["draft_split"]
    assert m["ssd"]["draft_resplits"] >= 2 and m["ssd"]["draft_worker_failures"] == 0, m["ssd"]


def test_a_fixed_split_or_a_single_worker_has_no_choice(tiny_pair):
    target, draft = tiny_pair
    with ssd_llm(target, draft, draft_workers=2, draft_split="sequences", max_num_seqs=2) as llm:
        assert llm.engine.policy.splitter is None and "draft_split" not in llm.metrics()
    with ssd_llm(target, draft, draft_workers=1, max_num_seqs=2) as llm:
        assert llm.engine.policy.splitter is None
