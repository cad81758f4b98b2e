"""The hits a target reads off its workers' boards (shm_board.py) instead of waiting for their
replies: which rows, how deep, and the reply they make (merged with the workers' own replies by
rows.merge_shards).

Shapes: b rows of the round, K speculation length, V the target's vocabulary; D shards, branch n
held by shard n mod D at its board's branch n // D.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ssd.core.protocol import BeginRoundMsg, DrafterCounters, SpeculationReply
from ssd.transport.shm_board import BoardGrid, BoardReader, Branch, holds_round

# How often a target waiting for a round's grid on the boards checks that a worker is still alive
# to fork it (a process poll costs a system call; the wait itself is microseconds a try).
LIVENESS_S = 0.01


def on_boards(msg: BeginRoundMsg, boards: list[BoardReader | None], live: int) -> bool:
    """Whether round `msg` is published on its workers' boards (boards: each shard's, None for a
    lost one): each of the `live` workers has one, and the round fits them."""
    have = [b for b in boards if b is not None]
    if not have or len(have) != live:
        return False
    width = sum(msg.fanout)
    own = math.ceil(width / len(boards))  # shard 0's share, the largest
    bank = min(b.handle.bank_bytes for b in have)
    return holds_round(bank, len(msg.seq_ids), width, own, msg.spec_tokens.shape[1])


def board_grid(
    key: int, boards: list[BoardReader | None], deadline_s: float, alive: Callable[[], bool]
) -> BoardGrid | None:
    """The round's branch grid off the first board that has it (every shard forks the whole grid
    alike), waiting for one to fork it (yielding the core meanwhile) up to the deadline, or until
    `alive()` (asked every LIVENESS_S) says no worker is left to fork it; None then."""
    end = time.monotonic() + deadline_s
    checked = time.monotonic()
    while True:
        for board in boards:
            got = None if board is None else board.grid(key)
            if got is not None:
                return got
        now = time.monotonic()
        if now > end:
            return None
        if now - checked > LIVENESS_S:
            if not alive():
                return None
            checked = now
        os.sched_yield()


@dataclass
class BoardHits:
    """What a round's outcome read off the boards."""

    taken: list[int]  # [b] tokens of each row's hit taken (0: none; ResolveMsg.taken)
    parts: dict[int, SpeculationReply]  # shard -> its rows read off its board, as a reply

    @property
    def any(self) -> bool:
        return any(self.taken)


def read_hits(
    rnd: BeginRoundMsg,
    answering: list[int],
    grid: BoardGrid,
    branches: list[int],
    boards: list[BoardReader | None],
    greedy: list[bool],
    key: int,
) -> BoardHits:
    """For each row whose answering shard (answering [b]: ResolveMsg.answering) holds its hit
    (branches [b]: each row's branch in the grid, -1 where none) and has a board: that branch, as
    deep as the board has it (a sampled row's only with its distributions)."""
    b, d, k = len(rnd.seq_ids), len(boards), rnd.spec_tokens.shape[1]
    taken, found = [0] * b, {}  # found: shard -> [(row, branch, rank)]
    for r, n in enumerate(branches):
        w = n % d if n >= 0 else -1
        if w < 0 or answering[r] != w or boards[w] is None:
            continue
        branch = boards[w].read(key, r, n // d, with_probs=not greedy[r])
        if branch is not None:
            taken[r] = len(branch.tokens)
            found.setdefault(w, []).append((r, branch, grid.rank(r, n)))
    parts = {w: _reply(rnd.round_id, rnd.seq_ids, rows, greedy, k) for w, rows in found.items()}
    return BoardHits(taken, parts)


def _reply(round_id: int, seq_ids: list[int], rows: list[tuple[int, Branch, int]], greedy, k: int) -> SpeculationReply:
    """One shard's rows read off its board, as the reply it would have sent for them: built as
    lists, then one tensor a field (each call into torch costs the target's cold caches ~10 us:
    shm_board._Banks.ints)."""
    b = len(seq_ids)
    hit, num_draft, rank = [False] * b, [0] * b, [-1] * b
    tokens = [[0] * k for _ in range(b)]
    vocab = next((branch.probs.shape[-1] for _, branch, _ in rows if branch.probs is not None), None)
    probs = None if vocab is None else torch.zeros(b, k, vocab)
    for r, branch, place in rows:
        depth = len(branch.tokens)
        hit[r], num_draft[r], rank[r] = True, depth, place
        tokens[r][:depth] = branch.tokens
        if branch.probs is not None:
            probs[r, :depth] = branch.probs
    build = max(branch.build_us for _, branch, _ in rows) / 1e6
    return SpeculationReply(
        round_id, list(seq_ids), torch.tensor(hit), torch.tensor(tokens), probs, torch.tensor(num_draft), build,
        DrafterCounters(), torch.tensor(hit), torch.tensor(rank), torch.tensor(greedy, dtype=torch.bool),
    )  # fmt: skip
