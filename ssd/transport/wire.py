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

from ssd.core.logits_processing import Processing
from ssd.core.protocol import (
    AdmitMsg,
    BeginRoundMsg,
    DrafterCounters,
    DraftNowMsg,
    ErrorMsg,
    JoinMsg,
    MsgType,
    ReleaseMsg,
    ResolveMsg,
    SpeculationReply,
)
from ssd.core.sampling import SequenceSampling

# 6: greedy reply rows travel as their tokens alone (5: admissions carry each sequence's logits
# processing; 4: its grammar; 3: replies carry the bonus token's rank)
MAGIC = 0x55D0_0007
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


_NONE = torch.zeros(0)
_NO_INTS = torch.zeros(0, dtype=torch.long)


def encode(kind: MsgType, msg) -> tuple[int, torch.Tensor, torch.Tensor]:
    """-> (round_id, ints [n] long, floats [m] float32) of a message of `kind`."""
    encoder, _, cls = _CODECS[kind]
    if (msg is None) != (cls is None) or (cls is not None and not isinstance(msg, cls)):
        raise TypeError(f"a {kind.name} message is {cls.__name__ if cls else 'None'}, not {type(msg).__name__}")
    return encoder(msg)


def decode(kind: MsgType, round_id: int, ints: torch.Tensor, floats: torch.Tensor) -> tuple[MsgType, object]:
    """The inverse of encode: -> (kind, message)."""
    return kind, _CODECS[kind][1](_Reader(ints), round_id, floats)


def _encode_admit(msg: AdmitMsg):
    b = len(msg.seq_ids)
    s = msg.sampling
    grammars = [x.grammar.encode() for x in s]
    procs = [_encode_processing(x.processing) for x in s]
    ints = _i(
        [b], msg.seq_ids, msg.seeds, [x.top_k for x in s], [len(p) for p in msg.prompts], *msg.prompts,
        [len(g) for g in grammars], [x.output_from for x in s], [x.grammar_eos for x in s], *map(_text, grammars),
        *(i for i, _ in procs),
    )  # fmt: skip
    floats = [x.temperature for x in s] + [x.top_p for x in s] + [f for _, fs in procs for f in fs]
    return 0, ints, torch.tensor(floats, dtype=torch.float32)


