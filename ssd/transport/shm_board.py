"""A draft worker's board: the speculations its tree has prepared so far, in shared memory that the
target reads itself, so that a hit costs the target no wait for its worker.

Why: in a pool the target waits each round for the one worker that holds the hit. That worker
computes its reply only once it has read the outcome, between two tree depths, and on fewer cores
than workers it must first get a core (on 2 cores, D = 8: ~4 ms a round of the target's ~5 ms
exchange). Its tree's branches are ready before that: each depth's tokens (and, for sampled rows,
the distributions they were drawn from) are written here as the depth ends, and the target copies
the hit's branch out of the board as soon as it knows the outcome (pool_client.py). Any depth
reached is a valid speculation (tree_drafter.py: a cut tree answers with the depth reached).

Layout: one memfd, written by its worker only, read by its target only. Two banks; each build of
a round goes to the bank the build before did not use, so that the target can still be reading
the last round's while the next one starts. A bank: its header (int64s, BANK_HEADER), then the
round's branch grid (GridMsg: outcome and candidates, [b, G] int64 each, G the whole grid's
branches per row, every shard's), this shard's tokens [b, N, K] int64 and, where the build keeps
them and they fit, the distributions [b, N, K, V] float32 (N: this shard's branches per row, V
the target's vocabulary). The grid is what the target looks the outcome up in: every shard forks
the whole grid alike, so any live shard's board gives it, with no message to wait for.

Consistency (a seqlock per bank): the writer makes `version` odd, rewrites the header, makes it
even again; within a build it writes each depth's columns and only then raises `depth`, and never
rewrites a column it has published. The reader takes a bank's version (even), its key and depth,
copies what it needs, and reads the version again: a bank rewritten meanwhile reads as nothing.
A bank is found by its round's key (BeginRoundMsg.board_key: the announcement's content), so a
round the worker began on a prediction the announcement confirms is found, and one it took back
never is. The order of the stores is the program's: this relies on the host's total store order
(x86-64), and elsewhere no board is made (`supported`).
"""

from __future__ import annotations

import math
import mmap
import os
import platform
import struct
from dataclasses import dataclass

import torch

from ssd.core.protocol import GridMsg, branch_rank, grid_branches

# Bank header fields (int64 each).
VERSION, KEY, ROWS, BRANCHES, K, VOCAB, HAS_PROBS, DEPTH, BUILD_US, GRID = range(10)
BANK_HEADER = 16  # int64s: room for fields added later
_FIELDS = struct.Struct(f"<{GRID + 1}q")
DEFAULT_BANK_BYTES = 8 << 20  # a bank's room; its pages are touched only where written


def supported() -> bool:
    """Whether this host orders stores as the board relies on (x86-64)."""
    return platform.machine().lower() in ("x86_64", "amd64")


@dataclass(frozen=True)
class BoardFd:
    """What the worker needs to map its board: the memfd and each bank's size in bytes."""

    fd: int
    bank_bytes: int


class _Banks:
    """The two banks of a board's mapping, as int64 headers and raw bytes."""

    def __init__(self, fd: int, bank_bytes: int) -> None:
        assert bank_bytes % 8 == 0 and bank_bytes > BANK_HEADER * 8
        self.fd, self.bank_bytes = fd, bank_bytes
        self._map = mmap.mmap(fd, 2 * bank_bytes)
        raw = torch.frombuffer(self._map, dtype=torch.uint8)
        self.raw = [raw[i * bank_bytes : (i + 1) * bank_bytes] for i in range(2)]
        self.header = [bank[: BANK_HEADER * 8].view(torch.int64) for bank in self.raw]

    def fields(self, bank: int) -> tuple[int, ...]:
        """Bank `bank`'s header fields VERSION..GRID, in one read."""
        return _FIELDS.unpack_from(self._map, bank * self.bank_bytes)

    # The reader's: struct reads into Python ints and one copy for a distribution cost the target a
    # fraction of numpy's or torch's views, on its thread between its verification and its next
    # forward (whose runs have just evicted the caches, where every call into them costs ~10 us).
    def ints(self, bank: int, start: int, count: int) -> tuple[int, ...]:
        """`count` int64s of bank `bank` from its byte `start`, in one read."""
        return struct.unpack_from(f"<{count}q", self._map, bank * self.bank_bytes + start)

    def floats(self, bank: int, start: int, count: int) -> torch.Tensor:
        """A copy of `count` float32s of bank `bank` from its byte `start`."""
        return self.raw[bank][start : start + 4 * count].view(torch.float32).clone()

    def layout(self, bank: int, rows: int, grid: int, branches: int, k: int, vocab: int, probs: bool):
        """-> views of bank `bank`: the grid [2, b, G] int64 (outcome, candidates), tokens [b, N, K]
        int64 and probs [b, N, K, V] float32 (or None)."""
        sizes = _sizes(rows, grid, branches, k, vocab)
        start, out = BANK_HEADER * 8, []
        # The distributions' view only where the build has them: they may not fit the bank.
        for (dtype, shape), nbytes in zip(_SHAPES(rows, grid, branches, k, vocab)[: 3 if probs else 2], sizes):
            out.append(self.raw[bank][start : start + nbytes].view(dtype).view(shape))
            start += nbytes
        return out[0], out[1], out[2] if probs else None

    def close(self) -> None:
        self.raw, self.header = [], []
        self._map.close()


