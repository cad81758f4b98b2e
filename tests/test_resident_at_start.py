"""What a long-running server allocates, it allocates at its first forward, not at the first burst:
the soak (python -m loadtest.soak) saw a target replica's memory step up minutes in, when a batch
first grew past every earlier one and the SD draft's cache doubled its rows."""

from __future__ import annotations

from ssd import LLM, SamplingParams


def test_the_sd_drafts_cache_holds_the_largest_batch_from_its_first_forward(tiny_pair):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(*tiny_pair, mode="sd", max_num_seqs=4) as llm:
        storage = llm.engine.proposers["sd"].cache._storage
        llm.generate(["def f(x):"], params)
        first = storage.layers[0][0].data_ptr(), storage.rows
        llm.generate(["def f(x):", "def g(y):", "class A:", "import os"], params)  # the largest batch
        assert (storage.layers[0][0].data_ptr(), storage.rows) == first
    assert first[1] == 4
