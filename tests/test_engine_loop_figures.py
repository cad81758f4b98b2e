"""EngineLoop's figures (serve_app/engine_loop.py): only the loop thread builds them while it runs
(a caller asks and is handed them at the next round boundary), they are exact once the loop is
idle, and after the loop thread has ended the caller builds them itself."""

from __future__ import annotations

import asyncio
import threading

import pytest

from serve_app.engine_loop import EngineLoop
from serve_app.types import GenerateRequest
from ssd import EngineArgs, SamplingParams
from ssd.engine.factory import build_engines

PROMPT = "def add(a, b):\n    return"


@pytest.fixture
def loop(tiny_pair):
    engines = build_engines(
        EngineArgs(target=tiny_pair[0], draft=tiny_pair[1], mode="sd", k=4, max_num_seqs=2), ("sd", "ar")
    )
    loop = EngineLoop(engines, capacity=3)
    yield loop
    loop.close()


def builders(loop: EngineLoop) -> list[str]:
    """Record the thread of every engine_metrics() call from now on."""
    threads: list[str] = []
    for engine in loop.engines.values():
        read = engine.engine_metrics

        def recorded(read=read):
            threads.append(threading.current_thread().name)
            return read()

        engine.engine_metrics = recorded
    return threads


def test_figures_are_built_on_the_loop_thread_and_exact_when_idle(loop):
    threads = builders(loop)

    async def run():
        request = GenerateRequest("r0", PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), None)
        chunks = loop.generate(request)
        first = await anext(chunks)
        during = await loop.read_figures()  # while the request runs
        tokens = len(first.delta_token_ids) + sum([len(c.delta_token_ids) async for c in chunks])
        return during, tokens, await loop.read_figures()

    during, tokens, after = asyncio.run(run())
    assert tokens == 24
    assert during.running["sd"] + during.waiting["sd"] == 1
    assert after.running == {"sd": 0, "ar": 0} and after.waiting == {"sd": 0, "ar": 0}
    assert after.metrics["sd"]["generated_tokens"] == 24 and after.metrics["ar"]["generated_tokens"] == 0
    assert after.rounds == loop.rounds and loop.figures is after
    assert set(threads) == {"ssd-engine-loop"}
    stats = loop.stats(after)
    assert stats["requests"] == 0 and stats["healthy"] and stats["sd"] == {"running": 0, "waiting": 0}


def test_after_the_loop_thread_ends_the_caller_builds_the_figures(loop):
    loop.close()
    threads = builders(loop)
    figures = asyncio.run(loop.read_figures())
    assert set(figures.metrics) == {"sd", "ar"}
    assert threads == [threading.current_thread().name] * 2
