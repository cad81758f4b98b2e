"""Fixed tensor layout of drafter messages on a torch.distributed pair (no pickle).

Each message is a header int64[8] followed by an int64 body and a float32 body whose lengths
the header gives; the transport carries both bodies as one byte buffer (none when both are
empty): two transfers on a gloo pair, one byte stream on the shared-memory channel.
    header = [MAGIC, type, round_id, n_ints, n_floats, fingerprint, 0, 0]
The fingerprint ties both ends to one configuration (target vocabulary, K, draft model), so a
message from a foreign or stale peer is refused. Body layouts per type are in _encode/_decode.
"""

from __future__ import annotations

import enum
import zlib
from dataclasses import dataclass, field

import torch

from ssd.transport.messages import (
    AdmitMsg,
    BeginRoundMsg,
    DrafterCounters,
    DraftNowMsg,
    ReleaseMsg,
    ResolveMsg,
    SpeculationReply,
)

MAGIC = 0x55D0_0003  # 3: replies carry the bonus token's rank per row (2: the drafter's high-water marks)
HEADER = 8


class MsgType(enum.IntEnum):
    ADMIT = 1
    RELEASE = 2
    BEGIN_ROUND = 3
    RESOLVE = 4
    DRAFT_NOW = 5
    REPLY = 6
    READY = 7
    ERROR = 8
    SHUTDOWN = 9
    PREDICT = 10  # a BeginRoundMsg the target expects to announce next: begin it, confirm it later
    JOIN = 11  # ints [shard, num_shards]: which share of the branch grid this worker builds
    DRAFT_REPLY = 12  # a SpeculationReply answering DRAFT_NOW (REPLY answers RESOLVE; both carry the round id)


