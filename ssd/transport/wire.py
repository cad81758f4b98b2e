"""The fixed tensor layout of drafter messages on every transport (no pickle).

Each message is a header int64[8] followed by an int64 body and a float32 body whose lengths
the header gives; the transport carries both bodies as one byte buffer (none when both are
empty): two transfers on a torch.distributed pair, one byte stream on the shared-memory
channel, two byte fields of a gRPC frame.
    header = [MAGIC, kind, round_id, n_ints, n_floats, fingerprint, 0, 0]
The kind (ssd.core.protocol.MsgType) is given by the sender, never inferred from the message;
the fingerprint ties both ends to one configuration (ssd.core.config.config_fingerprint), so a
message from a foreign or stale peer is refused. Body layouts per kind are in _CODECS.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

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
from ssd.transport.body import BodyReader, flat_ints
from ssd.transport.reply_probs import pack_probs, unpack_probs

# 10: RESOLVE says which rows the target took off the answering shard's board, and how deep;
# 9: pools answer per row (BEGIN_ROUND names a grid shard, RESOLVE the answering shards; GRID);
# 8: replies' counters count first speculations drafted at admission (7: where builds' time goes;
# 6: greedy reply rows travel as their tokens alone; 5: admissions carry each sequence's logits
# processing; 4: its grammar; 3: replies carry the bonus token's rank)
MAGIC = 0x55D0_000A
HEADER = 8


@dataclass
class WireCounts:
    """Frame bytes one channel end has sent and received, by message kind (MsgType name): the
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

    def __add__(self, other: WireCounts) -> WireCounts:
        def merged(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
            return {name: a.get(name, 0) + b.get(name, 0) for name in sorted(a.keys() | b.keys())}

        return WireCounts(merged(self.sent, other.sent), merged(self.received, other.received))


class ForeignMessage(RuntimeError):
    """A header that does not carry this pair's magic and fingerprint."""


def frame(kind: MsgType, msg, fp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A message of `kind` (None for READY and SHUTDOWN) -> (header int64 [HEADER], body uint8
    [8 n_ints + 4 n_floats])."""
    round_id, ints, floats = encode(kind, msg)
    header = torch.tensor([MAGIC, int(kind), round_id, ints.numel(), floats.numel(), fp, 0, 0], dtype=torch.long)
    body = torch.cat([ints.contiguous().view(torch.uint8), floats.contiguous().float().view(torch.uint8)])
    return header, body


def body_size(header: torch.Tensor, fp: int) -> int:
    """Bytes of body that follow `header`; ForeignMessage when it is not this pair's."""
    magic, _, _, n_ints, n_floats, got = header[:6].tolist()
    if magic != MAGIC or got != fp:
        raise ForeignMessage(f"foreign message on the drafter channel (magic {magic:#x}, fingerprint {got})")
    return n_ints * 8 + n_floats * 4


def unframe(header: torch.Tensor, body: torch.Tensor) -> tuple[MsgType, object]:
    """-> (kind, message; None for READY and SHUTDOWN)"""
    _, kind, round_id, n_ints, _ = header[:5].tolist()
    ints = body[: n_ints * 8].view(torch.long)
    floats = body[n_ints * 8 :].view(torch.float32)
    return decode(MsgType(kind), round_id, ints, floats)


_NONE = torch.zeros(0)
_NO_INTS = torch.zeros(0, dtype=torch.long)


@dataclass(frozen=True)
class Encoded:
    """A message encoded once for several channels: a pool sends each round and its outcome to
    every worker, and a channel given this in place of the message sends its bodies as they are."""

    kind: MsgType
    round_id: int
    ints: torch.Tensor  # [n] long
    floats: torch.Tensor  # [m] float32
    # fingerprint -> the framed bytes (header and body, uint8): a pool's channels share one
    # fingerprint, so every mailbox of the pool is sent the same bytes, framed once.
    frames: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, kind: MsgType, msg) -> Encoded:
        return cls(kind, *encode(kind, msg))


def framed(kind: MsgType, msg, fp: int) -> torch.Tensor:
    """frame() as one uint8 tensor [8 HEADER + body], framed once per fingerprint for an Encoded."""
    if isinstance(msg, Encoded) and fp in msg.frames:
        return msg.frames[fp]
    header, body = frame(kind, msg, fp)
    out = torch.cat([header.view(torch.uint8), body])
    if isinstance(msg, Encoded):
        msg.frames[fp] = out
    return out


def encode(kind: MsgType, msg) -> tuple[int, torch.Tensor, torch.Tensor]:
    """-> (round_id, ints [n] long, floats [m] float32) of a message of `kind` (or of its Encoded form)."""
    if isinstance(msg, Encoded):
        assert msg.kind == kind, f"a {msg.kind.name} encoding sent as {kind.name}"
        return msg.round_id, msg.ints, msg.floats
    encoder, _, cls = _CODECS[kind]
    if (msg is None) != (cls is None) or (cls is not None and not isinstance(msg, cls)):
        raise TypeError(f"a {kind.name} message is {cls.__name__ if cls else 'None'}, not {type(msg).__name__}")
    return encoder(msg)


def decode(kind: MsgType, round_id: int, ints: torch.Tensor, floats: torch.Tensor) -> tuple[MsgType, object]:
    """The inverse of encode: -> (kind, message)."""
    return kind, _CODECS[kind][1](BodyReader(ints), round_id, floats)


def _encode_admit(msg: AdmitMsg):
    b = len(msg.seq_ids)
    s = msg.sampling
    grammars = [x.grammar.encode() for x in s]
    procs = [_encode_processing(x.processing) for x in s]
    ints = flat_ints(
        [b], msg.seq_ids, msg.seeds, [x.top_k for x in s], [len(t) for t in msg.tokens], *msg.tokens,
        [len(g) for g in grammars], [x.output_from for x in s], [x.grammar_eos for x in s], *map(_text, grammars),
        *(i for i, _ in procs),
    )  # fmt: skip
    floats = [x.temperature for x in s] + [x.top_p for x in s] + [f for _, fs in procs for f in fs]
    return 0, ints, torch.tensor(floats, dtype=torch.float32)


def _decode_admit(r: BodyReader, round_id: int, floats: torch.Tensor) -> AdmitMsg:
    b = r.one()
    seq_ids, seeds, top_k, lens = r.take_list(b), r.take_list(b), r.take_list(b), r.take_list(b)
    tokens = [r.take_list(n) for n in lens]
    grammar_lens, output_from, grammar_eos = r.take_list(b), r.take_list(b), r.take_list(b)
    grammars = [_untext(r.take((n + 7) // 8), n) for n in grammar_lens]
    temperature, top_p = floats[:b].tolist(), floats[b : 2 * b].tolist()
    values = BodyReader(floats[2 * b :])
    procs = [_decode_processing(r, values) for _ in range(b)]
    fields = zip(temperature, top_k, top_p, grammars, output_from, grammar_eos, procs)
    return AdmitMsg(seq_ids, tokens, seeds, [SequenceSampling(*x) for x in fields])


def _encode_processing(p: Processing) -> tuple[torch.Tensor, list[float]]:
    """-> (ints, floats) of one sequence's processing:
    ints   = [min_tokens, n_bias, n_allowed (-1: None), n_stops, n_words, len(word) per word,
              bias ids, allowed ids, stop ids, the words' tokens]
    floats = [repetition, frequency, presence, min_p, bias values]
    Bounded by the request's own bounds (300 biased tokens, 64 words of 256 characters) and the
    vocabulary (allowed and stop ids are unique)."""
    allowed = p.allowed_token_ids
    ints = flat_ints(
        [p.min_tokens, len(p.logit_bias), -1 if allowed is None else len(allowed), len(p.stop_token_ids)],
        [len(p.bad_words)], [len(w) for w in p.bad_words], list(p.logit_bias), allowed or [], p.stop_token_ids,
        *p.bad_words,
    )  # fmt: skip
    floats = [p.repetition_penalty, p.frequency_penalty, p.presence_penalty, p.min_p, *p.logit_bias.values()]
    return ints, floats


def _decode_processing(r: BodyReader, values: BodyReader) -> Processing:
    min_tokens, n_bias, n_allowed, n_stops, n_words = r.take_list(5)
    word_lens = r.take_list(n_words)
    bias_ids = r.take_list(n_bias)
    allowed = tuple(r.take_list(n_allowed)) if n_allowed >= 0 else None
    stops = tuple(r.take_list(n_stops))
    words = tuple(tuple(r.take_list(n)) for n in word_lens)
    repetition, frequency, presence, min_p = values.take_list(4)
    bias = dict(zip(bias_ids, values.take_list(n_bias)))
    return Processing(repetition, frequency, presence, min_p, min_tokens, bias, allowed, stops, words)


def _text(data: bytes) -> torch.Tensor:
    """UTF-8 bytes packed 8 to an int64 (zero-padded): a grammar's text in the int body."""
    padded = bytearray(data) + bytes(-len(data) % 8)
    return torch.frombuffer(padded, dtype=torch.int64) if padded else _NO_INTS


def _untext(ints: torch.Tensor, n: int) -> str:
    return ints.numpy().tobytes()[:n].decode()


def _encode_round(msg: BeginRoundMsg):
    b, k = msg.spec_tokens.shape
    ints = flat_ints(
        [b, k, msg.grid_shard], msg.seq_ids, msg.num_draft, [len(msg.fanout)], msg.fanout, [len(msg.committed)],
        msg.committed, msg.spec_tokens,
    )  # fmt: skip
    return msg.round_id, ints, _NONE


def _decode_round(r: BodyReader, round_id: int, floats: torch.Tensor) -> BeginRoundMsg:
    b, k, grid_shard = r.one(), r.one(), r.one()
    seq_ids, num_draft = r.take_list(b), r.take(b).clone()
    fanout = r.take_list(r.one())
    committed = r.take_list(r.one())
    spec_tokens = r.take(b * k).view(b, k).clone()
    return BeginRoundMsg(round_id, seq_ids, spec_tokens, num_draft, fanout, committed, grid_shard)


def _encode_resolve(msg: ResolveMsg):
    ints = flat_ints(
        [len(msg.seq_ids), int(msg.neural_backup), msg.backup_shard], msg.seq_ids, msg.num_accepted,
        msg.bonus_tokens, [len(msg.next_fanout)], msg.next_fanout, [len(msg.answering)], msg.answering,
        [len(msg.taken)], msg.taken,
    )  # fmt: skip
    return msg.round_id, ints, _NONE


def _decode_resolve(r: BodyReader, round_id: int, floats: torch.Tensor) -> ResolveMsg:
    b, neural, backup = r.one(), bool(r.one()), r.one()
    seq_ids, accepted, bonus = r.take_list(b), r.take(b).clone(), r.take(b).clone()
    next_fanout = r.take_list(r.one())
    answering = r.take_list(r.one())
    return ResolveMsg(round_id, seq_ids, accepted, bonus, neural, next_fanout, answering, backup, r.take_list(r.one()))


def _encode_grid(msg: GridMsg):
    b, n = msg.candidates.shape
    return msg.round_id, flat_ints([b, n], msg.seq_ids, msg.outcome, msg.candidates), _NONE


def _decode_grid(r: BodyReader, round_id: int, floats: torch.Tensor) -> GridMsg:
    b, n = r.one(), r.one()
    seq_ids = r.take_list(b)
    return GridMsg(round_id, seq_ids, r.take(b * n).view(b, n).clone(), r.take(b * n).view(b, n).clone())


def _encode_neural_backup(msg: NeuralBackupMsg):
    return msg.round_id, flat_ints([len(msg.seq_ids)], msg.seq_ids, [int(x) for x in msg.need]), _NONE


def _decode_neural_backup(r: BodyReader, round_id: int, floats: torch.Tensor) -> NeuralBackupMsg:
    b = r.one()
    return NeuralBackupMsg(round_id, r.take_list(b), [bool(x) for x in r.take_list(b)])


def _encode_reply(msg: SpeculationReply):
    b, k = msg.tokens.shape
    covered = msg.hit if msg.covered is None else msg.covered
    layout, values = pack_probs(msg.probs, msg.tokens, msg.num_draft, msg.greedy)
    rank = [-1] * b if msg.bonus_rank is None else msg.bonus_rank
    vocab = 0 if msg.probs is None else msg.probs.shape[-1]  # 0: no row's distribution travels
    ints = flat_ints(
        [b, k, vocab], msg.seq_ids, msg.hit, covered, rank, msg.num_draft, msg.tokens, msg.counters.as_list(), layout,
    )  # fmt: skip
    seconds = torch.tensor([msg.build_seconds], dtype=torch.float32)
    return msg.round_id, ints, torch.cat([seconds, values]) if values.numel() else seconds


def _decode_reply(r: BodyReader, round_id: int, floats: torch.Tensor) -> SpeculationReply:
    b, k, v = r.one(), r.one(), r.one()
    seq_ids, hit, covered = r.take_list(b), r.take(b).bool(), r.take(b).bool()
    ranks, num_draft = r.take_list(b), r.take(b).clone()
    tokens = r.take(b * k).view(b, k).clone()
    counters = DrafterCounters(*r.take_list(len(DrafterCounters().as_list())))
    seconds = BodyReader(floats)
    build_seconds = seconds.one()
    probs, greedy = unpack_probs(r, floats[1:], b, k, v)
    rank = None if all(x < 0 for x in ranks) else torch.tensor(ranks, dtype=torch.long)  # -1: unknown, as None is
    return SpeculationReply(
        round_id, seq_ids, hit, tokens, probs, num_draft, build_seconds, counters, covered, rank, greedy
    )


def _encode_error(msg: ErrorMsg):
    return 0, torch.tensor(list(msg.text.encode()[:4000]), dtype=torch.long), _NONE


def _decode_error(r: BodyReader, round_id: int, floats: torch.Tensor) -> ErrorMsg:
    return ErrorMsg(bytes(r.ints.tolist()).decode("utf-8", errors="replace"))


# kind -> (encode(msg) -> (round_id, ints, floats), decode(reader, round_id, floats) -> msg, message class)
_CODECS: dict[MsgType, tuple[Callable, Callable, type | None]] = {
    MsgType.ADMIT: (_encode_admit, _decode_admit, AdmitMsg),
    MsgType.RELEASE: (
        lambda m: (0, flat_ints(m.seq_ids), _NONE),
        lambda r, _, f: ReleaseMsg(r.ints.tolist()),
        ReleaseMsg,
    ),
    MsgType.JOIN: (
        lambda m: (0, flat_ints([m.shard, m.num_shards]), _NONE),
        lambda r, _, f: JoinMsg(r.one(), r.one()),
        JoinMsg,
    ),
    MsgType.BEGIN_ROUND: (_encode_round, _decode_round, BeginRoundMsg),
    MsgType.PREDICT: (_encode_round, _decode_round, BeginRoundMsg),
    MsgType.RESOLVE: (_encode_resolve, _decode_resolve, ResolveMsg),
    MsgType.GRID: (_encode_grid, _decode_grid, GridMsg),
    MsgType.NEURAL_BACKUP: (_encode_neural_backup, _decode_neural_backup, NeuralBackupMsg),
    MsgType.REPLY: (_encode_reply, _decode_reply, SpeculationReply),
    MsgType.NEURAL_BACKUP_REPLY: (_encode_reply, _decode_reply, SpeculationReply),
    MsgType.ERROR: (_encode_error, _decode_error, ErrorMsg),
    MsgType.READY: (lambda m: (0, _NO_INTS, _NONE), lambda r, _, f: None, None),
    MsgType.SHUTDOWN: (lambda m: (0, _NO_INTS, _NONE), lambda r, _, f: None, None),
}
