"""What a long-running server allocates, it allocates at its first forward, not at the first burst
or the first long sequence: the soak (python -m loadtest.soak) saw a target replica's memory step
up minutes in, when a batch first grew past every earlier one (the SD draft's cache doubled its
rows) and, once that was fixed, when a sequence first grew past 256 tokens (a draft cache doubled
its columns: +16 MiB in one anonymous mapping of the replica, read from /proc/PID/smaps)."""

from __future__ import annotations

import pytest

from ssd import LLM, SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
MAX_MODEL_LEN = 400  # past the caches' first growth step (256 columns)


def caches(llm: LLM) -> dict:
    """name -> the storage of each cache the engine's thread or its in-process drafter owns."""
    engine = llm.engine
    found = {"target": engine.cache._storage}
    for mode, proposer in engine.proposers.items():
        drafter = getattr(proposer, "client", proposer)  # SSD in process: its TreeDrafter
        cache = getattr(drafter, "cache", None)
        if cache is not None:
            found[mode] = cache._storage
    return found


def placed(storages: dict) -> dict:
    """name -> where its buffers are and their size: equal before and after = nothing moved."""
    return {name: (s.layers[0][0].data_ptr(), s.rows, s.columns) for name, s in storages.items()}


def test_the_sd_drafts_cache_holds_the_largest_batch_from_its_first_forward(tiny_pair):
    with LLM(*tiny_pair, mode="sd", max_num_seqs=4) as llm:
        storage = llm.engine.proposers["sd"].cache._storage
        llm.generate(["def f(x):"], PARAMS)
        first = storage.layers[0][0].data_ptr(), storage.rows
        llm.generate(["def f(x):", "def g(y):", "class A:", "import os"], PARAMS)  # the largest batch
        assert (storage.layers[0][0].data_ptr(), storage.rows) == first
    assert first[1] == 4


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_every_cache_holds_the_longest_sequence_from_its_first_forward(tiny_pair, mode):
    """The target's and the drafts' caches (SD's, and SSD's tree drafter with its scratch columns)
    take max_model_len columns at their first forward: the longest sequence moves nothing."""
    extra = {"draft_transport": "inprocess", "ssd_autobudget": False} if mode == "ssd" else {}
    with LLM(*tiny_pair, mode=mode, max_num_seqs=2, max_model_len=MAX_MODEL_LEN, **extra) as llm:
        llm.generate(["def f(x):"], PARAMS)
        first = placed(caches(llm))
        assert set(first) == {"target", mode}
        longest = SamplingParams(temperature=0, max_tokens=MAX_MODEL_LEN - 16, ignore_eos=True)
        llm.generate(["def f(x):", "class A:"], longest)
        assert placed(caches(llm)) == first
    assert all(columns >= MAX_MODEL_LEN for _, _, columns in first.values()), first


def test_a_cache_past_kv_cache_gib_starts_with_the_columns_that_fit_and_grows_later(tiny_pair):
    """kv_cache_gib bounds what a cache takes at its first forward (max_num_seqs 4096 of a model's
    whole context would be gigabytes): then as many columns as fit, at least 256, and a longer
    sequence grows it."""
    from ssd.model.kv_cache import COLUMN_MULTIPLE, start_columns

    assert start_columns(16, 2048, 30720, 2**30) == 2048  # the demo target's: 960 MiB fits
    assert start_columns(4096, 2048, 1024, 2**30) == 256  # 4096 rows of a tiny model: 4 MiB a column
    assert start_columns(4096, 2048, 1024, 1) == COLUMN_MULTIPLE  # never fewer
    with LLM(*tiny_pair, mode="sd", max_num_seqs=2, max_model_len=MAX_MODEL_LEN, kv_cache_gib=1e-6) as llm:
        llm.generate(["def f(x):"], PARAMS)
        first = placed(caches(llm))
        assert all(columns == COLUMN_MULTIPLE for _, _, columns in first.values()), first
        longest = SamplingParams(temperature=0, max_tokens=MAX_MODEL_LEN - 16, ignore_eos=True)
        llm.generate(["def f(x):"], longest)
        assert all(columns > COLUMN_MULTIPLE for _, _, columns in placed(caches(llm)).values())
