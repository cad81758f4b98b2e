"""The target-drafter protocol survives interruptions between its steps."""

from __future__ import annotations

import pytest
from refimpl import hf_greedy
from workers import live_draft_workers

from ssd import LLM, SamplingParams

PROMPTS = ["def f(x):", "import os\n"]


@pytest.mark.parametrize("channel", ["shm", "gloo"])
def test_an_interrupt_between_outcome_and_reply_leaves_no_stale_reply(tiny_pair, monkeypatch, channel):
    """Regression: Ctrl-C during a stop-string check (after the outcome was sent, before its
    reply was read) left the reply in the channel; the next request read it as its own answer
    and the drafter was dropped as "out of protocol" for the engine's lifetime."""
    from ssd.engine.stopping import StopChecker

    expected = hf_greedy(tiny_pair[0], PROMPTS, 24)
    calls = {"n": 0}
    original = StopChecker.append

    def interrupted_append(self, seq, tokens):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt
        return original(self, seq, tokens)

    with LLM(
        *tiny_pair, mode="ssd", k=3, ssd_budget=6, ssd_autobudget=False, ssd_backup="neural", draft_transport=channel
    ) as llm:
        monkeypatch.setattr(StopChecker, "append", interrupted_append)
        with pytest.raises(KeyboardInterrupt):
            llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24))
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24))
        m = llm.metrics()
    assert [o.token_ids for o in outs] == expected
    assert m["ssd"]["draft_workers_live"] == 1 and m["ssd"]["draft_worker_failures"] == 0, m
    assert m["cache_hit_rate"] > 0.3, m
    assert live_draft_workers() == []


def test_a_worker_reads_its_peak_memory_after_its_first_reply_then_at_most_once_a_second(tiny_pair, monkeypatch):
    """The worker's peak memory (VmHWM, what its replies report) is read from /proc after a reply,
    off the target's wait but on the worker's way to its next build: at most once a second, not
    each round (a read costs ~0.1 ms, a round on the demo pair ~10 ms)."""
    from transformers import AutoModelForCausalLM

    from ssd.drafting.tree_drafter import TreeDrafter
    from ssd.model.runner import draft_runner
    from ssd.worker import session

    model = AutoModelForCausalLM.from_pretrained(tiny_pair[1], local_files_only=True).eval()
    worker = session.WorkerSession(TreeDrafter(draft_runner(model, "cpu", True), model.config.vocab_size, 3), None)
    clock, reads = [100.0], []
    monkeypatch.setattr(session.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(session, "peak_rss_bytes", lambda: reads.append(clock[0]) or 1000 + len(reads))
    for _ in range(50):  # 50 replies within 0.98 s
        worker._note_memory()
        clock[0] += 0.02
    assert reads == [100.0] and worker.drafter.counters.peak_rss_bytes == 1001
    clock[0] = 101.0
    worker._note_memory()
    assert reads == [100.0, 101.0] and worker.drafter.counters.peak_rss_bytes == 1002
