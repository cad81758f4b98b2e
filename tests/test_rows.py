"""Merging a pool's answers (ssd/transport/rows.py): a reply that answers every row alone is taken
as it is, on the target's thread each round, and must equal what the general merge makes of it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ssd.core.protocol import DrafterCounters, ResolveMsg, SpeculationReply
from ssd.transport import rows
from ssd.transport.rows import merge_shards

B, K, V = 4, 5, 7


def _reply(seed: int, hit: list[bool], drafted: list[bool], probs: bool, rank: bool) -> SpeculationReply:
    g = torch.Generator().manual_seed(seed)
    num_draft = torch.tensor([int(torch.randint(1, K + 1, (1,), generator=g)) if d else 0 for d in drafted])
    tokens = torch.randint(1, 99, (B, K), generator=g) * (torch.arange(K) < num_draft.view(-1, 1))
    return SpeculationReply(
        3, [10, 11, 12, 13], torch.tensor(hit), tokens, torch.rand(B, K, V, generator=g) if probs else None,
        num_draft, 0.25, DrafterCounters(), torch.tensor(hit) | torch.tensor([False, True, False, False]),
        torch.randint(-1, 3, (B,), generator=g) if rank else None, torch.tensor([True, False, True, False]),
    )  # fmt: skip


def _fields(rep: SpeculationReply) -> dict:
    return {f.name: getattr(rep, f.name) for f in dataclasses.fields(rep)}


def _equal(a: SpeculationReply, b: SpeculationReply) -> None:
    for name, x in _fields(a).items():
        y = getattr(b, name)
        same = (
            (x is None and y is None) if x is None or y is None else torch.equal(x, y) if torch.is_tensor(x) else x == y
        )
        assert same, (name, x, y)


@pytest.mark.parametrize("probs", [False, True])
@pytest.mark.parametrize("rank", [False, True])
def test_one_reply_answering_every_row_merges_as_the_general_merge_does(monkeypatch, probs, rank):
    msg = ResolveMsg(3, [10, 11, 12, 13], torch.zeros(B, dtype=torch.long), torch.zeros(B, dtype=torch.long), False)
    counters = DrafterCounters(rounds=9)
    rep = _reply(1, [True, False, True, False], [True, True, True, True], probs, rank)
    fast = merge_shards(msg, [rep], counters)
    monkeypatch.setattr(rows, "_whole", None)  # the fast path would raise: the general merge runs
    no_answer = _reply(2, [False] * B, [False] * B, probs, rank)
    _equal(fast, merge_shards(msg, [rep, dataclasses.replace(no_answer, bonus_rank=None)], counters))
    assert fast.counters == counters and fast.greedy is None


def test_a_reply_missing_a_row_goes_through_the_general_merge(monkeypatch):
    msg = ResolveMsg(3, [10, 11, 12, 13], torch.zeros(B, dtype=torch.long), torch.zeros(B, dtype=torch.long), False)
    rep = _reply(1, [True, False, False, False], [True, True, False, True], False, True)
    monkeypatch.setattr(rows, "_whole", None)
    merged = merge_shards(msg, [rep], DrafterCounters())
    assert merged.num_draft[2] == 0 and not merged.tokens[2].any()
