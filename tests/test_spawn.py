"""Draft worker processes forked from the fork server (ssd/transport/spawn.py): the worker acquire()
forks is ready, paired (shm) or listening (grpc), and exits with code 0 when told to shut down
(it skips the interpreter's finalization, and must not skip its exit code with it); one that
fails to load its draft is reported with its error and leaves nothing running; an engine starts
the fork server only where it will fork."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from workers import live_draft_workers

from ssd import LLM, SamplingParams
from ssd.core.config import EngineArgs, available_cpus
from ssd.core.forked import ForkedProcess
from ssd.core.protocol import DrafterUnavailable
from ssd.engine.proposers import resolve_provider, warm_fork_server


def config(pair, **kw):
    return EngineArgs(target=pair[0], draft=pair[1], **{"mode": "ssd", "k": 3, **kw}).to_config()


@pytest.mark.parametrize("transport", ["shm", "grpc"])  # paired, and listening (gloo pairs as shm does)
def test_an_acquired_worker_is_forked_ready_and_exits_cleanly(tiny_pair, transport):
    cfg = config(tiny_pair, draft_transport=transport, draft_launcher="process")
    provider = resolve_provider(cfg, None)(cfg, 512)
    try:
        link = provider.acquire()
        assert isinstance(link.process, ForkedProcess) and link.is_alive()
        assert live_draft_workers() == [link.process.pid]
        provider.discard(link, failed=False)
        if transport != "grpc":  # a listening worker serves target after target: it is stopped, not shut down
            assert link.process.returncode == 0  # SHUTDOWN: a clean exit, its code kept
    finally:
        provider.close()
    assert live_draft_workers() == []


@pytest.mark.skipif(available_cpus() < 2, reason="pinning needs a core left for the target")
def test_pinned_workers_run_on_cores_of_their_own_and_a_replacement_takes_the_dead_ones(tiny_pair):
    """draft_worker_cpus pinned: the workers (two where the cores allow, else one) run on the
    highest cores this process may use, one each; a worker started after one died gets the dead
    one's core. shared (the default): the worker may run wherever this process may."""
    mine = os.sched_getaffinity(0)
    workers = min(2, len(mine) - 1)
    cores = [{c} for c in sorted(mine)[-workers:]]
    cfg = config(tiny_pair, draft_launcher="process", draft_workers=workers, draft_worker_cpus="pinned")
    provider = resolve_provider(cfg, None)(cfg, 512)
    try:
        links = [provider.acquire() for _ in range(workers)]
        assert [os.sched_getaffinity(link.process.pid) for link in links] == cores
        links[0].kill()
        links[0] = provider.acquire()
        assert os.sched_getaffinity(links[0].process.pid) == cores[0]
        for link in links:
            provider.discard(link, failed=False)
    finally:
        provider.close()
    shared = config(tiny_pair, draft_launcher="process")
    provider = resolve_provider(shared, None)(shared, 512)
    try:
        link = provider.acquire()
        assert os.sched_getaffinity(link.process.pid) == mine
        provider.discard(link, failed=False)
    finally:
        provider.close()
    assert live_draft_workers() == []


def test_pinning_more_workers_than_the_cores_allow_is_refused_when_the_engine_starts(tiny_pair):
    with pytest.raises(ValueError, match="draft_worker_cpus='pinned'.*set draft_worker_cpus to 'shared'"):
        LLM(*tiny_pair, mode="ssd", k=3, draft_num_threads=available_cpus(), draft_worker_cpus="pinned")
    assert live_draft_workers() == []


def test_a_worker_whose_draft_fails_to_load_is_reported_and_gone(tiny_pair, tmp_path):
    broken = tmp_path / "draft"
    broken.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (broken / name).write_text((Path(tiny_pair[1]) / name).read_text())
    (broken / "model.safetensors").write_bytes(b"not a checkpoint")
    cfg = config((tiny_pair[0], str(broken)))
    provider = resolve_provider(cfg, None)(cfg, 512)
    with pytest.raises(DrafterUnavailable, match="failed to start"):
        provider.acquire()
    assert live_draft_workers() == []


def test_an_engine_starts_the_fork_server_only_where_it_forks(tiny_pair):
    assert not warm_fork_server(config(tiny_pair, mode="sd"), None)
    assert not warm_fork_server(config(tiny_pair, draft_transport="inprocess"), None)
    leased = lambda cfg, vocab: None  # noqa: E731 - a provider of another kind
    assert not warm_fork_server(config(tiny_pair, draft_transport="grpc"), leased)
    assert warm_fork_server(config(tiny_pair, draft_workers=2), None)
    assert warm_fork_server(config(tiny_pair, mode="ar", tensor_parallel_size=2), None)


def test_an_llm_whose_engine_fails_leaves_no_worker(tiny_pair):
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
