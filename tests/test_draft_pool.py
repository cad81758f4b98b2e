"""A pool of D draft workers sharing each round's branch grid (ssd/transport/pool_client.py), without Ray.

Greedy output with D = 2 equals Hugging Face `generate`, and both shards deliver hits; a worker
killed mid-generation leaves the output unchanged and is replaced; duplicated, stale and foreign
messages (injected on both sides of the channel) are refused and counted and cannot change the
output. The sampled exactness of D = 2 is in test_ssd_process_sampling.py.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
from refimpl import hf_greedy
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
from workers import live_draft_workers

from ssd.core.protocol import MsgType, ReleaseMsg
from ssd.model.demo_models import heldout_prompts


def test_two_workers_greedy_matches_hf_and_both_shards_hit(tiny_pair, prompts, tiny_reference):
    target, draft = tiny_pair
    with ssd_llm(target, draft, draft_workers=2, draft_split="outcomes", ssd_backup="neural", max_num_seqs=2) as llm:
        assert len(live_draft_workers()) == 2
        check_greedy(llm, prompts, tiny_reference)
        m = llm.metrics()
    ssd = m["ssd"]
    assert ssd["draft_workers"] == 2 and ssd["draft_workers_live"] == 2, ssd
    assert ssd["tree_branches"] == 2 * 12, ssd  # the fan-out covers both shards
    assert min(ssd["draft_shard_hits"]) > 0, ssd  # each worker held some of the hits
    assert ssd["draft_worker_failures"] == 0 and ssd["drafter_rejected_messages"] == 0, ssd
    assert m["backup_neural_rounds"] > 0, m


def test_two_workers_by_sequence_greedy_matches_hf(tiny_pair, prompts, tiny_reference):
    """draft_split="sequences": each worker drafts its own sequences with whole trees."""
    target, draft = tiny_pair
    with ssd_llm(target, draft, draft_workers=2, draft_split="sequences", ssd_backup="neural", max_num_seqs=2) as llm:
        check_greedy(llm, prompts, tiny_reference)
        m = llm.metrics()
    ssd = m["ssd"]
    assert ssd["tree_branches"] == 12 and min(ssd["draft_shard_hits"]) > 0, (
        ssd
    )  # whole trees of ssd_budget, both workers
    assert ssd["draft_predict_hints"] == 0 and ssd["draft_worker_failures"] == 0, ssd
    assert m["backup_neural_rounds"] > 0 and m["cache_hits"] > 0, m


def test_two_workers_demo_pair_greedy_matches_hf(demo_pair):
    prompts = heldout_prompts(2, prompt_bytes=96) + ["def add(a, b):\n    return"]
    expected = hf_greedy(demo_pair[0], prompts, 24)
    with ssd_llm(*demo_pair, draft_workers=2, ssd_budget=7, max_num_seqs=2) as llm:
        outs = llm.generate(prompts, greedy(24))
        m = llm.metrics()
    assert [o.token_ids for o in outs] == expected
    assert m["cache_hit_rate"] > 0.3 and min(m["ssd"]["draft_shard_hits"]) > 0, m


def test_one_of_two_workers_killed_mid_generation(tiny_pair, prompts, tiny_reference):
    target, draft = tiny_pair
    with ssd_llm(target, draft, draft_workers=2, ssd_backup="neural", max_num_seqs=2) as llm:
        engine = llm.engine
        for p in prompts[:2]:
            engine.add_request(p, greedy())
        engine.step()
        engine.step()  # a round in flight
        victim = worker_process(llm, shard=1)
        victim.kill()
        victim.wait(10)
        assert finish(engine) == sorted(tiny_reference[:2])
        assert metric(llm.metrics(), "draft_worker_failures") == 1
        generate_until_replaced(llm, prompts, tiny_reference)
        hits = list(metric(llm.metrics(), "draft_shard_hits"))
        check_greedy(llm, prompts, tiny_reference)
        m = llm.metrics()
        assert metric(m, "draft_workers_live") == 2
        assert m["ssd"]["draft_shard_hits"][1] > hits[1], m["ssd"]  # the replacement holds hits again
        assert worker_process(llm, shard=1).pid != victim.pid


def test_every_worker_killed_mid_generation_costs_no_deadline(tiny_pair, prompts, tiny_reference):
    """Over shm the target waits for a round's grid on its workers' boards: with every worker
    dead it stops waiting at once (it checks that one is alive to fork it), not at the deadline."""
    target, draft = tiny_pair
    with ssd_llm(target, draft, draft_workers=2, ssd_backup="neural", max_num_seqs=2, draft_deadline_s=60) as llm:
        engine = llm.engine
        for p in prompts[:2]:
            engine.add_request(p, greedy())
        engine.step()
        engine.step()  # a round in flight: its grid is on the boards, or about to be
        victims = [worker_process(llm, shard=w) for w in (0, 1)]
        for victim in victims:
            victim.kill()
        for victim in victims:
            victim.wait(10)
        started = time.monotonic()
        assert finish(engine) == sorted(tiny_reference[:2])
        assert time.monotonic() - started < 20, "a round waited for a grid no worker was left to fork"
        assert metric(llm.metrics(), "draft_worker_failures") == 2


# ---- messages that must not count ----------------------------------------------------------------


def duplicate_in_both_directions(llm) -> None:
    """A duplicating network on every link: each BEGIN_ROUND and RESOLVE the target sends goes
    out twice (the copy straight after), and each reply (REPLY, NEURAL_BACKUP_REPLY) the target receives
    comes in twice (the copy with the next receive)."""
    for shard in llm.engine.proposer.client.shards:
        channel = shard.link.channel
        send, recv = channel.send, channel.recv
        pending = []

        def send_twice(kind, msg=None, timeout=None, send=send):
            send(kind, msg, timeout)
            if kind in (MsgType.BEGIN_ROUND, MsgType.RESOLVE):
                send(kind, msg, timeout)

        def recv_twice(timeout=None, recv=recv, pending=pending):
            if pending:
                return pending.pop()
            got = recv(timeout)
            if got[0] in (MsgType.REPLY, MsgType.NEURAL_BACKUP_REPLY):
                pending.append(got)
            return got

        channel.send, channel.recv = send_twice, recv_twice


def test_duplicated_messages_are_refused_counted_and_change_nothing(tiny_pair, prompts, tiny_reference):
    target, draft = tiny_pair
    with ssd_llm(target, draft, draft_workers=2, ssd_backup="neural", max_num_seqs=2) as llm:
        duplicate_in_both_directions(llm)
        check_greedy(llm, prompts, tiny_reference)
        m = llm.metrics()
    ssd = m["ssd"]
    assert ssd["rejected_replies"] > 10, ssd  # the second copies of replies, dropped by the target
    assert ssd["drafter_rejected_messages"] > 10, ssd  # the target's second copies, dropped by the workers
    assert ssd["draft_worker_failures"] == 0 and m["cache_hits"] > 0, m


def test_a_foreign_frame_takes_the_link_down_and_the_output_stays_exact(tiny_pair, prompts, tiny_reference):
    """A frame with another configuration's fingerprint (another model, K or C) is never acted
    on: the worker refuses it and the pool replaces that worker."""
    target, draft = tiny_pair
    with ssd_llm(target, draft, draft_workers=2, ssd_backup="neural", max_num_seqs=2) as llm:
        first = llm.generate(prompts[:2], greedy())
        assert [o.token_ids for o in first] == tiny_reference[:2]
        channel = llm.engine.proposer.client.shards[0].link.channel
        fp, channel.fp = channel.fp, channel.fp ^ 1
        channel.send(MsgType.RELEASE, ReleaseMsg([10**6]))
        channel.fp = fp
        outs = llm.generate(prompts, greedy())
        assert [o.token_ids for o in outs] == tiny_reference
        assert metric(llm.metrics(), "draft_worker_failures") == 1
        generate_until_replaced(llm, prompts, tiny_reference)


def test_a_worker_out_of_sync_is_replaced(tiny_pair, prompts, tiny_reference):
    """A round whose committed lengths differ from the worker's (a lost message) is refused
    (OutOfSync) instead of answered from the wrong prefix."""
    target, draft = tiny_pair
    with ssd_llm(target, draft, draft_workers=2, ssd_backup="neural", max_num_seqs=2) as llm:
        link = llm.engine.proposer.client.shards[1].link
        begin = link.begin_round

        def skewed(msg, encoded=None, begin=begin):
            link.begin_round = begin  # once; the skewed copy is encoded anew, not as the pool encoded it
            begin(dataclasses.replace(msg, committed=[c + 1 for c in msg.committed]))

        llm.generate(prompts[:1], greedy(4))
        link.begin_round = skewed
        outs = llm.generate(prompts, greedy())
        assert [o.token_ids for o in outs] == tiny_reference
        assert metric(llm.metrics(), "draft_worker_failures") == 1


# ---- workers that listen: the torch and grpc transports ---------------------------------------------


@pytest.mark.parametrize("transport", ["torch", "grpc"])
@pytest.mark.parametrize("workers", [1, 2])
def test_listening_transports_greedy_matches_hf(tiny_pair, prompts, tiny_reference, transport, workers):
    """Workers started as plain processes that listen on a port they chose and print it (the
    shape of a worker on another host); the target connects over that transport."""
    target, draft = tiny_pair
    with ssd_llm(
        target, draft, draft_transport=transport, draft_workers=workers, ssd_backup="neural", max_num_seqs=2
    ) as llm:
        assert len(live_draft_workers()) == workers
        check_greedy(llm, prompts, tiny_reference)
        m = llm.metrics()
    assert m["cache_hits"] > 0 and min(m["ssd"]["draft_shard_hits"]) > 0, m
    assert m["ssd"]["draft_worker_failures"] == 0, m


def test_closing_while_a_replacement_starts_leaves_no_worker(tiny_pair, prompts):
    """Regression: a replacement still starting when the engine closed outlived it (close() did
    not wait for the refill, which discarded its worker only later)."""
    target, draft = tiny_pair
    with ssd_llm(target, draft, ssd_backup="neural") as llm:
        llm.generate(prompts[:1], greedy(4))
        victim = worker_process(llm)
        victim.kill()
        victim.wait(10)
        llm.generate(prompts[:1], greedy(4))  # the loss is noticed; a replacement starts in the background
        assert metric(llm.metrics(), "draft_worker_failures") == 1
        end = time.monotonic() + 60
        while not live_draft_workers():  # close while the replacement's process is up but not yet attached
            assert time.monotonic() < end, "no replacement process started"
            time.sleep(0.01)
        assert metric(llm.metrics(), "draft_worker_replacements") == 0
    assert live_draft_workers() == []
