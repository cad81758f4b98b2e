"""Sampling through the default served path is exact: mode auto (rounds in ssd, sd and ar, its
switches forced every few rounds) with Ray draft worker replicas over the torch data plane,
behind the OpenAI endpoint. Thousands of seeded samples of one prompt at
temperature 1 (requests of 50 choices each, batched continuously in the target replica) are
grouped by the context each token followed and tested by chi-square against the target's exact
next-token distribution (tests/ssd_stats.py, whose check is shown to fail on a drafter that
sends a wrong distribution in test_ssd_process_sampling.py)."""

from __future__ import annotations

import asyncio

import pytest

openai = pytest.importorskip("openai")

from ray import serve  # noqa: E402
from ssd_stats import STAT_K, STAT_MAX_TOKENS, STAT_PROMPT, check_conditionals, save_peaked_pair  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from ssd import SamplingParams  # noqa: E402

P_MIN = 1e-5
N = 2000
PER_REQUEST = 50


@pytest.fixture(scope="module")
def stat_app(served, tmp_path_factory):
    """A third application on the session's cluster: the peaked pair, mode auto switching every
    few rounds, its own draft worker."""
    from serve_app.app import build_app

    target, draft = save_peaked_pair(tmp_path_factory.mktemp("peaked_serve"))
    config = {
        "engine": {
            "target": target,
            "draft": draft,
            "mode": "auto",
            "auto_explore_every": 2,
            "auto_probe_rounds": 1,
            "k": STAT_K,
            "max_num_seqs": 256,
        },
        "extra_modes": [],
        "max_n": PER_REQUEST,
        "max_queue": N,
        "model_name": "peaked",
        "api_key": served.api_key,
    }
    serve.run(build_app(config), name="stat", route_prefix="/stat")
    yield target
    serve.delete("stat")


def test_served_auto_samples_follow_the_target_distribution(served, stat_app):
    client = openai.AsyncOpenAI(base_url=served.http + "/stat/v1", api_key=served.api_key, max_retries=0, timeout=600)

    async def sample():
        calls = [
            client.completions.create(
                model="peaked",
                prompt=STAT_PROMPT,
                max_tokens=STAT_MAX_TOKENS,
                temperature=1.0,
                n=PER_REQUEST,
                seed=1000 + PER_REQUEST * i,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
            for i in range(N // PER_REQUEST)
        ]
        return await asyncio.gather(*calls)

    responses = asyncio.run(sample())
    samples = [[(t, "served", 2) for t in c.model_extra["token_ids"]] for r in responses for c in r.choices]
    assert len(samples) == N and all(len(s) == STAT_MAX_TOKENS for s in samples)
    hits = sum(s.get("cache_hits", 0) for r in responses for s in r.model_extra["speculation"])
    assert hits > 0  # the speculation cache served rounds
    for mode in ("ssd", "sd", "ar"):  # and every mode served some
        assert sum(s["rounds_by_mode"].get(mode, 0) for r in responses for s in r.model_extra["speculation"]) > 50
    prompt_ids = AutoTokenizer.from_pretrained(stat_app).encode(STAT_PROMPT, add_special_tokens=False)
    target = AutoModelForCausalLM.from_pretrained(stat_app).eval()
    p, tested, df = check_conditionals(target, prompt_ids, samples, SamplingParams(temperature=1.0))["all"]
    assert tested > N * STAT_MAX_TOKENS // 2 and df > 10
    assert p > P_MIN, (p, tested, df)