def _decode_admit(r: _Reader, round_id: int, floats: torch.Tensor) -> AdmitMsg:
    b = r.one()
    seq_ids, seeds, top_k, lens = r.take(b).tolist(), r.take(b).tolist(), r.take(b).tolist(), r.take(b).tolist()
    prompts = [r.take(n).tolist() for n in lens]
    grammar_lens, output_from, grammar_eos = r.take(b).tolist(), r.take(b).tolist(), r.take(b).tolist()
    grammars = [_untext(r.take((n + 7) // 8), n) for n in grammar_lens]
    temperature, top_p = floats[:b].tolist(), floats[b : 2 * b].tolist()
    values = _Reader(floats[2 * b :])
    procs = [_decode_processing(r, values) for _ in range(b)]
    fields = zip(temperature, top_k, top_p, grammars, output_from, grammar_eos, procs)
    return AdmitMsg(seq_ids, prompts, seeds, [SequenceSampling(*x) for x in fields])


def _encode_processing(p: Processing) -> tuple[torch.Tensor, list[float]]:
    """-> (ints, floats) of one sequence's processing:
    ints   = [min_tokens, n_bias, n_allowed (-1: None), n_stops, n_words, len(word) per word,
              bias ids, allowed ids, stop ids, the words' tokens]
    floats = [repetition, frequency, presence, min_p, bias values]
    Bounded by the request's own bounds (300 biased tokens, 64 words of 256 characters) and the
    vocabulary (allowed and stop ids are unique)."""
    allowed = p.allowed_token_ids
    ints = _i(
        [p.min_tokens, len(p.logit_bias), -1 if allowed is None else len(allowed), len(p.stop_token_ids)],
        [len(p.bad_words)], [len(w) for w in p.bad_words], list(p.logit_bias), allowed or [], p.stop_token_ids,
        *p.bad_words,
    )  # fmt: skip
    floats = [p.repetition_penalty, p.frequency_penalty, p.presence_penalty, p.min_p, *p.logit_bias.values()]
    return ints, floats


def _decode_processing(r: _Reader, values: _Reader) -> Processing:
    min_tokens, n_bias, n_allowed, n_stops, n_words = r.take(5).tolist()
    word_lens = r.take(n_words).tolist()
    bias_ids = r.take(n_bias).tolist()
    allowed = tuple(r.take(n_allowed).tolist()) if n_allowed >= 0 else None
    stops = tuple(r.take(n_stops).tolist())
    words = tuple(tuple(r.take(n).tolist()) for n in word_lens)
    repetition, frequency, presence, min_p = values.take(4).tolist()
    bias = dict(zip(bias_ids, values.take(n_bias).tolist()))
    return Processing(repetition, frequency, presence, min_p, min_tokens, bias, allowed, stops, words)


def _text(data: bytes) -> torch.Tensor:
    """UTF-8 bytes packed 8 to an int64 (zero-padded): a grammar's text in the int body."""
    padded = bytearray(data) + bytes(-len(data) % 8)
    return torch.frombuffer(padded, dtype=torch.int64) if padded else _NO_INTS


def _untext(ints: torch.Tensor, n: int) -> str:
    return ints.numpy().tobytes()[:n].decode()


def _encode_round(msg: BeginRoundMsg):
    b, k = msg.spec_tokens.shape
    ints = _i(
        [b, k], msg.seq_ids, msg.num_draft, [len(msg.fanout)], msg.fanout, [len(msg.committed)], msg.committed,
        msg.spec_tokens,
    )  # fmt: skip
    return msg.round_id, ints, _NONE


def _decode_round(r: _Reader, round_id: int, floats: torch.Tensor) -> BeginRoundMsg:
    b, k = r.one(), r.one()
    seq_ids, num_draft = r.take(b).tolist(), r.take(b).clone()
    fanout = r.take(r.one()).tolist()
    committed = r.take(r.one()).tolist()
    return BeginRoundMsg(round_id, seq_ids, r.take(b * k).view(b, k).clone(), num_draft, fanout, committed)


def _encode_resolve(msg: ResolveMsg):
    ints = _i(
        [len(msg.seq_ids), int(msg.neural_backup)], msg.seq_ids, msg.num_accepted, msg.bonus_tokens,
        [len(msg.next_fanout)], msg.next_fanout,
    )  # fmt: skip
    return msg.round_id, ints, _NONE


def _decode_resolve(r: _Reader, round_id: int, floats: torch.Tensor) -> ResolveMsg:
    b, neural = r.one(), bool(r.one())
    seq_ids, accepted, bonus = r.take(b).tolist(), r.take(b).clone(), r.take(b).clone()
    return ResolveMsg(round_id, seq_ids, accepted, bonus, neural, r.take(r.one()).tolist())


def _encode_draft_now(msg: DraftNowMsg):
    return msg.round_id, _i([len(msg.seq_ids)], msg.seq_ids, [int(x) for x in msg.need]), _NONE


def _decode_draft_now(r: _Reader, round_id: int, floats: torch.Tensor) -> DraftNowMsg:
    b = r.one()
    return DraftNowMsg(round_id, r.take(b).tolist(), [bool(x) for x in r.take(b).tolist()])


def _encode_reply(msg: SpeculationReply):
    b, k = msg.tokens.shape
    covered = msg.hit if msg.covered is None else msg.covered
    layout, values = pack_probs(msg.probs, msg.tokens, msg.num_draft, msg.greedy)
    rank = torch.full((b,), -1, dtype=torch.long) if msg.bonus_rank is None else msg.bonus_rank
    vocab = 0 if msg.probs is None else msg.probs.shape[-1]  # 0: no row's distribution travels
    ints = _i(
        [b, k, vocab], msg.seq_ids, msg.hit.long(), covered.long(), rank, msg.num_draft, msg.tokens,
        msg.counters.as_list(), layout,
    )  # fmt: skip
    return msg.round_id, ints, torch.cat([torch.tensor([msg.build_seconds], dtype=torch.float32), values])


def _decode_reply(r: _Reader, round_id: int, floats: torch.Tensor) -> SpeculationReply:
    b, k, v = r.one(), r.one(), r.one()
    seq_ids, hit, covered = r.take(b).tolist(), r.take(b).bool(), r.take(b).bool()
    rank, num_draft = r.take(b).clone(), r.take(b).clone()
    tokens = r.take(b * k).view(b, k).clone()
    counters = DrafterCounters(*r.take(len(DrafterCounters().as_list())).tolist())
    probs, greedy = unpack_probs(r, floats[1:], b, k, v)
    rank = None if bool((rank < 0).all()) else rank  # -1: unknown, as None is
    return SpeculationReply(
        round_id, seq_ids, hit, tokens, probs, num_draft, float(floats[0]), counters, covered, rank, greedy
    )


def _encode_error(msg: ErrorMsg):
    return 0, torch.tensor(list(msg.text.encode()[:4000]), dtype=torch.long), _NONE


def _decode_error(r: _Reader, round_id: int, floats: torch.Tensor) -> ErrorMsg:
    return ErrorMsg(bytes(r.ints.tolist()).decode("utf-8", errors="replace"))


# kind -> (encode(msg) -> (round_id, ints, floats), decode(reader, round_id, floats) -> msg, message class)
_CODECS: dict[MsgType, tuple[Callable, Callable, type | None]] = {
    MsgType.ADMIT: (_encode_admit, _decode_admit, AdmitMsg),
    MsgType.RELEASE: (lambda m: (0, _i(m.seq_ids), _NONE), lambda r, _, f: ReleaseMsg(r.ints.tolist()), ReleaseMsg),
    MsgType.JOIN: (
        lambda m: (0, _i([m.shard, m.num_shards]), _NONE),
        lambda r, _, f: JoinMsg(r.one(), r.one()),
        JoinMsg,
    ),
    MsgType.BEGIN_ROUND: (_encode_round, _decode_round, BeginRoundMsg),
    MsgType.PREDICT: (_encode_round, _decode_round, BeginRoundMsg),
    MsgType.RESOLVE: (_encode_resolve, _decode_resolve, ResolveMsg),
    MsgType.DRAFT_NOW: (_encode_draft_now, _decode_draft_now, DraftNowMsg),
    MsgType.REPLY: (_encode_reply, _decode_reply, SpeculationReply),
    MsgType.DRAFT_REPLY: (_encode_reply, _decode_reply, SpeculationReply),
    MsgType.ERROR: (_encode_error, _decode_error, ErrorMsg),
    MsgType.READY: (lambda m: (0, _NO_INTS, _NONE), lambda r, _, f: None, None),
    MsgType.SHUTDOWN: (lambda m: (0, _NO_INTS, _NONE), lambda r, _, f: None, None),
}


# How a reply row's draft probabilities [K, V] travel: lossless for every row whose distribution
# verification reads (decoding rebuilds the very tensor the drafter sampled from); a greedy row's
# is left out (SpeculationReply.probs). At a 128k vocabulary a dense row is 3 MB per round.
ZERO, ONE_HOT, SPARSE, DENSE, GREEDY = range(5)


def pack_probs(
    probs: torch.Tensor | None,
    tokens: torch.Tensor | None = None,
    num_draft: torch.Tensor | None = None,
    greedy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """probs [b, K, V] float32 (None: every row greedy or without a speculation) -> (layout ints,
    values float32), per row the smallest form:
        ZERO      no speculation in the row (all zeros): nothing
        GREEDY    a greedy row: K token ids (-1 = none); decoded without a distribution (zeros)
        ONE_HOT   a sampled row one-hot at each position: K token ids (-1 = none)
        SPARSE    top-k / top-p rows: K support sizes, the support's ids, their probabilities
        DENSE     the K x V probabilities
    layout = per row [form, then its ints].

    greedy [b] bool (with tokens [b, K] and num_draft [b]) names the greedy rows: those are packed
    from the tokens without reading probs (O(K), where finding the form by scanning costs O(K V):
    milliseconds per row at V = 128k). Positions past num_draft are packed as none: no
    verification reads them. Every other row is scanned."""
    b = tokens.shape[0] if probs is None else probs.shape[0]
    ints: list[torch.Tensor] = []
    vals: list[torch.Tensor] = []
    known = [False] * b if greedy is None else greedy.tolist()
    for r in range(b):
        if known[r]:
            ints.append(_greedy_layout(tokens[r], int(num_draft[r])))
            continue
        if probs is None:  # a row without a speculation needs none either
            assert int(num_draft[r]) == 0, "a reply leaves out the distributions of greedy rows only"
            ints.append(torch.tensor([ZERO]))
            continue
        form_ints, form_vals = _pack_row(probs[r].float(), *probs.shape[1:])
        ints.append(form_ints)
        if form_vals is not None:
            vals.append(form_vals)
    layout = torch.cat(ints).long() if ints else torch.zeros(0, dtype=torch.long)
    return layout, torch.cat(vals) if vals else torch.zeros(0)


def _greedy_layout(tokens: torch.Tensor, num_draft: int) -> torch.Tensor:
    """The layout of a greedy row: its first num_draft tokens [K] (-1 past them)."""
    if num_draft == 0:
        return torch.tensor([ZERO])
    ids = tokens.clone()
    ids[num_draft:] = -1
    return torch.cat([torch.tensor([GREEDY]), ids])


def _pack_row(row: torch.Tensor, k: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One row [K, V] in its smallest exact form, found by scanning it: (ints, values or None)."""
    nonzero = row > 0  # [K, V]
    counts = nonzero.sum(-1)  # [K]
    widest = int(counts.max()) if k else 0
    if widest == 0:
        return torch.tensor([ZERO]), None
    if widest == 1 and bool((row[nonzero] == 1.0).all()):
        return torch.cat([torch.tensor([ONE_HOT]), torch.where(counts > 0, row.argmax(-1), -1)]), None
    if int(counts.sum()) * 3 < k * vocab:  # 8-byte id + 4-byte value per entry beats 4 bytes per entry
        pos, ids = nonzero.nonzero(as_tuple=True)
        return torch.cat([torch.tensor([SPARSE]), counts, ids]), row[pos, ids]
    return torch.tensor([DENSE]), row.reshape(-1)


def unpack_probs(
    r: "_Reader", values: torch.Tensor, b: int, k: int, vocab: int
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The inverse of pack_probs: layout read from `r`, values from `values` -> (probs [b, K, V]
    with greedy rows zeros, None when every row is greedy or empty: no [b, K, V] block is built;
    greedy [b] bool, the rows in the GREEDY form, None when there are none)."""
    probs: torch.Tensor | None = None
    greedy = [False] * b
    at = 0
    for row in range(b):
        form = r.one()
        if form == GREEDY:
            r.take(k)
            greedy[row] = True
            continue
        if form == ZERO:
            continue
        if form not in (ONE_HOT, SPARSE, DENSE):
            raise ValueError(f"unknown probability layout {form} in a reply")
        if probs is None:
            probs = torch.zeros(b, k, vocab)
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
        else:
            probs[row] = values[at : at + k * vocab].view(k, vocab)
            at += k * vocab
    return probs, torch.tensor(greedy) if any(greedy) else None