def _SHAPES(rows: int, grid: int, branches: int, k: int, vocab: int):  # noqa: N802 - a table
    return (
        (torch.int64, (2, rows, grid)),
        (torch.int64, (rows, branches, k)),
        (torch.float32, (rows, branches, k, vocab)),
    )


def _sizes(rows: int, grid: int, branches: int, k: int, vocab: int) -> list[int]:
    """Bytes of the grid, the tokens and the distributions of a build of these dimensions."""
    return [dtype.itemsize * math.prod(shape) for dtype, shape in _SHAPES(rows, grid, branches, k, vocab)]


def holds_round(bank_bytes: int, rows: int, grid: int, branches: int, k: int) -> bool:
    """Whether a bank holds a build's grid and tokens (a round whose do not is published by no
    board: the target asks for its grid by message, as over any other transport)."""
    return _fits(bank_bytes, rows, grid, branches, k, 0, False)


def _fits(bank_bytes: int, rows: int, grid: int, branches: int, k: int, vocab: int, probs: bool) -> bool:
    sizes = _sizes(rows, grid, branches, k, vocab)
    return BANK_HEADER * 8 + sizes[0] + sizes[1] + (sizes[2] if probs else 0) <= bank_bytes


class BoardWriter:
    """The worker's end: start() a build, add() each depth as it ends."""

    def __init__(self, board: BoardFd) -> None:
        self._banks = _Banks(board.fd, board.bank_bytes)
        self._bank = 1  # the first build goes to bank 0
        self._tokens: torch.Tensor | None = None
        self._probs: torch.Tensor | None = None

    def start(self, key: int, grid: GridMsg, branches: int, k: int, vocab: int, probs: bool, build_us: int) -> None:
        """A new build of the round `key` (BeginRoundMsg.board_key), forked into `grid`, into the
        other bank. probs: the build keeps distributions (some row samples); where they do not
        fit, only the tokens are published (the target then waits for the reply of a sampled
        row). build_us: the worker's last whole build, which the target's budget is sized by."""
        self._bank = 1 - self._bank
        header = self._banks.header[self._bank]
        rows, width = grid.outcome.shape
        probs = probs and _fits(self._banks.bank_bytes, rows, width, branches, k, vocab, True)
        fits = _fits(self._banks.bank_bytes, rows, width, branches, k, vocab, False)
        header[VERSION] += 1  # odd: being rewritten
        header[KEY] = key if fits else -1
        header[ROWS], header[BRANCHES], header[K], header[VOCAB], header[GRID] = rows, branches, k, vocab, width
        header[HAS_PROBS], header[DEPTH], header[BUILD_US] = int(probs), 0, build_us
        self._tokens = self._probs = None
        if fits:
            cells, self._tokens, self._probs = self._banks.layout(self._bank, rows, width, branches, k, vocab, probs)
            cells[0], cells[1] = grid.outcome, grid.candidates
        header[VERSION] += 1  # even: the header and the grid are whole

    def add(self, d: int, tokens: torch.Tensor, probs: torch.Tensor | None) -> None:
        """Depth d's draws tokens [b, N] (host) and, where kept, their distributions [b, N, V]
        (host); then the depth is published."""
        if self._tokens is None:
            return
        self._tokens[:, :, d] = tokens
        if self._probs is not None:
            if probs is None:  # an argmax draw keeps none: this build publishes tokens only
                self._banks.header[self._bank][HAS_PROBS] = 0
                self._probs = None
            else:
                self._probs[:, :, d] = probs
        self._banks.header[self._bank][DEPTH] = d + 1  # after the columns: the reader trusts depth

    def close(self) -> None:
        self._banks.close()


