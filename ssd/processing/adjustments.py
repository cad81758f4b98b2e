"""The exact form of a batch's adjustments (`Adjustments`): what its rows' processing
(request.py) does to logits [b, n, V] at every position, each position with its own history.
The target's verification applies it (round_adjustments.py builds and carries it); the SSD
fork applies it at K + 1 positions; every draft starts from its first position (the draft form,
draft_adjustments.py). The glossary is ssd/processing/__init__.py's.

Speculation stays lossless under any processing as long as verification compares the draft's
proposals with the *processed* target distribution at each position, computed from that
position's own history: the committed output plus the earlier draft tokens of the same
speculation. That is what `Adjustments` holds, built on the host (`build`) from each row's
tracked columns (tracked.py) and its token masks (token_masks.py).

Order, per position (the same as the reference in tests/refimpl.py):
    1. repetition_penalty  (Hugging Face / vLLM): a token seen in the prompt or the output so
                           far has its logit divided by the penalty if positive, multiplied if
                           negative
    2. frequency_penalty, presence_penalty (OpenAI): logit -= frequency * count + presence *
                           (count > 0), count over the output so far (not the prompt)
    3. logit_bias          added to the logit of each listed token
    4. allowed_token_ids   every other token gets -inf
       structured_outputs  so does every token the grammar refuses at that position (grammar.py)
       bad_words           and every token that would complete a bad word there (bad_words.py)
    5. min_tokens          EOS and the stop token ids get -inf while the output is shorter
then the shaping (ssd/core/sampling.py's process_logits): temperature, min_p (drop tokens whose
probability is below min_p times the largest: `min_p_filtered`), top-k and top-p.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ssd.processing.request import Processing
from ssd.processing.tracked import TrackedHistory, tracked_columns

COUNT, SEEN, BIAS, BANNED = range(4)  # the values of a tracked column (Adjustments.columns)


@dataclass(frozen=True)
class Adjustments:
    """One round's adjustments for b rows scored at n positions (position j follows the row's
    history plus drafted[:, :j]). Built on the host (`build`), moved with `to`, applied where the
    logits are (`apply`): no host read there.

    Sparse: a row's penalties, bias and min_tokens touch only the tokens of its history, its
    bias, its stop ids and its speculation, at most m per row, so `apply` gathers those m columns
    of the logits, adjusts them and scatters them back (a dense [b, n, V] pass per step cost
    11 ms a position-row at V = 128k on CPU; this costs a few passes over m). Padding columns
    repeat the row's first token id and its values, so their scatter writes what a real column
    writes. A column's four values sit in one tensor (`columns`, COUNT, SEEN, BIAS, BANNED along
    its last axis), so that a draft's step moves one tensor, not four: on a CPU each tensor
    operation costs ~5 us whatever its size, and a round at batch 1 takes a few dozen."""

    ids: torch.Tensor  # [b, m] long, the tokens a row adjusts
    # [b, m, 4] float, per column: COUNT its occurrences in the committed output; SEEN > 0 where
    # the prompt or the committed output holds it; BIAS its logit_bias; BANNED 1 for EOS and the
    # stop ids (what min_tokens holds back), else 0.
    columns: torch.Tensor
    allowed: torch.Tensor | None  # [b, V] bool, allowed_token_ids (all True where a row has none); None: no row has
    # The per-row scalars are [b, 1, 1], shaped to broadcast over [b, n, m] and [b, n, V].
    repetition: torch.Tensor  # [b, 1, 1] float, 1 = off
    frequency: torch.Tensor  # [b, 1, 1] float
    presence: torch.Tensor  # [b, 1, 1] float
    # [b] long, the output tokens a row must still produce before EOS and its stop ids are
    # allowed (min_tokens less the committed output; <= 0: none); None: no row has min_tokens
    short_by: torch.Tensor | None
    min_p: torch.Tensor | None  # [b, 1, 1] float, 0 = off (after temperature: `min_p_filtered`); None: no row has one
    drafted: torch.Tensor  # [b, n - 1] long, the speculation before each position
    # [4] float, (1, 1, 0, 0): what one occurrence adds to a column (COUNT and SEEN). Built once
    # per table, not per step: a tensor made from a Python list costs four operations.
    occurrence: torch.Tensor
    # [b, n, V] bool, the tokens each position allows under the row's grammar and bad words
    # (token_masks.py; all True for a row with neither); None: no row has any.
    masks: torch.Tensor | None = None

    def advanced(
        self, tokens: torch.Tensor, masks: torch.Tensor | None = None, where: torch.Tensor | None = None
    ) -> "Adjustments":
        """After each row appends tokens [b] to its history (a draft drafting position by
        position: the next position's adjustments count them). A token the row does not track
        yet gets a column of its own (seen once, no bias, not banned: bias keys and stop ids are
        tracked from the start). masks [b, 1, V]: the next position's token masks, required where
        this has any (only the caller's matchers and histories know them). where [b] bool: the
        rows that append (None: all); the others stay as they are."""
        assert (masks is None) == (self.masks is None), "the next position's token masks are the caller's"
        tokens = tokens.view(-1, 1)  # [b, 1]
        hit = self.ids == tokens  # [b, m]
        tracked = hit.any(1, keepdim=True)  # [b, 1]
        if where is not None:
            rows = where.view(-1, 1)
            hit, tracked = hit & rows, tracked | ~rows
        appended = 1 if where is None else where.long()
        return self._counted(hit, tokens, tracked, appended, masks=masks)

    def branched(self, rows: torch.Tensor, prefix: torch.Tensor, valid: torch.Tensor) -> "Adjustments":
        """One row per branch of a speculation tree, at the branch's first drafted position:
        rows [r] the row each branch grows from; prefix [r, L] the tokens it appends to that
        row's history first (the accepted drafts its outcome assumes, then its candidate), where
        valid [r, L]. -> adjustments for r rows at one position (no masks: the caller's)."""
        per_row = ("ids", "columns", "repetition", "frequency", "presence")
        optional = ("allowed", "short_by", "min_p")  # None where no row has one
        out = replace(
            self,
            **{f: getattr(self, f)[rows] for f in per_row},
            **{f: None if getattr(self, f) is None else getattr(self, f)[rows] for f in optional},
            drafted=prefix.new_zeros(rows.numel(), 0),
            masks=None,
        )
        for i in range(prefix.shape[1]):
            out = out.advanced(prefix[:, i], where=valid[:, i])
        return out

    def speculated(self, drafted: torch.Tensor, masks: torch.Tensor | None = None) -> "Adjustments":
        """The round's first position's adjustments -> those of every position of its speculation
        drafted [b, K] (what `build` with drafted gives, without reading the histories again).
        Each drafted token gets a column: the values of the row's column for the same token where
        it has one, else untracked ones (counted 0, unseen, no bias, not banned: bias keys and
        stop ids are tracked from the start). A column that repeats a token repeats its values,
        so its scatter writes what the first one writes. masks [b, K + 1, V]: the positions'
        token masks (token_masks.token_masks), required where any row has a grammar or bad words."""
        assert self.drafted.shape[1] == 0, "speculated extends a first position's adjustments"
        # [b, K, 1] each: whether the row tracks the token, and a column of it (all such are equal)
        known, at = (drafted.unsqueeze(-1) == self.ids.unsqueeze(1)).max(-1, keepdim=True)
        copied = self.columns.gather(1, at.expand(-1, -1, self.columns.shape[-1]))  # [b, K, 4]
        return replace(
            self,
            ids=torch.cat([self.ids, drafted], 1),
            columns=torch.cat([self.columns, copied * known], 1),  # untracked: all four 0
            drafted=drafted,
            masks=masks,
        )

    def committed(self, accepted: torch.Tensor, bonus: torch.Tensor) -> "Adjustments":
        """A verification's adjustments (`speculated`) -> the next round's first position's, once
        each row has appended its first accepted[b] drafts and then its bonus token bonus[b]. The
        drafts have their columns already, so only their counts move and a new bonus token gets
        a column (as in `advanced`). Every round adds K + 1 columns, padding mostly: the caller builds
        afresh now and then."""
        k = self.drafted.shape[1]
        bonus = bonus.view(-1, 1)
        appended = torch.cat([bonus, self.drafted], 1)  # [b, 1 + K]: counting does not depend on the order
        taken = torch.arange(k + 1, device=accepted.device) <= accepted.view(-1, 1)  # the bonus, drafts[:accepted]
        hits = (appended.unsqueeze(-1) == self.ids.unsqueeze(1)) & taken.unsqueeze(-1)  # [b, 1 + K, m]
        tracked = hits[:, 0].any(1, keepdim=True)  # [b, 1]: whether the bonus is (the drafts have columns)
        times = hits.sum(1, dtype=torch.float32)  # [b, m]
        return self._counted(times, bonus, tracked, accepted + 1, drafted=self.drafted[:, :0], masks=None)

    def _counted(
        self, times: torch.Tensor, tokens: torch.Tensor, tracked: torch.Tensor, appended, **changes
    ) -> "Adjustments":
        """After the rows' output gained `appended` ([b] long, or an int for all) tokens: each
        column's token occurred times [b, m] (float, or bool for once) more often, and tokens
        [b, 1] get a column of their own where tracked [b, 1] is False (seen once, no bias, not
        banned: bias keys and stop ids are tracked from the start); elsewhere the new column
        repeats the row's first. changes: other fields replaced along. (Each operation here runs
        once per draft step: ~3 us apiece in a round at batch 1, so none is spent on a dtype or
        a negation.)"""
        once = self.occurrence
        columns = torch.addcmul(self.columns, times.unsqueeze(-1), once)  # [b, m, 4]: exact (small integers)
        return replace(
            self,
            ids=torch.cat([self.ids, torch.where(tracked, self.ids[:, :1], tokens)], 1),
            columns=torch.cat([columns, torch.where(tracked.unsqueeze(-1), columns[:, :1], once)], 1),
            short_by=None if self.short_by is None else self.short_by - appended,
            **changes,
        )

    def to(self, device: torch.device) -> "Adjustments":
        return Adjustments(*(moved(getattr(self, f), device) for f in self.__dataclass_fields__))

    def apply(self, logits: torch.Tensor, in_place: bool = False) -> torch.Tensor:
        """logits [b, n, V] -> adjusted logits [b, n, V] (float32), steps 1-5 of the module doc.
        A round calls this K + 1 times at batch 1, where each tensor operation costs ~1-3 us of
        dispatch: hence no comparison with a Python number (a scalar tensor each) and no view
        of the per-row scalars (stored [b, 1, 1]).

        in_place: the caller gives the logits up (nothing reads them after), so float32 logits
        are adjusted where they are. Otherwise they stay as they were and the result is one copy
        of them: at V = 128k that [b, n, V] copy was most of what processing cost a round."""
        owned = in_place
        if logits.dtype != torch.float32:  # float() of float32 logits would be an operation for nothing
            logits, owned = logits.float(), True  # of any other dtype, a copy of our own
        b, n, _ = logits.shape
        ids = self.ids.unsqueeze(1)  # [b, 1, m]
        counts, seen, bias, banned = self.columns.unsqueeze(1).unbind(-1)  # [b, 1, m] each
        if n > 1:  # occurrences before each position: the output's, plus the draft tokens before it
            drafts = (self.drafted[:, : n - 1].unsqueeze(-1) == ids).float()  # [b, n-1, m]
            before = torch.cat([torch.zeros_like(drafts[:, :1]), drafts.cumsum(1)], 1)  # [b, n, m]
            counts, seen, ids = counts + before, seen + before, ids.expand(b, n, -1)
        picked = logits.gather(-1, ids)  # [b, n, m]
        # A seen token's logit is divided by the penalty if positive, else multiplied (0 stays 0).
        penalized = torch.where(picked.signbit(), picked * self.repetition, picked / self.repetition)
        picked = torch.where(seen.bool(), penalized, picked)
        picked = picked + (bias - self.frequency * counts - self.presence * counts.clamp(max=1))
        if self.short_by is not None:  # position j follows j more tokens of output
            early = torch.arange(n, device=logits.device) < self.short_by.view(b, 1)  # [b, n]
            picked = picked.masked_fill(early.unsqueeze(-1) & banned.bool(), float("-inf"))
        logits = logits.scatter_(-1, ids, picked) if owned else logits.scatter(-1, ids, picked)
        # This call's own logits from here: the masks write into them.
        return masked_in_place(logits, self.allowed, self.masks)

    def min_p_filtered(self, scaled: torch.Tensor) -> torch.Tensor:
        """scaled [b, n, V]: logits over temperature with each row's max at 0, so a token's
        probability over the largest is exp(scaled) -> the same with -inf where that is below
        min_p."""
        return min_p_filtered(self.min_p, scaled)


def min_p_filtered(min_p: torch.Tensor | None, scaled: torch.Tensor) -> torch.Tensor:
    """scaled [b, n, V] as Adjustments.min_p_filtered reads it, min_p [b, 1, 1] or None."""
    if min_p is None:
        return scaled
    return scaled.masked_fill(scaled < min_p.log(), float("-inf"))  # log 0 = -inf: nothing dropped


def masked_in_place(logits: torch.Tensor, allowed: torch.Tensor | None, masks: torch.Tensor | None) -> torch.Tensor:
    """logits [b, n, V] (the caller's own) with -inf written where allowed [b, V] or masks [b, n, V]
    refuse a token (either may be None: no row has one)."""
    if allowed is not None:
        logits.masked_fill_(~allowed.unsqueeze(1), float("-inf"))
    if masks is not None:
        logits.masked_fill_(~masks, float("-inf"))
    return logits


def moved(value: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """An optional field of a table on `device`."""
    return None if value is None else value.to(device)


# One row of a build: its processing, prompt ids and output ids.
Row = tuple[Processing, list[int], list[int]]


def build(
    rows: list[Row],
    drafted: torch.Tensor,
    vocab: int,
    masks: torch.Tensor | None = None,
    histories: list[TrackedHistory | None] | None = None,
) -> Adjustments:
    """rows: per row (Processing, prompt_ids, output_ids); drafted [b, K] (host); masks
    [b, K + 1, V] (token_masks.token_masks) or None; histories: per row, its sequence's
    TrackedHistory (read and brought up to date: a round reads only the new output), or None.
    Rows whose processing is not active get neutral values (and no tracked tokens)."""
    b = len(rows)
    on = [p.active for p, _, _ in rows]
    scalars = torch.tensor(
        [[p.repetition_penalty, p.frequency_penalty, p.presence_penalty, p.min_p] if a else [1.0, 0.0, 0.0, 0.0]
         for (p, _, _), a in zip(rows, on)],
        dtype=torch.float32,
    ).view(b, 4, 1, 1)  # fmt: skip
    short_by = None  # no pass over the positions where no row has min_tokens
    if any(p.min_tokens for (p, _, _), a in zip(rows, on) if a):
        short_by = torch.tensor([p.min_tokens - len(out) if a else 0 for (p, _, out), a in zip(rows, on)])
    allowed = None  # no [b, n, V] pass for a mask that keeps everything
    if any(p.allowed_token_ids is not None for p, _, _ in rows):
        allowed = torch.ones(b, vocab, dtype=torch.bool)
        for r, (p, _, _) in enumerate(rows):
            if p.allowed_token_ids is not None:
                allowed[r] = False
                allowed[r, torch.tensor(p.allowed_token_ids, dtype=torch.long)] = True
    return Adjustments(
        *tracked_columns(rows, [r for r, a in enumerate(on) if a], drafted, vocab, histories),
        allowed,
        scalars[:, 0].contiguous(),
        scalars[:, 1].contiguous(),
        scalars[:, 2].contiguous(),
        short_by,
        scalars[:, 3].contiguous() if any(p.min_p for (p, _, _), a in zip(rows, on) if a) else None,
        drafted,
        torch.tensor([1.0, 1.0, 0.0, 0.0]),
        masks,
    )