@dataclass
class WireCounts:
    """Frame bytes one channel end has sent and received, by message type (MsgType name): the
    64-byte header plus both bodies, i.e. the frame as laid out here, which every transport
    carries (gRPC's own encoding of the header fields and HTTP/2 framing are not counted).
    Counted as frames go out and come in, so a pool's figures are what its data plane moved."""

    sent: dict[str, int] = field(default_factory=dict)
    received: dict[str, int] = field(default_factory=dict)

    def on_send(self, kind: int, body_bytes: int) -> None:
        name = MsgType(kind).name
        self.sent[name] = self.sent.get(name, 0) + HEADER * 8 + body_bytes

    def on_receive(self, kind: int, body_bytes: int) -> None:
        name = MsgType(kind).name
        self.received[name] = self.received.get(name, 0) + HEADER * 8 + body_bytes

    def __add__(self, other: "WireCounts") -> "WireCounts":
        def merged(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
            return {name: a.get(name, 0) + b.get(name, 0) for name in sorted(a.keys() | b.keys())}

        return WireCounts(merged(self.sent, other.sent), merged(self.received, other.received))


def fingerprint(*parts) -> int:
    return zlib.crc32(repr(parts).encode()) & 0x7FFF_FFFF


class ForeignMessage(RuntimeError):
    """A header that does not carry this pair's magic and fingerprint."""


def frame(
    kind: MsgType, round_id: int, ints: torch.Tensor, floats: torch.Tensor, fp: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (header int64 [HEADER], body uint8 [8 n_ints + 4 n_floats])"""
    header = torch.tensor([MAGIC, int(kind), round_id, ints.numel(), floats.numel(), fp, 0, 0], dtype=torch.long)
    body = torch.cat([ints.contiguous().view(torch.uint8), floats.contiguous().float().view(torch.uint8)])
    return header, body


def body_size(header: torch.Tensor, fp: int) -> int:
    """Bytes of body that follow `header`; ForeignMessage when it is not this pair's."""
    magic, _, _, n_ints, n_floats, got = header[:6].tolist()
    if magic != MAGIC or got != fp:
        raise ForeignMessage(f"foreign message on the drafter channel (magic {magic:#x}, fingerprint {got})")
    return n_ints * 8 + n_floats * 4


def unframe(header: torch.Tensor, body: torch.Tensor):
    """-> (MsgType, message or None for bodiless control messages, ints)"""
    _, kind, round_id, n_ints, _ = header[:5].tolist()
    ints = body[: n_ints * 8].view(torch.long)
    floats = body[n_ints * 8 :].view(torch.float32)
    kind = MsgType(kind)
    if kind in (MsgType.READY, MsgType.ERROR, MsgType.SHUTDOWN, MsgType.JOIN):
        return kind, None, ints
    return kind, decode(kind, round_id, ints, floats), ints


class _Reader:
    def __init__(self, ints: torch.Tensor) -> None:
        self.ints, self.pos = ints, 0

    def take(self, n: int) -> torch.Tensor:
        out = self.ints[self.pos : self.pos + n]
        self.pos += n
        return out

    def one(self) -> int:
        return int(self.take(1))


def _i(*parts) -> torch.Tensor:
    flat = [torch.as_tensor(p, dtype=torch.long).reshape(-1) for p in parts]
    return torch.cat(flat) if flat else torch.zeros(0, dtype=torch.long)


def encode(msg) -> tuple[MsgType, int, torch.Tensor, torch.Tensor]:
    """-> (type, round_id, ints [n], floats [m])"""
    none = torch.zeros(0)
    if isinstance(msg, AdmitMsg):
        b = len(msg.seq_ids)
        ints = _i([b], msg.seq_ids, msg.seeds, msg.top_k, [len(p) for p in msg.prompts], *msg.prompts)
        return MsgType.ADMIT, 0, ints, torch.tensor(list(msg.temperature) + list(msg.top_p), dtype=torch.float32)
    if isinstance(msg, ReleaseMsg):
        return MsgType.RELEASE, 0, _i(msg.seq_ids), none
    if isinstance(msg, BeginRoundMsg):
        b, k = msg.spec_tokens.shape
        ints = _i(
            [b, k],
            msg.seq_ids,
            msg.num_draft,
            [len(msg.fanout)],
            msg.fanout,
            [len(msg.committed)],
            msg.committed,
            msg.spec_tokens,
        )
        return MsgType.BEGIN_ROUND, msg.round_id, ints, none
    if isinstance(msg, ResolveMsg):
        ints = _i(
            [len(msg.seq_ids), int(msg.neural_backup)],
            msg.seq_ids,
            msg.num_accepted,
            msg.bonus_tokens,
            [len(msg.next_fanout)],
            msg.next_fanout,
        )
        return MsgType.RESOLVE, msg.round_id, ints, none
    if isinstance(msg, DraftNowMsg):
        return MsgType.DRAFT_NOW, msg.round_id, _i([len(msg.seq_ids)], msg.seq_ids, [int(x) for x in msg.need]), none
    if isinstance(msg, SpeculationReply):
        b, k = msg.tokens.shape
        covered = msg.hit if msg.covered is None else msg.covered
        layout, values = pack_probs(msg.probs)
        rank = torch.full((b,), -1, dtype=torch.long) if msg.bonus_rank is None else msg.bonus_rank
        ints = _i(
            [b, k, msg.probs.shape[-1]],
            msg.seq_ids,
            msg.hit.long(),
            covered.long(),
            rank,
            msg.num_draft,
            msg.tokens,
            msg.counters.as_list(),
            layout,
        )
        floats = torch.cat([torch.tensor([msg.build_seconds], dtype=torch.float32), values])
        return MsgType.REPLY, msg.round_id, ints, floats
    raise TypeError(f"not a drafter message: {type(msg).__name__}")


# How a reply row's draft probabilities [K, V] travel (lossless: decoding rebuilds the very
# tensor the drafter sampled from). At a 128k vocabulary a dense row is 3 MB per round.
ZERO, ONE_HOT, SPARSE, DENSE = 0, 1, 2, 3


def pack_probs(probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """probs [b, K, V] float32 -> (layout ints, values float32), per row the smallest exact form:
        ZERO      no speculation in the row (all zeros): nothing
        ONE_HOT   greedy rows: each position is 0 or a single 1.0: K token ids (-1 = none)
        SPARSE    top-k / top-p rows: K support sizes, the support's ids, their probabilities
        DENSE     the K x V probabilities
    layout = per row [form, then its ints]."""
    b, k, vocab = probs.shape
    ints: list[torch.Tensor] = []
    vals: list[torch.Tensor] = []
    for row in probs.float():
        nonzero = row > 0  # [K, V]
        counts = nonzero.sum(-1)  # [K]
        widest = int(counts.max()) if k else 0
        if widest == 0:
            ints.append(torch.tensor([ZERO]))
        elif widest == 1 and bool((row[nonzero] == 1.0).all()):
            ids = torch.where(counts > 0, row.argmax(-1), -1)
            ints.append(torch.cat([torch.tensor([ONE_HOT]), ids]))
        elif int(counts.sum()) * 3 < k * vocab:  # 8-byte id + 4-byte value per entry beats 4 bytes per entry
            pos, ids = nonzero.nonzero(as_tuple=True)
            ints.append(torch.cat([torch.tensor([SPARSE]), counts, ids]))
            vals.append(row[pos, ids])
        else:
            ints.append(torch.tensor([DENSE]))
            vals.append(row.reshape(-1))
    layout = torch.cat(ints).long() if ints else torch.zeros(0, dtype=torch.long)
    return layout, torch.cat(vals) if vals else torch.zeros(0)


def unpack_probs(r: "_Reader", values: torch.Tensor, b: int, k: int, vocab: int) -> torch.Tensor:
    """The inverse of pack_probs: layout read from `r`, values from `values` -> [b, K, V]."""
    probs = torch.zeros(b, k, vocab)
    at = 0
    for row in range(b):
        form = r.one()
        if form == ONE_HOT:
            ids = r.take(k)
            pos = (ids >= 0).nonzero(as_tuple=True)[0]
            probs[row, pos, ids[pos]] = 1.0
        elif form == SPARSE:
            counts = r.take(k)
            n = int(counts.sum())
            ids = r.take(n)
            pos = torch.repeat_interleave(torch.arange(k), counts)
            probs[row, pos, ids] = values[at : at + n]
            at += n
        elif form == DENSE:
            probs[row] = values[at : at + k * vocab].view(k, vocab)
            at += k * vocab
        elif form != ZERO:
            raise ValueError(f"unknown probability layout {form} in a reply")
    return probs


def decode(kind: MsgType, round_id: int, ints: torch.Tensor, floats: torch.Tensor):
    r = _Reader(ints)
    if kind == MsgType.ADMIT:
        b = r.one()
        seq_ids, seeds, top_k, lens = r.take(b).tolist(), r.take(b).tolist(), r.take(b).tolist(), r.take(b).tolist()
        prompts = [r.take(n).tolist() for n in lens]
        return AdmitMsg(seq_ids, prompts, seeds, floats[:b].tolist(), top_k, floats[b : 2 * b].tolist())
    if kind == MsgType.RELEASE:
        return ReleaseMsg(ints.tolist())
    if kind in (MsgType.BEGIN_ROUND, MsgType.PREDICT):
        b, k = r.one(), r.one()
        seq_ids, num_draft = r.take(b).tolist(), r.take(b).clone()
        fanout = r.take(r.one()).tolist()
        committed = r.take(r.one()).tolist()
        return BeginRoundMsg(round_id, seq_ids, r.take(b * k).view(b, k).clone(), num_draft, fanout, committed)
    if kind == MsgType.RESOLVE:
        b, neural = r.one(), bool(r.one())
        seq_ids, accepted, bonus = r.take(b).tolist(), r.take(b).clone(), r.take(b).clone()
        return ResolveMsg(round_id, seq_ids, accepted, bonus, neural, r.take(r.one()).tolist())
    if kind == MsgType.DRAFT_NOW:
        b = r.one()
        return DraftNowMsg(round_id, r.take(b).tolist(), [bool(x) for x in r.take(b).tolist()])
    if kind in (MsgType.REPLY, MsgType.DRAFT_REPLY):
        b, k, v = r.one(), r.one(), r.one()
        seq_ids, hit, covered = r.take(b).tolist(), r.take(b).bool(), r.take(b).bool()
        rank, num_draft = r.take(b).clone(), r.take(b).clone()
        tokens = r.take(b * k).view(b, k).clone()
        counters = DrafterCounters(*r.take(len(DrafterCounters().as_list())).tolist())
        probs = unpack_probs(r, floats[1:], b, k, v)
        rank = None if bool((rank < 0).all()) else rank  # -1: unknown, as None is
        return SpeculationReply(
            round_id, seq_ids, hit, tokens, probs, num_draft, float(floats[0]), counters, covered, rank
        )
    raise ValueError(f"unexpected message type {kind!r}")
