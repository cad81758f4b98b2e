"""The graphed forward's padded buckets (ssd/model/cuda_graphs.py), checked on CPU.

A CUDA graph replays fixed shapes: rows padded to a power of two, the attention width padded to
one, write columns and the default mask read from device buffers. CudaGraphs(capture=False)
runs exactly that padded forward eagerly, on any device, so these tests check the padding,
the columns and the in-graph mask here; tests/test_cuda.py checks the captured graphs on a GPU.
"""

from __future__ import annotations

import pytest
import torch
from refimpl import hf_greedy
from test_ssd import MAX_TOKENS, check_greedy, greedy

from ssd import LLM
from ssd.model.cuda_graphs import WIDTH_FLOOR, CudaGraphs, padded


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    return ["def add(a, b):\n    return", "x", "import os\n", "class Stack:\n    def push(self, item):", "y = 1"]


@pytest.fixture(scope="module")
def reference(tiny_pair, prompts) -> list[list[int]]:
    return hf_greedy(tiny_pair[0], prompts, MAX_TOKENS)


def bucketed(runner) -> CudaGraphs:
    """Give a runner the padded buckets, run eagerly (what a graph replays)."""
    runner.graphs = CudaGraphs(runner.lean, runner.device, runner.attention_dtype, capture=False)
    return runner.graphs


def test_buckets_are_powers_of_two():
    assert [padded(b) for b in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]
    assert padded(7, WIDTH_FLOOR) == WIDTH_FLOOR and padded(300, WIDTH_FLOOR) == 512


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_padded_buckets_give_hf_greedy_output(tiny_pair, prompts, reference, mode):
    """Three rows padded to four, admissions into the padded rows mid-flight, trees (scratch
    forwards with given masks) in ssd: greedy output equals Hugging Face's."""
    extra = {"draft_transport": "inprocess", "ssd_autobudget": False} if mode == "ssd" else {}
    with LLM(*tiny_pair, mode=mode, k=4, max_num_seqs=3, **extra) as llm:
        stats = [bucketed(llm.engine.target).stats]
        if mode == "sd":
            stats.append(bucketed(llm.engine.proposers["sd"].runner).stats)
        if mode == "ssd":
            stats.append(bucketed(llm.engine.proposers["ssd"].client.runner).stats)
        check_greedy(llm, prompts, reference)
    for s in stats:
        assert s.replays > 0 and s.captures > 0, s
    # Prefills stay eager (at most one per admission, the lone prompt's included); every decoding or
    # verification forward is a bucket's.
    assert stats[0].eager_forwards <= len(prompts) + 1, stats[0]


def test_graph_metrics_reach_the_engine_metrics(tiny_pair):
    with LLM(*tiny_pair, mode="sd", k=3, max_num_seqs=2) as llm:
        assert "cuda_graphs" not in llm.engine.engine_metrics()  # CPU: eager, nothing to report
        bucketed(llm.engine.target)
        llm.generate(["x", "def f():"], greedy(8))
        graphs = llm.engine.engine_metrics()["cuda_graphs"]
    assert set(graphs) == {"target"} and graphs["target"]["replays"] > 0, graphs


def test_a_grown_cache_drops_the_graphs_captured_on_its_buffers(tiny_pair):
    """The buffers move when the cache grows: a graph recorded on the old ones would write into
    freed memory, so growth forgets them and the next forward captures anew. (A cache takes
    max_model_len columns at its first forward unless kv_cache_gib is smaller: here it is, so that
    the cache starts at 256 columns and grows.)"""
    with LLM(*tiny_pair, mode="ar", max_num_seqs=1, kv_cache_gib=1e-6) as llm:
        stats = bucketed(llm.engine.target).stats
        out = llm.generate("x", greedy(WIDTH_FLOOR + 40))[0]  # crosses the first width bucket
        cache = llm.engine.cache
    assert len(out.token_ids) == WIDTH_FLOOR + 40
    assert stats.captures >= 2 and cache.capacity[1] >= 2 * WIDTH_FLOOR
    assert all(key[2] >= 2 * WIDTH_FLOOR for key in cache.captured()), list(cache.captured())


def test_enforce_eager_reaches_every_runner_and_cpu_builds_no_graphs(tiny_pair, monkeypatch):
    """On CPU no runner has graphs whatever enforce_eager says, so the flag's path is checked
    where it is decided: the runners are built with it, and a CUDA runner built eager has none
    (building one touches no CUDA, so this runs here)."""
    from ssd.drafting import build
    from ssd.engine import llm_engine
    from ssd.model.runner import ModelRunner

    seen = []

    def spy(real):  # the engine passes enforce_eager as the last positional argument
        def build(*args):
            seen.append(args[-1])
            return real(*args)

        return build

    monkeypatch.setattr(llm_engine, "target_runner", spy(llm_engine.target_runner))
    monkeypatch.setattr(build, "draft_runner", spy(build.draft_runner))
    with LLM(*tiny_pair, mode="sd", enforce_eager=True) as llm:
        assert llm.engine.target.graphs is None and llm.engine.proposers["sd"].runner.graphs is None
        model = llm.engine.target.model
    assert seen == [True, True], seen  # the target's runner, then the SD draft's
    assert ModelRunner(model, torch.device("cuda"), eager=True).graphs is None
    with LLM(*tiny_pair, mode="ar") as llm:
        assert llm.engine.target.graphs is None  # on CPU the eager forward is the fast one
