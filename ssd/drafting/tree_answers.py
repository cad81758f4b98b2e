"""A tree drafter's answer to a round's outcome (TreeDrafter.resolve, tree_drafter.py): which rows
the round held, their outcomes committed to what the drafter keeps, the look-up of each row's
outcome in the round's branch grid, and the rows it drafts just in time instead.

Shapes: b rows of the outcome message, K speculation length, V target vocab. A shard of a pool
holds the branches n with n mod D = its index (tree_drafter.py, "Shards").
"""

from __future__ import annotations

import torch

from ssd.core.protocol import ResolveMsg
from ssd.drafting.draft_grammars import DraftGrammars
from ssd.drafting.neural_backup import SeqState
from ssd.drafting.tree import SpeculationTree
from ssd.model.kv_cache import StaticKVCache


def known_rows(rnd: SpeculationTree | None, msg: ResolveMsg) -> tuple[list[int], list[int]]:
    """-> (the rows of msg that the round holds, each one's row in the round)."""
    position = {} if rnd is None else {s: i for i, s in enumerate(rnd.seq_ids)}  # seq id -> row in the round
    known = [r for r, s in enumerate(msg.seq_ids) if s in position]
    return known, [position[msg.seq_ids[r]] for r in known]


def commit_outcomes(
    rnd: SpeculationTree,
    msg: ResolveMsg,
    known: list[int],
    index: list[int],
    states: dict[int, SeqState],
    grammars: DraftGrammars,
    cache: StaticKVCache,
) -> None:
    """Append each known row's (index: its row in the round) accepted drafts and bonus token
    to what it has committed, and drop the glue columns of its rejected drafts from the cache."""
    accepted, bonus = msg.num_accepted.tolist(), msg.bonus_tokens.tolist()
    rejected = [0] * len(rnd.seq_ids)  # per cache row: s_T's glue columns to drop
    for r, i in zip(known, index):
        s, acc = msg.seq_ids[r], accepted[r]
        committed = rnd.spec_tokens[i][:acc] + [bonus[r]]
        states[s].tokens.extend(committed)
        grammars.commit(s, committed)
        rejected[i] = len(rnd.spec_tokens[i]) - acc
    # The accepted drafts' columns stay: they hold committed tokens now.
    cache.drop_last(torch.tensor(rejected, dtype=torch.long))


def look_up(
    rnd: SpeculationTree | None,
    msg: ResolveMsg,
    known: list[int],
    index: list[int],
    greedy: list[bool],
    tokens: torch.Tensor,
    probs: torch.Tensor | None,
    shard: int,
    num_shards: int,
) -> tuple[list[bool], list[bool], list[int]]:
    """Each row's outcome in the round's grid -> per row (hit: this shard holds its branch,
    covered: some shard does, the bonus token's rank; False, False, -1 for a row the round does
    not hold). The hits' branches go into tokens [b, K] and, for sampled rows, probs [b, K, V]."""
    b = len(msg.seq_ids)
    hit, covered, rank = [False] * b, [False] * b, [-1] * b
    if not known:
        return hit, covered, rank
    accepted, bonus = msg.num_accepted.tolist(), msg.bonus_tokens.tolist()
    found, branch, ranks = rnd.lookup(index, [accepted[r] for r in known], [bonus[r] for r in known])
    picks = []  # (row in the round, branch of this shard) per hit row, in batch order
    for r, i, f, n, place in zip(known, index, found, branch, ranks):
        covered[r], rank[r] = bool(f), place
        if f and n % num_shards == shard:
            hit[r] = True
            picks.append((i, n // num_shards))
    if picks:
        rnd.copy_branches(picks, [r for r, h in enumerate(hit) if h], greedy, tokens, probs)
    return hit, covered, rank


def backed_up(msg: ResolveMsg, mine: list[bool], hit: list[bool], covered: list[bool], shard: int) -> list[bool]:
    """[b] the rows a drafter drafts just in time (when the target asks for the neural backup):
    named answering, the rows it answers but does not hold (no shard holds them, or the one that
    does is gone); else, as the backup shard, the rows no shard holds."""
    if not msg.neural_backup:
        return [False] * len(hit)
    if msg.answering:
        return [m and not h for m, h in zip(mine, hit)]
    return [not c for c in covered] if msg.backup_shard == shard else [False] * len(hit)


def took_from_board(msg: ResolveMsg, hit: list[bool], tokens: torch.Tensor, probs, num_draft: torch.Tensor) -> None:
    """The hits whose first msg.taken[r] tokens the target read off this drafter's board: their
    speculation is cut to that depth (tokens [b, K], probs [b, K, V] or None, num_draft [b]), as
    the target verifies it, so that the round this drafter predicts from it is the one announced."""
    for r, depth in enumerate(msg.taken):
        if depth > 0 and hit[r]:
            tokens[r, depth:] = 0
            if probs is not None:
                probs[r, depth:] = 0.0
            num_draft[r] = min(int(num_draft[r]), depth)
