"""What a request's penalties, bias and token masks do to the target's logits, position by
position, before temperature, top-k and top-p (ssd/core/sampling.py).

Speculation stays lossless under any of them as long as verification compares the draft's
proposals with the *processed* target distribution at each position, computed from that
position's own history: the committed output plus the earlier draft tokens of the same
speculation. That is what `Adjustments` holds. The draft need not apply them (verification is
exact for any draft distribution), but accepts less often when it does not: the SD draft applies
them position by position (`advanced`); SSD's drafters apply a grammar's masks
(ssd/drafting/draft_grammars.py) but not yet the rest.

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
then temperature, min_p (drop tokens whose probability is below min_p times the largest), top-k
and top-p.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


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
    writes."""

    ids: torch.Tensor  # [b, m] long, the tokens a row adjusts
    counts: torch.Tensor  # [b, m] float, occurrences in the committed output
    seen: torch.Tensor  # [b, m] bool, in the prompt or the committed output
    bias: torch.Tensor  # [b, m] float, logit_bias
    banned: torch.Tensor  # [b, m] bool, EOS and the stop ids (what min_tokens holds back)
    allowed: torch.Tensor | None  # [b, V] bool, allowed_token_ids (all True where a row has none); None: no row has
    repetition: torch.Tensor  # [b] float, 1 = off
    frequency: torch.Tensor  # [b] float
    presence: torch.Tensor  # [b] float
    output_len: torch.Tensor  # [b] long, committed output tokens
    min_tokens: torch.Tensor  # [b] long
    min_p: torch.Tensor  # [b] float, 0 = off (applied after temperature: `min_p_mask`)
    drafted: torch.Tensor  # [b, n - 1] long, the speculation before each position
    # [b, n, V] bool, the tokens each position allows under the row's grammar and bad words
    # (token_masks.py; all True for a row with neither); None: no row has any.
    masks: torch.Tensor | None = None

    def advanced(self, tokens: torch.Tensor, masks: torch.Tensor | None = None) -> "Adjustments":
        """After each row appends tokens [b] to its history (a draft drafting position by
        position: the next position's adjustments count them). A token the row does not track
        yet gets a column of its own (seen once, no bias, not banned: bias keys and stop ids are
        tracked from the start). masks [b, 1, V]: the next position's token masks, required where
        this has any (only the caller's matchers and histories know them)."""
        assert (masks is None) == (self.masks is None), "the next position's token masks are the caller's"
        hit = self.ids == tokens.view(-1, 1)  # [b, m]
        new = ~hit.any(1, keepdim=True)  # [b, 1]
        ids = torch.cat([self.ids, torch.where(new, tokens.view(-1, 1), self.ids[:, :1])], 1)
        counts = torch.cat([self.counts + hit, torch.where(new, 1.0, self.counts[:, :1] + hit[:, :1])], 1)
        seen = torch.cat([self.seen | hit, new | self.seen[:, :1] | hit[:, :1]], 1)
        return replace(
            self,
            ids=ids,
            counts=counts,
            seen=seen,
            bias=torch.cat([self.bias, torch.where(new, 0.0, self.bias[:, :1])], 1),
            banned=torch.cat([self.banned, ~new & self.banned[:, :1]], 1),
            output_len=self.output_len + 1,
            masks=masks,
        )

    def to(self, device: torch.device) -> "Adjustments":
        return Adjustments(*(_to(getattr(self, f), device) for f in self.__dataclass_fields__))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [b, n, V] -> adjusted logits [b, n, V] (float32), steps 1-5 of the module doc."""
        logits = logits.float()
        b, n, vocab = logits.shape
        m = self.ids.shape[1]
        ids = self.ids.unsqueeze(1).expand(b, n, m)
        picked = logits.gather(-1, ids)  # [b, n, m]
        # Occurrences before each position: the output's, plus the draft tokens before it.
        drafts = (self.drafted[:, : n - 1].unsqueeze(-1) == self.ids.unsqueeze(1)).float()  # [b, n-1, m]
        before = torch.cat([torch.zeros(b, 1, m, device=logits.device), drafts.cumsum(1)], 1)  # [b, n, m]
        counts = self.counts.unsqueeze(1) + before
        seen = self.seen.unsqueeze(1) | (before > 0)
        penalty = self.repetition.view(b, 1, 1)
        picked = torch.where(seen, torch.where(picked > 0, picked / penalty, picked * penalty), picked)
        picked = picked - self.frequency.view(b, 1, 1) * counts - self.presence.view(b, 1, 1) * (counts > 0)
        picked = picked + self.bias.unsqueeze(1)
        produced = self.output_len.view(b, 1) + torch.arange(n, device=logits.device)  # [b, n]
        early = (produced < self.min_tokens.view(b, 1)).unsqueeze(-1)  # [b, n, 1]
        picked = picked.masked_fill(early & self.banned.unsqueeze(1), float("-inf"))
        logits = logits.scatter(-1, ids, picked)
        if self.allowed is not None:
            logits = logits.masked_fill(~self.allowed.unsqueeze(1), float("-inf"))
        if self.masks is not None:
            logits = logits.masked_fill(~self.masks, float("-inf"))
        return logits

    def min_p_mask(self, scaled: torch.Tensor) -> torch.Tensor:
        """scaled [b, n, V]: logits over temperature with each row's max at 0, so a token's
        probability over the largest is exp(scaled) -> True where that is below min_p."""
        return scaled < self.min_p.log().view(-1, 1, 1)  # log 0 = -inf: nothing dropped


def _to(value: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if value is None else value.to(device)


def needs_adjustments(params) -> bool:
    """Whether a request's SamplingParams change its logits beyond temperature, top-k, top-p."""
    return bool(
        params.repetition_penalty != 1.0
        or params.frequency_penalty
        or params.presence_penalty
        or params.logit_bias
        or params.allowed_token_ids is not None
        or params.min_tokens
        or params.min_p
        or params.structured_outputs is not None
        or params.bad_words
    )


