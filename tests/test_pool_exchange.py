"""A pool's round costs its target the same at any D (ssd/transport/pool_client.py): the round's
grid shard sends the branch grid once it has forked, the target names the shard that answers
each row and waits for those answers alone.

At D = 4: greedy output equals Hugging Face `generate` at batch 1 and 4, over shm and over gRPC;
at batch 1 the target awaits exactly one answer per round, in rounds that hit and in rounds that
missed (over shm a hit is often read off its worker's board, shm_board.py: no reply awaited);
losing the grid shard mid-generation, or a named shard that stops answering, costs hits for a
round (within the deadline) and never output. The sampled exactness of D = 4 is in
test_ssd_process_sampling.py.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from test_ssd import (  # noqa: F401 - prompts, tiny_reference, no_leaked_workers: the fixtures of test_ssd
    check_greedy,
    finish,
    generate_until_replaced,
    greedy,
    metric,
    no_leaked_workers,
    prompts,
    ssd_llm,
    tiny_reference,
    worker_process,
)


@pytest.mark.parametrize("transport", ["shm", "grpc"])
def test_four_workers_at_batch_1_the_target_awaits_one_reply_per_round(tiny_pair, prompts, tiny_reference, transport):
    target, draft = tiny_pair
    with ssd_llm(target, draft, draft_workers=4, draft_transport=transport, ssd_backup="neural", max_num_seqs=1) as llm:
        check_greedy(llm, prompts, tiny_reference)
        m = llm.metrics()
        if transport == "shm":  # each round and its outcome written once to the pool's feed, not once a worker
            client = llm.engine.proposer.client
            chunks, rounds = client.shards[0].link.feed.writer.seq, client.tally.rounds
            private = m["backup_neural_rounds"] + 10 * len(prompts) + 8  # backup requests, ADMIT/RELEASE, JOIN
            assert 2 * rounds <= chunks <= 2 * rounds + private, (chunks, rounds, private)
    ssd = m["ssd"]
    # One answer per round: a reply, or the hit read off its worker's board (shm only).
    assert ssd["replies_awaited"] + ssd["board_reads"] == pytest.approx(1.0, abs=1e-3), ssd
    assert (ssd["board_reads"] > 0) == (transport == "shm") and ssd["draft_grids_missed"] == 0, ssd
    assert m["cache_hits"] > 0 and m["backup_neural_rounds"] > 0, m  # rounds that hit, and rounds that missed
    assert sum(h > 0 for h in ssd["draft_shard_hits"]) >= 3, ssd  # the hits came from most shards
    assert ssd["draft_worker_failures"] == 0 and ssd["target_exchange_ms"] > 0, ssd


@pytest.mark.parametrize("transport", ["shm", "grpc"])
def test_four_workers_at_batch_4_greedy_matches_hf(tiny_pair, prompts, tiny_reference, transport):
    target, draft = tiny_pair
    with ssd_llm(target, draft, draft_workers=4, draft_transport=transport, ssd_backup="neural", max_num_seqs=4) as llm:
        check_greedy(llm, prompts, tiny_reference)
        m = llm.metrics()
    ssd = m["ssd"]
    # Rows whose hits sit in different shards each wait for their own (or are read off boards);
    # never every shard each round.
    assert ssd["replies_awaited"] < 4.0 and ssd["replies_awaited"] + ssd["board_reads"] >= 1.0, ssd
    assert ssd["draft_grids_missed"] == 0, ssd
    assert min(ssd["draft_shard_hits"]) > 0 and ssd["draft_worker_failures"] == 0, ssd


def test_the_grid_shard_killed_mid_generation_costs_no_output(tiny_pair, prompts, tiny_reference):
    target, draft = tiny_pair
    with ssd_llm(target, draft, draft_workers=4, ssd_backup="neural", max_num_seqs=2) as llm:
        engine = llm.engine
        for p in prompts[:2]:
            engine.add_request(p, greedy())
        engine.step()
        engine.step()  # a round in flight: shard 0 has sent, or is about to send, its grid
        victim = worker_process(llm, shard=0)
        victim.kill()
        victim.wait(10)
        assert finish(engine) == sorted(tiny_reference[:2])
        assert metric(llm.metrics(), "draft_worker_failures") == 1
        generate_until_replaced(llm, prompts, tiny_reference)
        check_greedy(llm, prompts, tiny_reference)
        assert metric(llm.metrics(), "draft_workers_live") == 4


def test_a_named_shard_that_stops_answering_costs_one_deadline(tiny_pair, prompts, tiny_reference):
    """A worker stopped (SIGSTOP: alive, silent) is waited for only while it is named for a row,
    and then no longer than the deadline; it is dropped and replaced, the output unchanged."""
    target, draft = tiny_pair
    deadline_s = 0.5
    with ssd_llm(
        target, draft, draft_workers=4, ssd_backup="neural", max_num_seqs=2, draft_deadline_s=deadline_s
    ) as llm:
        llm.generate(prompts[:1], greedy(8))
        victim = worker_process(llm, shard=2)
        os.kill(victim.pid, signal.SIGSTOP)
        try:
            started = time.perf_counter()
            outs = llm.generate(prompts, greedy())
            elapsed = time.perf_counter() - started
            assert [o.token_ids for o in outs] == tiny_reference
            assert metric(llm.metrics(), "draft_worker_failures") == 1
            assert victim.wait(10) is not None  # killed by its link, not left stopped
            # One deadline for the named shard (and at most one more for a send to its full mailbox).
            assert elapsed < 2 * deadline_s + 10.0, elapsed
        finally:
            if victim.poll() is None:
                os.kill(victim.pid, signal.SIGKILL)
                victim.wait(10)
        generate_until_replaced(llm, prompts, tiny_reference)
