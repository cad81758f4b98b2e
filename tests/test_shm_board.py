"""The worker's board (ssd/transport/shm_board.py): the target reads a hit's branch off it instead of
waiting for the worker's reply, so a wrong read is a wrong speculation served as a hit. These pin
the board's promises: whole depths only, the asked-for round only, the last build kept while the
next is written, nothing from a bank rewritten mid-read, nothing that does not fit, no draw without
mass. Real memfds; one test writes from a forked process, as a worker does."""

from __future__ import annotations

import dataclasses
import os
import select
import signal

import pytest
import torch

from ssd.core.protocol import BeginRoundMsg, GridMsg
from ssd.transport import shm_board
from ssd.transport.shm_board import BoardReader, BoardWriter, holds_round

if not shm_board.supported():
    pytest.skip("the board relies on x86-64 store order: no board is made here", allow_module_level=True)

ROWS, WIDTH, N, K, V = 2, 6, 3, 4, 5  # WIDTH: the whole grid's branches per row; N: this shard's


def _grid(seed: int) -> GridMsg:
    outcome, candidates = torch.randint(0, 99, (2, ROWS, WIDTH), generator=torch.Generator().manual_seed(seed))
    return GridMsg(seed, list(range(ROWS)), outcome, candidates)


def _depths(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K depths of draws [K, b, N] and their distributions [K, b, N, V]; no token 0, which a fresh
    memfd's zeros would pass for."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 1000, (K, ROWS, N), generator=g), torch.rand(K, ROWS, N, V, generator=g)


def _assert_prefix(out, tokens, probs, row: int, branch: int, depth: int) -> None:
    assert out is not None and out.tokens == tokens[:depth, row, branch].tolist()
    assert torch.equal(out.probs, probs[:depth, row, branch])


class _Spy(torch.Tensor):
    """A tensor that runs `hook` as the writer copies it into the board: a reader racing the writer
    at its worst moment, made deterministic."""

    hook = None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__setitem__ and cls.hook is not None:
            cls.hook()
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.fixture
def open_board():
    opened = []

    def open_(bank_bytes: int = 1 << 14) -> tuple[BoardReader, BoardWriter]:
        reader = BoardReader.create(bank_bytes=bank_bytes)
        opened.append((reader, BoardWriter(reader.handle)))  # its own mapping, as in the worker
        return opened[-1]

    yield open_
    for reader, writer in opened:
        writer.close(), reader.close()


def test_a_build_reads_as_its_whole_depths_so_far(open_board, monkeypatch):
    reader, writer = open_board()
    grid, (tokens, probs) = _grid(1), _depths(1)
    mid_add = []
    monkeypatch.setattr(_Spy, "hook", lambda: mid_add.append(reader.read(7, 1, 2, True)))
    assert reader.grid(7) is None and reader.read(7, 1, 2, False) is None
    writer.start(7, grid, N, K, V, probs=True, build_us=123)
    read = reader.grid(7)
    outcome, candidates = torch.tensor(read.outcome), torch.tensor(read.candidates)
    assert torch.equal(outcome, grid.outcome) and torch.equal(candidates, grid.candidates)
    assert reader.read(7, 1, 2, False) is None  # no depth yet
    for d in range(K):
        mid_add.clear()
        writer.add(d, tokens[d].as_subclass(_Spy), probs[d].as_subclass(_Spy))
        # Read while depth d's columns are being copied: depth d must not be visible yet.
        assert len(mid_add) == 2
        for out in mid_add:
            if d == 0:
                assert out is None
            else:
                _assert_prefix(out, tokens, probs, 1, 2, d)
        out = reader.read(7, 1, 2, True)
        _assert_prefix(out, tokens, probs, 1, 2, d + 1)
        assert out.build_us == 123
        assert reader.read(7, 0, 1, False).tokens == tokens[: d + 1, 0, 1].tolist()


def test_the_last_build_stays_readable_while_the_next_is_written(open_board):
    reader, writer = open_board()
    builds = {key: (_grid(key), *_depths(key)) for key in (11, 12, 13)}

    def build(key: int, depths: int) -> None:
        grid, tokens, probs = builds[key]
        writer.start(key, grid, N, K, V, True, 0)
        for d in range(depths):
            writer.add(d, tokens[d], probs[d])

    def check(key: int, depth: int) -> None:
        grid, tokens, probs = builds[key]
        _assert_prefix(reader.read(key, 0, 1, True), tokens, probs, 0, 1, depth)
        assert torch.equal(torch.tensor(reader.grid(key).candidates), grid.candidates)

    build(11, K)
    assert reader.read(12, 0, 1, False) is None and reader.grid(12) is None  # another round's key
    build(12, 2)
    check(11, K), check(12, 2)
    build(13, 1)  # into the bank of 11: its round is gone
    assert reader.read(11, 0, 1, False) is None and reader.grid(11) is None
    check(12, 2), check(13, 1)


def test_probs_are_read_only_where_the_build_published_them(open_board):
    reader, writer = open_board()
    tokens, probs = _depths(3)
    writer.start(21, _grid(3), N, K, V, False, 0)  # a build that keeps no distributions: any given are dropped
    writer.add(0, tokens[0], probs[0])
    assert reader.read(21, 1, 0, True) is None
    assert reader.read(21, 1, 0, False).tokens == tokens[:1, 1, 0].tolist()
    writer.start(22, _grid(4), N, K, V, True, 0)
    writer.add(0, tokens[0], probs[0])
    _assert_prefix(reader.read(22, 1, 0, True), tokens, probs, 1, 0, 1)
    writer.add(1, tokens[1], None)  # an argmax draw: depth 1 has no distribution
    writer.add(2, tokens[2], probs[2])
    assert reader.read(22, 1, 0, True) is None
    assert reader.read(22, 1, 0, False).tokens == tokens[:3, 1, 0].tolist()


def test_a_build_that_does_not_fit_publishes_nothing_and_one_whose_probs_do_not_tokens_only(open_board):
    tokens, probs = _depths(5)
    exact = shm_board.BANK_HEADER * 8 + 8 * (2 * ROWS * WIDTH + ROWS * N * K)  # grid and tokens, no probs
    assert holds_round(exact, ROWS, WIDTH, N, K) and not holds_round(exact - 8, ROWS, WIDTH, N, K)
    for bank_bytes, fits in ((exact - 8, False), (exact, True)):
        reader, writer = open_board(bank_bytes)
        writer.start(31, _grid(5), N, K, V, True, 0)
        writer.add(0, tokens[0], probs[0])
        assert (reader.grid(31) is not None) == fits
        assert reader.read(31, 0, 0, True) is None
        out = reader.read(31, 0, 0, False)
        assert (out and out.tokens) == (tokens[:1, 0, 0].tolist() if fits else None)


@pytest.mark.parametrize("ask", ["read", "grid"])
def test_a_bank_rewritten_while_read_reads_as_nothing(open_board, monkeypatch, ask):
    reader, writer = open_board()
    (tokens, probs), (new_tokens, new_probs) = _depths(6), _depths(7)
    writer.start(41, _grid(6), N, K, V, True, 0)
    for d in range(K):
        writer.add(d, tokens[d], probs[d])
    ints = reader._banks.ints

    def rewrite_mid_read(*args):
        views = ints(*args)  # the reader holds bank 0's version: the worker moves on to bank 1, then back
        monkeypatch.setattr(reader._banks, "ints", ints)
        writer.start(42, _grid(7), N, K, V, True, 0)
        writer.start(43, _grid(7), N, K, V, True, 0)
        writer.add(0, new_tokens[0], new_probs[0])
        return views

    query = (lambda: reader.read(41, 0, 0, True)) if ask == "read" else (lambda: reader.grid(41))
    assert query() is not None
    monkeypatch.setattr(reader._banks, "ints", rewrite_mid_read)
    assert query() is None
    _assert_prefix(reader.read(43, 0, 0, True), new_tokens, new_probs, 0, 0, 1)


def test_a_bank_being_started_reads_as_nothing(open_board, monkeypatch):
    reader, writer = open_board()
    grid, mid_start = _grid(8), []
    monkeypatch.setattr(_Spy, "hook", lambda: mid_start.append(reader.grid(44)))
    # Its key is already in the header while the grid is copied in: only the odd version tells.
    writer.start(44, GridMsg(8, grid.seq_ids, grid.outcome.as_subclass(_Spy), grid.candidates), N, K, V, True, 0)
    assert mid_start == [None]
    assert torch.equal(torch.tensor(reader.grid(44).outcome), grid.outcome)


def test_a_draw_without_mass_reads_as_nothing(open_board):
    reader, writer = open_board()
    tokens, probs = _depths(9)
    tokens[1, 0, 2] = -1
    writer.start(51, _grid(9), N, K, V, True, 0)
    writer.add(0, tokens[0], probs[0])
    assert reader.read(51, 0, 2, False).tokens == tokens[:1, 0, 2].tolist()
    writer.add(1, tokens[1], probs[1])
    assert reader.read(51, 0, 2, False) is None and reader.read(51, 0, 2, True) is None
    _assert_prefix(reader.read(51, 0, 1, True), tokens, probs, 0, 1, 2)  # its neighbours still read


def test_a_worker_process_depths_are_seen_by_the_target(open_board):
    reader, _ = open_board()
    grid, (tokens, probs) = _grid(10), _depths(10)
    go_r, go_w = os.pipe()
    done_r, done_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the worker: its own mapping of the inherited memfd; one depth per go, lockstep
        code = 1
        try:
            writer = BoardWriter(reader.handle)
            writer.start(61, grid, N, K, V, True, 5)
            for d in range(K + 1):
                os.write(done_w, b".")
                if d < K and select.select([go_r], [], [], 10)[0] and os.read(go_r, 1):
                    writer.add(d, tokens[d], probs[d])
            code = 0
        finally:
            os._exit(code)  # never back into pytest in the child
    try:
        for d in range(K + 1):
            assert select.select([done_r], [], [], 10)[0] and os.read(done_r, 1), "the worker process stalled"
            out = reader.read(61, 1, 1, True)
            if d == 0:
                assert out is None and torch.equal(torch.tensor(reader.grid(61).candidates), grid.candidates)
            else:
                _assert_prefix(out, tokens, probs, 1, 1, d)
                assert out.build_us == 5
            os.write(go_w, b".")
        assert os.waitpid(pid, 0)[1] == 0
        pid = 0
    finally:
        if pid:  # a stalled or failed check: the worker must not outlive the test
            os.kill(pid, signal.SIGKILL), os.waitpid(pid, 0)
        for fd in (go_r, go_w, done_r, done_w):
            os.close(fd)


def _round(round_id=5, spec=((4, 8, 15, 0), (16, 23, 0, 0)), drafts=(3, 2), committed=(7, 9)) -> BeginRoundMsg:
    return BeginRoundMsg(round_id, [1, 2], torch.tensor(spec), torch.tensor(drafts), [3, 2, 1, 1, 1], list(committed))


def test_a_round_key_names_its_content_and_nothing_else():
    """A bank is found by its round's key: rounds that same_round calls equal share one (the padding
    past a row's drafts is not content), and a round that differs in anything that is has another."""
    base = _round()
    padded = _round(spec=((4, 8, 15, -7), (16, 23, 99, 5)))
    assert base.same_round(padded) and base.board_key() == padded.board_key()
    others = [
        _round(round_id=6),
        _round(spec=((4, 8, 14, 0), (16, 23, 0, 0))),  # a drafted token
        _round(drafts=(3, 1)),  # one draft fewer, the same tokens
        _round(spec=((4, 8, 15, 16), (23, 0, 0, 0)), drafts=(4, 1)),  # the same tokens, split otherwise
        _round(committed=(7, 10)),
        dataclasses.replace(base, seq_ids=[1, 3]),
        dataclasses.replace(base, fanout=[3, 2, 1, 1, 2]),
    ]
    keys = {base.board_key()} | {other.board_key() for other in others}
    assert len(keys) == 1 + len(others)
    assert not any(base.same_round(other) for other in others)
    assert all(0 <= key < 1 << 62 for key in keys)  # a bank header's int64, never -1 (no build)


def test_the_grid_read_off_a_board_finds_the_branches_the_grid_message_does(open_board):
    reader, writer = open_board()
    grid = _grid(12)
    writer.start(71, grid, N, K, V, False, 0)
    read = reader.grid(71)
    pairs = [(a, t) for a, t in zip(grid.outcome.flatten().tolist(), grid.candidates.flatten().tolist())]
    for accepted, bonus in [*pairs[:3], (99, 99)]:  # a hit at the start of each row, and a miss
        assert read.branches([accepted] * ROWS, [bonus] * ROWS) == grid.branches([accepted] * ROWS, [bonus] * ROWS)
    assert all(read.rank(r, n) == grid.rank(r, n) for r in range(ROWS) for n in range(WIDTH))


def test_a_build_that_drops_its_distributions_mid_read_gives_none_of_them(open_board, monkeypatch):
    """add() clears HAS_PROBS without a new version when a depth is drawn without distributions
    (a worker's rounds on a GPU): a read that saw them kept, then that depth, must not return
    distributions that were never written."""
    reader, writer = open_board()
    tokens, _ = _depths(13)
    writer.start(81, _grid(13), N, K, V, True, 0)
    fields, calls = reader._banks.fields, []

    def first_depth_between_reads(bank):
        calls.append(bank)
        if len(calls) == 2:  # the depth's read, after the header's
            writer.add(0, tokens[0], None)
        return fields(bank)

    monkeypatch.setattr(reader._banks, "fields", first_depth_between_reads)
    assert reader.read(81, 0, 0, True) is None
    monkeypatch.setattr(reader._banks, "fields", fields)
    assert reader.read(81, 0, 0, True) is None and reader.read(81, 0, 0, False).tokens == tokens[:1, 0, 0].tolist()
