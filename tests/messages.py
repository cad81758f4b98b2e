"""One message of every kind of the draft protocol (values exact in float32), and a comparison
that says whether a message came back intact: what the wire and channel tests send."""

from __future__ import annotations

import dataclasses

import torch

from ssd.core.protocol import (
    AdmitMsg,
    BeginRoundMsg,
    DrafterCounters,
    ErrorMsg,
    GridMsg,
    JoinMsg,
    MsgType,
    NeuralBackupMsg,
    ReleaseMsg,
    ResolveMsg,
    SpeculationReply,
)
from ssd.core.sampling import SequenceSampling
from ssd.processing.request import Processing


def mixed_layout_probs(gen: torch.Generator) -> torch.Tensor:
    """[4, 4, 11]: a greedy row (one-hot, its last position empty), a top-2 row (sparse), a row
    with no speculation (zeros) and a full-support row (dense)."""
    probs = torch.zeros(4, 4, 11)
    probs[0, torch.arange(3), torch.tensor([4, 0, 10])] = 1.0
    top = torch.rand(4, 2, generator=gen)
    probs[1].scatter_(
        1, torch.randint(11, (4, 1), generator=gen) % 5 + torch.tensor([[0, 5]]), top / top.sum(1, keepdim=True)
    )
    probs[3] = torch.softmax(torch.randn(4, 11, generator=gen), -1)
    return probs


