"""How a pool's messages are split among its workers and their replies made one again.

draft_split="outcomes": every worker gets the whole batch and builds its shard of each row's
tree; `merge_shards` takes each row's speculation from the worker whose shard held the hit, else
from the backup's just-in-time draft. draft_split="sequences": each worker gets its own rows
(`take`), and `assemble` puts their replies back in the batch's order.

Rows are selected by position in the message's seq_ids (b rows -> the rows listed, in order);
a reply made from parts has the full batch's rows in the message's order, zeros (no
speculation, no hit) where no part answered.
"""

from __future__ import annotations

import dataclasses

import torch

from ssd.core.protocol import (
    AdmitMsg,
    BeginRoundMsg,
    DrafterCounters,
    NeuralBackupMsg,
    ReleaseMsg,
    ResolveMsg,
    SpeculationReply,
)


def take(msg, rows: list[int]):
    """The message restricted to `rows` (positions in msg.seq_ids)."""
    index = torch.tensor(rows, dtype=torch.long)
    ids = [msg.seq_ids[r] for r in rows]
    if isinstance(msg, AdmitMsg):
        return AdmitMsg(
            ids, [msg.tokens[r] for r in rows], [msg.seeds[r] for r in rows], [msg.sampling[r] for r in rows]
        )
    if isinstance(msg, ReleaseMsg):
        return ReleaseMsg(ids)
    if isinstance(msg, BeginRoundMsg):
        committed = [msg.committed[r] for r in rows] if msg.committed else []
        return dataclasses.replace(
            msg, seq_ids=ids, spec_tokens=msg.spec_tokens[index], num_draft=msg.num_draft[index], committed=committed
        )
    if isinstance(msg, ResolveMsg):
        return dataclasses.replace(
            msg, seq_ids=ids, num_accepted=msg.num_accepted[index], bonus_tokens=msg.bonus_tokens[index]
        )
    if isinstance(msg, NeuralBackupMsg):
        return dataclasses.replace(msg, seq_ids=ids, need=[msg.need[r] for r in rows])
    raise TypeError(f"no rows to take from {type(msg).__name__}")


def assemble(
    round_id: int,
    seq_ids: list[int],
    parts: list[tuple[list[int], SpeculationReply]],
    k: int,
    counters: DrafterCounters,
) -> SpeculationReply:
    """One reply for the whole batch from replies about disjoint rows: parts = (rows, reply)."""
    b = len(seq_ids)
    probs = _probs_for(b, k, [rep for _, rep in parts])
    hit, covered = torch.zeros(b, dtype=torch.bool), torch.zeros(b, dtype=torch.bool)
    tokens = torch.zeros(b, k, dtype=torch.long)
    num_draft = torch.zeros(b, dtype=torch.long)
    rank = torch.full((b,), -1, dtype=torch.long)
    build = 0.0
    for rows, rep in parts:
        index = torch.tensor(rows, dtype=torch.long)
        hit[index], tokens[index], num_draft[index] = rep.hit, rep.tokens, rep.num_draft
        if rep.probs is not None:
            probs[index] = rep.probs
        covered[index] = rep.covered if rep.covered is not None else rep.hit
        if rep.bonus_rank is not None:
            rank[index] = rep.bonus_rank
        build = max(build, rep.build_seconds)
    return SpeculationReply(
        round_id, list(seq_ids), hit, tokens, probs, num_draft, build, counters, covered, rank, answered=bool(parts)
    )


def merge_shards(msg: ResolveMsg, replies: list[SpeculationReply], counters: DrafterCounters) -> SpeculationReply:
    """One reply for the whole batch from the shards' replies to `msg`: a row's speculation comes
    from the shard that holds its hit, else from the backup's just-in-time draft (the one shard
    asked for it), else none (num_draft 0: the target's fast backup)."""
    if not replies:
        return SpeculationReply.empty(msg.round_id, msg.seq_ids, counters, answered=False)
    if len(replies) == 1 and bool((replies[0].hit | (replies[0].num_draft > 0)).all()):
        return _whole(msg, replies[0], counters)  # one reply answering every row (most rounds at batch 1)
    b = len(msg.seq_ids)
    tokens, probs = torch.zeros_like(replies[0].tokens), _probs_for(b, replies[0].tokens.shape[1], replies)
    num_draft = torch.zeros(b, dtype=torch.long)
    hit, covered = torch.zeros(b, dtype=torch.bool), torch.zeros(b, dtype=torch.bool)
    rank = torch.full((b,), -1, dtype=torch.long)  # every worker ranks the same whole grid
    for rep in replies:  # the shards that hold hits
        covered |= rep.covered if rep.covered is not None else rep.hit
        if rep.bonus_rank is not None:
            rank = torch.maximum(rank, rep.bonus_rank)
        _take_rows(rep.hit & ~hit, rep, tokens, probs, num_draft)
        hit |= rep.hit
    for rep in replies:  # the backup's drafts for rows no shard holds
        _take_rows(~hit & (num_draft == 0) & (rep.num_draft > 0) & ~rep.hit, rep, tokens, probs, num_draft)
    build = max(rep.build_seconds for rep in replies)
    return SpeculationReply(
        msg.round_id, list(msg.seq_ids), hit, tokens, probs, num_draft, build, counters, covered, rank
    )


def _whole(msg: ResolveMsg, rep: SpeculationReply, counters: DrafterCounters) -> SpeculationReply:
    """merge_shards of one reply that has every row's speculation: that reply, as the merge makes it."""
    covered = rep.covered if rep.covered is not None else rep.hit
    rank = rep.bonus_rank if rep.bonus_rank is not None else torch.full((len(msg.seq_ids),), -1, dtype=torch.long)
    return dataclasses.replace(
        rep,
        round_id=msg.round_id,
        seq_ids=list(msg.seq_ids),
        counters=counters,
        covered=covered.clone(),
        bonus_rank=rank,
        greedy=None,
    )


def _probs_for(b: int, k: int, replies: list[SpeculationReply]) -> torch.Tensor | None:
    """The merged reply's probs: [b, K, V] zeros to fill, or None where no part carries any (every
    row greedy: SpeculationReply.probs)."""
    vocab = max((rep.probs.shape[-1] for rep in replies if rep.probs is not None), default=None)
    return None if vocab is None else torch.zeros(b, k, vocab)


def _take_rows(rows: torch.Tensor, rep: SpeculationReply, tokens, probs, num_draft) -> None:
    """rows [b] bool of `rep` into the merged tokens [b, K], probs [b, K, V] (None: none) and num_draft [b]."""
    tokens[rows], num_draft[rows] = rep.tokens[rows], rep.num_draft[rows]
    if rep.probs is not None:
        probs[rows] = rep.probs[rows]
