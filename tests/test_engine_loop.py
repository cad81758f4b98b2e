"""EngineLoop (serve_app/engine_loop.py) without Ray: continuous batching for async callers over
real engines on the tiny pair. Requests of two modes at once equal Hugging Face `generate`; the
bound refuses exactly one past capacity; a caller that leaves aborts its row; a round that raises
fails that engine's requests with a 500 and marks the loop unhealthy, after which new requests get
503."""

from __future__ import annotations

import asyncio

import pytest
from refimpl import hf_greedy

from serve_app.engine_loop import EngineLoop
from serve_app.errors import APIError
from serve_app.types import GenerateRequest
from ssd import EngineArgs, SamplingParams
from ssd.engine.factory import build_engines

PROMPTS = ["def add(a, b):\n    return", "import os\n"]
MAX_TOKENS = 16


@pytest.fixture
def loop(tiny_pair):
    engines = build_engines(
        EngineArgs(target=tiny_pair[0], draft=tiny_pair[1], mode="sd", k=4, max_num_seqs=2), ("sd", "ar")
    )
    loop = EngineLoop(engines, capacity=3, overload_status=429, retry_after_s=3)
    yield loop
    loop.close()


def req(i: int, prompt: str, mode: str | None = None, max_tokens: int = MAX_TOKENS, **kw) -> GenerateRequest:
    return GenerateRequest(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=max_tokens, **kw), mode)


async def collect(loop: EngineLoop, request: GenerateRequest) -> list[int]:
    return [t async for chunk in loop.generate(request) for t in chunk.delta_token_ids]


def test_two_modes_batched_equal_hf(loop, tiny_pair):
    expected = hf_greedy(tiny_pair[0], PROMPTS, MAX_TOKENS)

    async def run():
        calls = [collect(loop, req(i, PROMPTS[i % 2], mode)) for i, mode in enumerate(["sd", "ar", None])]
        return await asyncio.gather(*calls)

    outs = asyncio.run(run())
    assert outs == [expected[0], expected[1], expected[0]]
    assert loop.num_requests == 0 and loop.healthy()


def test_the_bound_is_exact_and_a_caller_that_leaves_aborts(loop):
    async def run():
        gens = [loop.generate(req(i, PROMPTS[0], max_tokens=300, ignore_eos=True)) for i in range(3)]
        # Each generator registers its request when first iterated: two run, one waits.
        pending = [asyncio.create_task(anext(g)) for g in gens]
        while loop.num_requests < 3:
            await asyncio.sleep(0.01)
        with pytest.raises(APIError) as info:
            await anext(loop.generate(req(9, PROMPTS[0])))
        assert info.value.status == 429 and info.value.retry_after_s == 3
        for task in pending:  # the callers leave
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for g in gens:
            await g.aclose()
        for _ in range(200):
            if not any(e.has_unfinished() for e in loop.engines.values()):
                break
            await asyncio.sleep(0.01)
        return loop.engines["sd"].metrics.generated_tokens

    generated = asyncio.run(run())
    assert not any(e.has_unfinished() for e in loop.engines.values())
    assert generated < 3 * 300 and loop.num_requests == 0


def test_a_failing_round_fails_its_requests_and_the_loop(loop):
    def broken():
        raise RuntimeError("forward failed")

    loop.engines["sd"].step = broken

    async def run():
        with pytest.raises(APIError) as failed:
            await collect(loop, req(0, PROMPTS[0], "sd"))
        assert failed.value.status == 500 and "forward" not in failed.value.message
        assert not loop.healthy()
        with pytest.raises(APIError) as refused:
            await collect(loop, req(1, PROMPTS[0], "ar"))
        assert refused.value.status == 503

    asyncio.run(run())


def test_a_prefill_that_raises_fails_its_request_instead_of_hanging(loop):
    """Admission takes a row out of the engine's waiting list before its prefill runs: a prefill
    that raises (a real target forward, here a poisoned one) left that request waiting forever
    when only running and waiting rows were failed."""
    target = loop.engines["ar"].target
    forward = target.forward

    def poisoned(cache, tokens, *args, **kwargs):
        if bool((tokens == 7).any()):
            raise RuntimeError("forward failed")
        return forward(cache, tokens, *args, **kwargs)

    target.forward = poisoned

    async def run():
        with pytest.raises(APIError) as failed:
            await asyncio.wait_for(
                collect(loop, GenerateRequest("p", [1, 7, 2], SamplingParams(temperature=0, max_tokens=4), "ar")), 30
            )
        assert failed.value.status == 500 and not loop.healthy() and loop.num_requests == 0

    asyncio.run(run())


def test_requests_the_engine_refuses_name_the_param(loop):
    async def run(request):
        with pytest.raises(APIError) as info:
            await collect(loop, request)
        return info.value

    too_long = asyncio.run(run(req(0, PROMPTS[0], max_tokens=10**6)))
    assert too_long.status == 400 and too_long.param == "max_tokens" and too_long.code == "context_length_exceeded"
    assert asyncio.run(run(req(1, [10**7]))).param == "prompt"
    assert asyncio.run(run(req(2, PROMPTS[0], mode="ssd"))).param == "speculation.mode"  # not served here
    negative_k = GenerateRequest("r3", PROMPTS[0], SamplingParams(temperature=0, max_tokens=4), "sd", -1)
    assert asyncio.run(run(negative_k)).param == "speculation.k"  # the engine's own k check


def test_a_split_target_that_lost_a_rank_while_idle_is_unhealthy(tiny_pair):
    """Serve's health check (TargetDeployment.check_health) sees a dead rank before any request
    meets it, so the replica is replaced first."""
    import os
    import signal

    engines = build_engines(EngineArgs(target=tiny_pair[0], mode="ar", tensor_parallel_size=2), ("ar",))
    loop = EngineLoop(engines, capacity=2)
    try:
        assert loop.healthy()
        rank = engines["ar"].target.ranks.processes[1]
        os.kill(rank.pid, signal.SIGKILL)
        rank.wait(10)
        assert not loop.healthy() and "rank 1 exited" in loop.failure
    finally:
        loop.close()