def build(
    rows: list[tuple], drafted: torch.Tensor, vocab: int, eos: int | None, masks: torch.Tensor | None = None
) -> Adjustments:
    """rows: per row (params, prompt_ids, output_ids); drafted [b, K] (host); masks [b, K + 1, V]
    (token_masks.token_masks) or None. Rows that need no adjustment get neutral values (and no
    tracked tokens)."""
    b = len(rows)
    tracked: list[list[int]] = []
    columns: list[tuple] = []  # per row: counts, seen, bias, banned over its tracked ids
    allowed = torch.ones(b, vocab, dtype=torch.bool)
    scalars = torch.tensor(
        [[p.repetition_penalty, p.frequency_penalty, p.presence_penalty, p.min_p] for p, _, _ in rows],
        dtype=torch.float32,
    ).view(b, 4)
    lengths = torch.tensor([[len(out), p.min_tokens] for p, _, out in rows], dtype=torch.long).view(b, 2)
    for r, (params, prompt, output) in enumerate(rows):
        if not needs_adjustments(params):
            scalars[r] = torch.tensor([1.0, 0.0, 0.0, 0.0])
            lengths[r, 1] = 0
            tracked.append([])
            columns.append(([], [], [], []))
            continue
        stops = set(params.stop_token_ids) | ({eos} if eos is not None and not params.ignore_eos else set())
        history = set(prompt) | set(output)
        ids = sorted(history | set(params.logit_bias) | stops | set(drafted[r].tolist()))
        occurrences: dict[int, int] = {}
        for t in output:
            occurrences[t] = occurrences.get(t, 0) + 1
        tracked.append(ids)
        columns.append(
            (
                [float(occurrences.get(t, 0)) for t in ids],
                [t in history for t in ids],
                [float(params.logit_bias.get(t, 0.0)) for t in ids],
                [t in stops for t in ids],
            )
        )
        if params.allowed_token_ids is not None:
            allowed[r] = False
            allowed[r, torch.tensor(params.allowed_token_ids, dtype=torch.long)] = True
    m = max(1, max(len(ids) for ids in tracked))
    if all(p.allowed_token_ids is None for p, _, _ in rows):
        allowed = None  # no [b, n, V] pass for a mask that keeps everything

    def padded(values: list, fill, dtype) -> torch.Tensor:
        # Pad with the row's first column (see the class doc), or `fill` for a row with none.
        return torch.tensor(values + [values[0] if values else fill] * (m - len(values)), dtype=dtype)

    return Adjustments(
        torch.stack([padded(ids, 0, torch.long) for ids in tracked]),
        *(
            torch.stack([padded(col[i], fill, dtype) for col in columns])
            for i, (fill, dtype) in enumerate(
                [(0.0, torch.float32), (False, torch.bool), (0.0, torch.float32), (False, torch.bool)]
            )
        ),
        allowed,
        scalars[:, 0].contiguous(),
        scalars[:, 1].contiguous(),
        scalars[:, 2].contiguous(),
        lengths[:, 0].contiguous(),
        lengths[:, 1].contiguous(),
        scalars[:, 3].contiguous(),
        drafted,
        masks,
    )
