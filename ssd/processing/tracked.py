"""The tokens a round's penalties, bias and stop ids touch, per row: the tracked columns that
`adjustments.Adjustments` gathers, adjusts and scatters back.

A row tracks every token of its prompt and output (repetition penalty: seen; frequency and
presence penalty: counted in the output), its bias keys and stop ids (from the start, so that a
token a draft appends later never needs a bias or a ban of its own) and the tokens drafted in
the round. A sequence's `TrackedHistory` keeps the first two between rounds, so that a round
reads only what its output gained since the last one, not its whole history again.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch


@dataclass
class TrackedHistory:
    """A sequence's history as `tracked_columns` folded it in last: the sorted unique tokens of its
    prompt and its output, and each one's count in the output. Invariant: it describes the
    prompt and output_ids[:output_len] (a sequence's output only grows)."""

    ids: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))  # [u] long, sorted
    counts: torch.Tensor = field(default_factory=lambda: torch.zeros(0))  # [u] float
    prompt_len: int = 0  # prompt tokens folded in: 0 or all of them
    output_len: int = 0  # output tokens folded in


def tracked_columns(
    rows: list[tuple], active: list[int], drafted: torch.Tensor, vocab: int, histories: list | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tracked columns of every row: ids [b, m] and their values [b, m, 4] (count, seen, bias,
    banned: Adjustments.columns). One pass over all active rows at once: every token is keyed
    row * vocab + token, so one sorted unique gives each row's ids in order and where each token
    sits among them. rows: per row (Processing, prompt_ids, output_ids), adjustments.Row; histories:
    per row, its sequence's TrackedHistory or None (None, or None for a row: read the row's whole
    history); those given are brought up to date."""
    b = len(rows)
    assert vocab < 2**24, "token ids travel as float32 below"
    if not active:
        return torch.zeros(b, 1, dtype=torch.long), torch.zeros(b, 1, 4)
    kept = [histories[r] if histories is not None else None for r in active]
    known = [h if h is not None else TrackedHistory() for h in kept]
    procs = [rows[r][0] for r in active]
    # Four sections of new tokens, each a list per active row: prompt, output, bias keys, stop ids.
    lists = [rows[r][1][h.prompt_len :] for r, h in zip(active, known)]
    lists += [rows[r][2][h.output_len :] for r, h in zip(active, known)]
    lists += [list(p.logit_bias) for p in procs] + [list(p.stop_token_ids) for p in procs]
    lens = torch.tensor([len(x) for x in lists], dtype=torch.long)
    owners = torch.tensor(active, dtype=torch.long)
    flat = torch.tensor(list(itertools.chain.from_iterable(lists)), dtype=torch.long)
    # Keys stay in their row's range only for ids in the vocabulary (the engine checked them).
    assert flat.numel() == 0 or (int(flat.min()) >= 0 and int(flat.max()) < vocab), "token id outside the vocabulary"
    before = torch.cat([h.ids for h in known])
    before_lens = torch.tensor([h.ids.numel() for h in known], dtype=torch.long)
    keyed = torch.cat([before, flat]) + torch.repeat_interleave(torch.cat([owners, owners.repeat(4)]) * vocab,
                                                                torch.cat([before_lens, lens]))  # fmt: skip
    drafts = (drafted[owners].long() + owners.view(-1, 1) * vocab).flatten()
    # Sorted unique keys (by row, then token), and where each token sits among them.
    keys, where = torch.unique(torch.cat([keyed, drafts]), return_inverse=True)
    sizes = [before.numel()] + lens.view(4, -1).sum(1).tolist() + [drafts.numel()]
    old, prompt, output, bias_at, stops, _ = where.split(sizes)
    counts = (
        torch.bincount(output, minlength=keys.numel()).float().index_add_(0, old, torch.cat([h.counts for h in known]))
    )
    seen = torch.zeros(keys.numel(), dtype=torch.bool)
    seen[torch.cat([old, prompt, output])] = True
    bias = torch.zeros(keys.numel())
    bias[bias_at] = torch.tensor([v for p in procs for v in p.logit_bias.values()], dtype=torch.float32)
    banned = torch.zeros(keys.numel(), dtype=torch.bool)
    banned[stops] = True
    if any(h is not None for h in kept):
        _remember(kept, [rows[r] for r in active], owners, keys[seen], counts[seen], vocab)
    # All five at once, as float32 (exact for token ids below 2**24).
    values = torch.stack([(keys % vocab).float(), counts, seen.float(), bias, banned.float()])  # [5, u]
    out = _laid_out(keys // vocab, values, b)
    return out[0].long(), out[1:].permute(1, 2, 0).contiguous()  # ids [b, m]; columns [b, m, 4]


def _laid_out(row: torch.Tensor, values: torch.Tensor, b: int) -> torch.Tensor:
    """values [f, u] of u tracked tokens sorted by their row [u] -> [f, b, m], each row's in
    order, padded with its first column (see Adjustments); a row without any gets zeros."""
    per_row = torch.bincount(row, minlength=b)
    start = per_row.cumsum(0) - per_row
    col = torch.arange(row.numel()) - start[row]
    first, has = start.clamp(max=row.numel() - 1), (per_row > 0).view(b, 1)
    f, m = values.shape[0], int(per_row.max())
    out = torch.where(has, values[:, first].view(f, b, 1), 0.0).expand(f, b, m).clone()
    out[:, row, col] = values
    return out


def _remember(
    kept: list, rows: list, owners: torch.Tensor, keys: torch.Tensor, counts: torch.Tensor, vocab: int
) -> None:
    """Store each active row's history (keys [h] keyed row * vocab + token, sorted; counts [h])
    in its TrackedHistory, where it has one."""
    sizes = torch.bincount(keys // vocab, minlength=int(owners.max()) + 1)[owners].tolist()
    for h, row, ids, c in zip(kept, rows, (keys % vocab).split(sizes), counts.split(sizes)):
        if h is not None:
            h.ids, h.counts, h.prompt_len, h.output_len = ids, c, len(row[1]), len(row[2])
