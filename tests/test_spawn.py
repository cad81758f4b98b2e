"""Draft worker processes started before their spec is known (ssd/transport/spawn.py): the
process a starter prestarted is the one acquire() takes, paired (shm) or listening (grpc); one
nobody took is killed when the starter closes; one that died while it waited is reported with its
exit code; a worker told to shut down exits with code 0 (it skips the interpreter's
finalization, and must not skip its exit code with it)."""

from __future__ import annotations

import os
import signal

import pytest
from workers import live_draft_workers

from ssd import LLM, SamplingParams
from ssd.core.config import EngineArgs
from ssd.core.protocol import DrafterUnavailable
from ssd.engine.proposers import WORKER_MODULE, worker_starter
from ssd.transport.spawn import SpawnedWorkers, WorkerStarter


def config(pair, **kw):
    return EngineArgs(target=pair[0], draft=pair[1], **{"mode": "ssd", "k": 3, **kw}).to_config()


@pytest.mark.parametrize("transport", ["shm", "grpc"])  # paired, and listening (gloo pairs as shm does)
def test_the_prestarted_process_is_the_one_acquired(tiny_pair, transport):
    cfg = config(tiny_pair, draft_transport=transport, draft_launcher="process")
    starter = WorkerStarter(cfg, WORKER_MODULE).prestart(1)
    (waiting,) = [started.process.pid for started in starter._waiting]
    provider = SpawnedWorkers(cfg, 512, WORKER_MODULE, starter)
    try:
        link = provider.acquire()
        assert link.process.pid == waiting and link.is_alive()
        provider.discard(link, failed=False)
        if transport != "grpc":  # a listening worker serves target after target: it is stopped, not shut down
            assert link.process.returncode == 0  # SHUTDOWN: a clean exit, its code kept
        if transport == "shm":
            second = provider.acquire()  # none left waiting: started now
            assert second.process.pid != waiting
            provider.discard(second, failed=False)
    finally:
        provider.close()
    assert live_draft_workers() == []


def test_a_prestarted_process_nobody_takes_is_killed_on_close(tiny_pair):
    starter = WorkerStarter(config(tiny_pair), WORKER_MODULE).prestart(2)
    processes = [started.process for started in starter._waiting]
    assert len(processes) == 2
    starter.close()
    assert starter._waiting == [] and all(p.poll() is not None for p in processes)


def test_a_prestarted_process_that_died_while_waiting_is_reported(tiny_pair):
    cfg = config(tiny_pair)
    starter = WorkerStarter(cfg, WORKER_MODULE).prestart(1)
    process = starter._waiting[0].process
    os.kill(process.pid, signal.SIGKILL)
    process.wait(10)
    provider = SpawnedWorkers(cfg, 512, WORKER_MODULE, starter)
    try:
        with pytest.raises(DrafterUnavailable, match="exited with code -9 before it got its spec"):
            provider.acquire()
    finally:
        provider.close()


def test_an_engine_prestarts_only_the_workers_it_will_spawn(tiny_pair):
    assert worker_starter(config(tiny_pair, mode="sd"), None) is None
    assert worker_starter(config(tiny_pair, draft_transport="inprocess"), None) is None
    leased = lambda cfg, vocab: None  # noqa: E731 - a provider of another kind
    assert worker_starter(config(tiny_pair, draft_transport="grpc"), leased) is None
    starter = worker_starter(config(tiny_pair, draft_workers=2), None)
    try:
        assert len(starter._waiting) == 2
    finally:
        starter.close()


def test_an_llm_whose_engine_fails_leaves_no_prestarted_process(tiny_pair):
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(*tiny_pair, mode="ssd", k=3, max_model_len=10**9)
    assert live_draft_workers() == []
    with LLM(*tiny_pair, mode="ssd", k=3) as llm:  # and one that works uses them
        out = llm.generate("def f(x):", SamplingParams(temperature=0.0, max_tokens=8))[0]
        assert len(out.token_ids) == 8 and llm.metrics()["ssd"]["draft_workers_live"] == 1
    assert live_draft_workers() == []


def test_an_engine_over_the_torch_transport_closes_without_a_c10d_warning(tiny_pair, capfd):
    """The worker it spawned is stopped and gone before the channel closes, so the close does not
    call the worker's store (it printed a c10d warning with a C++ stack at every close)."""
    with LLM(tiny_pair[0], tiny_pair[1], mode="ssd", k=3, draft_transport="torch") as llm:
        assert llm.generate(["ab"], SamplingParams(temperature=0, max_tokens=4))[0].token_ids
        capfd.readouterr()
    assert "TCPStore" not in capfd.readouterr().err
    assert live_draft_workers() == []
