"""Greedy ar and sd produce exactly Hugging Face `generate(do_sample=False)` on the target."""

from __future__ import annotations

import pytest
from refimpl import hf_greedy

from ssd import LLM, SamplingParams
from ssd.model.demo_models import heldout_prompts

MAX_TOKENS = 48


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    return heldout_prompts(4, prompt_bytes=96) + ["x", "def add(a, b):\n    return"]


@pytest.fixture(scope="module", params=["tiny", "demo"])
def pair_and_reference(request, prompts):
    pair = request.getfixturevalue("tiny_pair" if request.param == "tiny" else "demo_pair")
    return pair, hf_greedy(pair[0], prompts, MAX_TOKENS)


@pytest.mark.parametrize("mode,k", [("ar", 1), ("sd", 1), ("sd", 4), ("sd", 7)])
def test_greedy_matches_hf_generate_batched_and_alone(pair_and_reference, prompts, mode, k):
    (target, draft), expected = pair_and_reference
    llm = LLM(target, draft, mode=mode, k=k, max_num_seqs=8)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    batched = llm.generate(prompts, params)
    assert [o.token_ids for o in batched] == expected
    alone = llm.generate(prompts[0], params)[0]
    assert alone.token_ids == expected[0]
    if mode == "sd":
        # Both accept and reject paths must have been exercised for this check to mean much.
        m = llm.metrics()
        assert 0 < m["accepted_tokens"] < m["draft_tokens"]


def test_continuous_batching_matches_when_requests_join_midway(tiny_pair, prompts):
    """A batch smaller than the request count forces admissions while others are running."""
    target, draft = tiny_pair
    expected = hf_greedy(target, prompts, MAX_TOKENS)
    llm = LLM(target, draft, mode="sd", k=3, max_num_seqs=2)
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS - 8 * (i % 3)) for i in range(len(prompts))]
    outs = llm.generate(prompts, params)
    for out, exp, p in zip(outs, expected, params):
        assert out.token_ids == exp[: p.max_tokens]
