"""How a reply's draft probabilities travel in a drafter frame (ssd/transport/wire.py): each row
in its smallest exact form."""

from __future__ import annotations

import torch

from ssd.transport.body import BodyReader, flat_ints

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
    ints: list[torch.Tensor | list[int]] = []  # per row: its layout (a list, or a tensor where scanned)
    vals: list[torch.Tensor] = []
    known = [False] * b if greedy is None else greedy.tolist()
    drafted = [] if num_draft is None else num_draft.tolist()
    rows = tokens.tolist() if any(known) else []
    for r in range(b):
        if known[r]:
            ints.append(_greedy_layout(rows[r], drafted[r]))
            continue
        if probs is None:  # a row without a speculation needs none either
            assert drafted[r] == 0, "a reply leaves out the distributions of greedy rows only"
            ints.append([ZERO])
            continue
        form_ints, form_vals = _pack_row(probs[r].float(), *probs.shape[1:])
        ints.append(form_ints)
        if form_vals is not None:
            vals.append(form_vals)
    return flat_ints(*ints), torch.cat(vals) if vals else torch.zeros(0)


def _greedy_layout(tokens: list[int], num_draft: int) -> list[int]:
    """The layout of a greedy row: its first num_draft tokens of K (-1 past them)."""
    if num_draft == 0:
        return [ZERO]
    return [GREEDY, *tokens[:num_draft], *[-1] * (len(tokens) - num_draft)]


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
    r: BodyReader, values: torch.Tensor, b: int, k: int, vocab: int
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