@dataclass(frozen=True)
class BoardGrid:
    """A round's branch grid as read off a board (GridMsg's content, as Python ints)."""

    outcome: list[tuple[int, ...]]  # [b][G]: tokens accepted that each branch stands for
    candidates: list[tuple[int, ...]]  # [b][G]: its bonus token

    def branches(self, accepted: list[int], bonus: list[int]) -> list[int]:
        """GridMsg.branches."""
        return grid_branches(self.outcome, self.candidates, accepted, bonus)

    def rank(self, row: int, branch: int) -> int:
        """GridMsg.rank."""
        return branch_rank(self.outcome[row], branch)


@dataclass(frozen=True)
class Branch:
    """A branch read off a board."""

    tokens: list[int]  # its depth tokens
    probs: torch.Tensor | None  # [depth, V] float32, a copy; None where the build published none
    build_us: int  # the worker's last whole build


class BoardReader:
    """The target's end, over the memfd it created (create())."""

    def __init__(self, board: BoardFd) -> None:
        self.handle = board
        self._banks = _Banks(board.fd, board.bank_bytes)

    @classmethod
    def create(cls, bank_bytes: int = DEFAULT_BANK_BYTES) -> BoardReader:
        fd = os.memfd_create("ssd-board", os.MFD_CLOEXEC)
        os.ftruncate(fd, 2 * bank_bytes)
        return cls(BoardFd(fd, bank_bytes))

    def _bank(self, key: int) -> tuple[int, int, tuple[int, ...]] | None:
        """-> (bank, version, header fields ROWS..GRID) of the build of round `key`, None if none."""
        for bank in (0, 1):
            fields = self._banks.fields(bank)
            if fields[VERSION] % 2 == 0 and fields[KEY] == key:
                return bank, fields[VERSION], fields[ROWS:]
        return None

    def _unchanged(self, bank: int, version: int, with_probs: bool = False) -> bool:
        """Whether the bank is as it was at `version` and, with_probs, its build still keeps its
        distributions: add() clears HAS_PROBS without a new version (a depth drawn without any),
        so a read that saw it set and then that depth would copy distributions never written."""
        fields = self._banks.fields(bank)
        return fields[VERSION] == version and (not with_probs or fields[HAS_PROBS] == 1)

    def grid(self, key: int) -> BoardGrid | None:
        """The branch grid of round `key`, None where this board has no build of that round (not
        forked yet, or rewritten while read)."""
        found = self._bank(key)
        if found is None:
            return None
        bank, version, (rows, branches, k, vocab, _has_probs, _depth, _build_us, width) = found
        if not _fits(self._banks.bank_bytes, rows, width, branches, k, vocab, False):  # read while rewritten
            return None
        cells = self._banks.ints(bank, BANK_HEADER * 8, 2 * rows * width)
        if not self._unchanged(bank, version):
            return None
        per_row = [cells[i * width : (i + 1) * width] for i in range(2 * rows)]
        return BoardGrid(per_row[:rows], per_row[rows:])

    def read(self, key: int, row: int, branch: int, with_probs: bool) -> Branch | None:
        """Branch `branch` of row `row` of the build of round `key`, as far as it is published;
        None where no bank holds that build, it has no depth yet, its probs are wanted and not
        published, or its bank was rewritten while read."""
        found = self._bank(key)
        if found is None:
            return None
        bank, version, (rows, branches, k, vocab, has_probs, _depth, build_us, width) = found
        depth = self._banks.fields(bank)[DEPTH]  # read after the fields: it only grows
        if depth == 0 or depth > k or (with_probs and not has_probs) or row >= rows or branch >= branches:
            return None
        if not _fits(self._banks.bank_bytes, rows, width, branches, k, vocab, with_probs):  # read while rewritten
            return None
        grid_bytes, tokens_bytes = _sizes(rows, width, branches, k, vocab)[:2]
        cell = row * branches + branch  # its place in tokens [b, N, K] and probs [b, N, K, V]
        drawn = list(self._banks.ints(bank, BANK_HEADER * 8 + grid_bytes + 8 * k * cell, depth))
        kept = None
        if with_probs:
            start = BANK_HEADER * 8 + grid_bytes + tokens_bytes + 4 * k * vocab * cell
            kept = self._banks.floats(bank, start, depth * vocab).view(depth, vocab)
        return Branch(drawn, kept, build_us) if self._unchanged(bank, version, with_probs) and min(drawn) >= 0 else None

    def close(self) -> None:
        self._banks.close()
        os.close(self.handle.fd)