def every_message() -> list[tuple[MsgType, object]]:
    """(kind, message) for every kind, some kinds several times (edge cases: empty lists, a
    round with committed lengths, each probability layout of a reply)."""
    gen = torch.Generator().manual_seed(0)
    grammar = '%llguidance {}\nstart: "é" /[0-9]+/'  # non-ASCII, and not a multiple of 8 bytes
    # Every processing field set (values exact in float32), and only a bad word.
    processing = Processing(1.25, 0.5, -1.5, 0.125, 7, {3: 2.5, 250: -100.0}, (1, 4, 9), (0, 2), ((5, 6, 7), (8,)))
    sampling = [
        SequenceSampling(0.0, 0, 1.0, processing=Processing(bad_words=((4,),))),
        SequenceSampling(0.5, 5, 0.75, grammar, 3, 256, processing),
        SequenceSampling(1.25, 50, 0.5, "12345678", 40, -1),
    ]
    spec = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 0, 0]])
    counters = DrafterCounters(
        3, 1, 2, 1, 1, 4, drafted_early=2, built=5, depths=17, prepare_us=12_345, tree_us=2**40, peak_rss_bytes=9
    )
    return [
        (MsgType.JOIN, JoinMsg(1, 3)),
        (MsgType.ADMIT, AdmitMsg([5, 9, 2], [[1, 2, 3], [7], list(range(40))], [2**62 - 1, 0, 12345], sampling)),
        (MsgType.RELEASE, ReleaseMsg([3, 1, 4])),
        (MsgType.RELEASE, ReleaseMsg([])),
        (MsgType.BEGIN_ROUND, BeginRoundMsg(17, [5, 9, 2], spec, torch.tensor([4, 4, 2]), [3, 2, 2, 2, 3])),
        (MsgType.PREDICT, BeginRoundMsg(21, [5, 9, 2], spec, torch.tensor([4, 4, 2]), [3, 2, 2, 2, 3], [10, 20, 5])),
        (MsgType.BEGIN_ROUND, BeginRoundMsg(23, [5], spec[:1], torch.tensor([4]), [3, 2, 2, 2, 3], [10], grid_shard=2)),
        (MsgType.RESOLVE, ResolveMsg(17, [5, 9, 2], torch.tensor([0, 4, 2]), torch.tensor([250, 1, 0]), True)),
        (MsgType.RESOLVE, ResolveMsg(18, [9], torch.tensor([3]), torch.tensor([7]), False, [2, 1, 1, 1, 3])),
        (
            MsgType.RESOLVE,
            ResolveMsg(24, [5, 9], torch.tensor([1, 0]), torch.tensor([3, 8]), True, [4, 1, 1, 1, 1], [2, 0], 3),
        ),
        (
            MsgType.GRID,
            GridMsg(
                23, [5, 9], torch.tensor([[0, 0, 1, 2], [0, 1, 1, 4]]), torch.tensor([[7, 250, 3, 0], [1, 2, 3, 9]])
            ),
        ),
        (MsgType.NEURAL_BACKUP, NeuralBackupMsg(19, [2, 5], [True, False])),
        (
            MsgType.REPLY,
            SpeculationReply(
                17,
                [5, 9, 2],
                torch.tensor([True, False, True]),
                torch.randint(11, (3, 4), generator=gen),
                torch.rand(3, 4, 11, generator=gen),
                torch.tensor([4, 0, 4]),
                0.25,
                counters,
                covered=torch.tensor([True, True, True]),
                bonus_rank=torch.tensor([0, 128, -1]),
            ),
        ),  # fmt: skip
        (
            MsgType.NEURAL_BACKUP_REPLY,
            SpeculationReply(
                20,
                [1],
                torch.tensor([False]),
                torch.zeros(1, 4, dtype=torch.long),
                None,  # no row with a speculation: no distributions (decoded as None)
                torch.tensor([0]),
                build_seconds=0.125,
                covered=torch.tensor([False]),
            ),
        ),  # fmt: skip
        (
            MsgType.REPLY,
            SpeculationReply(
                22,
                [1, 2, 3, 4],
                torch.tensor([True, False, False, False]),
                torch.randint(11, (4, 4), generator=gen),
                mixed_layout_probs(gen),
                torch.tensor([3, 4, 0, 4]),
                covered=torch.tensor([True, True, False, False]),
            ),
        ),  # fmt: skip
        (
            MsgType.REPLY,
            SpeculationReply(
                23,
                [7, 8],
                torch.tensor([True, False]),
                torch.tensor([[3, 1, 4, 1], [5, 9, 2, 6]]),
                None,
                torch.tensor([4, 2]),
                covered=torch.tensor([True, False]),
                greedy=torch.tensor([True, True]),
            ),
        ),  # fmt: skip
        (
            MsgType.NEURAL_BACKUP_REPLY,
            SpeculationReply(
                24,
                [7, 8, 9],
                torch.tensor([False, False, False]),
                torch.randint(11, (3, 4), generator=gen),
                mixed_layout_probs(gen)[1:],
                torch.tensor([4, 4, 0]),
                covered=torch.tensor([False, False, False]),
                greedy=torch.tensor([False, True, False]),
            ),
        ),  # fmt: skip
        (MsgType.ERROR, ErrorMsg("OutOfSync: round 3: the target has [10] committed tokens, this worker [9] — é")),
        (MsgType.READY, None),
        (MsgType.SHUTDOWN, None),
    ]


def same_message(a, b) -> bool:
    """Whether b is a's exact copy: same class, every field equal (tensors of the same dtype), but
    a reply's `greedy`, which the wire carries as the form of those rows with a speculation."""
    if a is None or b is None:
        return a is b
    if type(a) is not type(b):
        return False
    for f in dataclasses.fields(a):
        if isinstance(a, SpeculationReply) and f.name == "greedy":
            if not torch.equal(_greedy_with_speculation(a), _greedy_with_speculation(b)):
                return False
            continue
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            if not (isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)):
                return False
        elif isinstance(x, (list, tuple)):
            if list(x) != list(y):
                return False
        elif x != y:
            return False
    return True


def _greedy_with_speculation(reply: SpeculationReply) -> torch.Tensor:
    """[b] bool: the rows a reply marks greedy that carry a speculation (the wire's GREEDY rows)."""
    marked = reply.greedy if reply.greedy is not None else torch.zeros_like(reply.hit)
    return marked & (reply.num_draft > 0)
