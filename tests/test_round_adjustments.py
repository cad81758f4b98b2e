"""The engine carries the batch's penalties and bias from each round's verification to the next
round's first position (ssd/processing/round_adjustments.py) instead of building them from every
row's history: round after round, through retirements, admissions, stop rules and compaction,
the carried adjustments equal a build from the rows' whole histories."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ssd.core.sampling_params import SamplingParams
from ssd.core.sequence import Sequence
from ssd.processing import round_adjustments
from ssd.processing.adjustments import Adjustments, build
from ssd.processing.request import Processing
from ssd.processing.round_adjustments import RoundAdjustments

VOCAB, K = 24, 4
PARAMS = [
    SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, min_tokens=30, stop_token_ids=[11]),
    SamplingParams(presence_penalty=1.0, logit_bias={7: 2.0, 3: -1.0}),
    SamplingParams(),
    SamplingParams(frequency_penalty=-0.5, allowed_token_ids=list(range(0, VOCAB, 2))),
    SamplingParams(frequency_penalty=1.5, presence_penalty=-0.3),
]


def _sequence(seq_id: int, gen: torch.Generator) -> Sequence:
    params = PARAMS[seq_id % len(PARAMS)]
    prompt = torch.randint(VOCAB, (3 + seq_id % 4,), generator=gen).tolist()
    seq = Sequence(seq_id, str(seq_id), prompt, params, torch.Generator())
    seq.processing = Processing.of(params, 0)
    return seq


def _rebuilt(seqs: list[Sequence], drafted: torch.Tensor):
    return build([(s.processing, s.prompt_ids, list(s.output_ids)) for s in seqs], drafted, VOCAB)


def _round(adjustments: RoundAdjustments, seqs: list[Sequence], gen: torch.Generator, cut: bool) -> None:
    """One round: the first position and every position checked against a build; then the
    outcome carried and committed (with `cut`, one row appends less than the round decided,
    as a stop rule does)."""
    b = len(seqs)
    logits = torch.randn(b, K + 1, VOCAB, generator=gen) * 3
    none = torch.zeros(b, 0, dtype=torch.long)
    first = adjustments.first(seqs, masks=False)
    assert torch.equal(first.apply(logits[:, :1]), _rebuilt(seqs, none).apply(logits[:, :1]))
    drafted = torch.randint(VOCAB, (b, K), generator=gen)
    every = adjustments.every(first, seqs, drafted)
    assert torch.equal(every.apply(logits), _rebuilt(seqs, drafted).apply(logits))
    accepted = torch.randint(K + 1, (b,), generator=gen)
    bonus = torch.randint(VOCAB, (b,), generator=gen)
    adjustments.carry(seqs, every, accepted, bonus)
    for r, s in enumerate(seqs):
        appended = drafted[r, : accepted[r]].tolist() + [int(bonus[r])]
        s.output_ids.extend(appended[:1] if cut and r == 0 else appended)


def _scenario(seed: int) -> RoundAdjustments:
    """24 rounds with retirements, admissions and stop-rule cuts, checked round by round."""
    gen = torch.Generator().manual_seed(seed)
    adjustments = RoundAdjustments(VOCAB)
    seqs = [_sequence(i, gen) for i in range(4)]
    next_id = 4
    for step in range(24):
        _round(adjustments, seqs, gen, cut=step % 7 == 6)
        if step % 5 == 4:  # a row retires
            seqs.pop(int(torch.randint(len(seqs), (1,), generator=gen)))
        if step % 6 == 5 or not seqs:  # and one is admitted
            seqs.append(_sequence(next_id, gen))
            next_id += 1
    return adjustments


@pytest.mark.parametrize("seed", range(3))
def test_carried_adjustments_equal_a_build_round_after_round(seed, monkeypatch):
    monkeypatch.setattr(round_adjustments, "COMPACT_AFTER", 12)  # a build every few rounds
    adjustments = _scenario(seed)
    # Most rounds carried: builds only for admissions, cuts and compaction.
    assert 4 <= adjustments.builds < 18, adjustments.builds


def _ignoring_accepted_drafts(self, accepted, bonus):
    return dataclasses.replace(self, drafted=self.drafted[:, :0], masks=None).advanced(bonus)


def _without_length_check(original):
    def carried_for(self, seqs):
        where = {seq_id: r for r, seq_id in enumerate(self._ids)}
        for s in seqs:
            if s.seq_id in where:
                self._lens[where[s.seq_id]] = len(s.output_ids)
        return original(self, seqs)

    return carried_for


@pytest.mark.parametrize("broken", ["committed counts only the bonus", "no length check"])
def test_the_check_fails_on_a_broken_carrier(broken, monkeypatch):
    if broken == "committed counts only the bonus":
        monkeypatch.setattr(Adjustments, "committed", _ignoring_accepted_drafts)
    else:
        monkeypatch.setattr(RoundAdjustments, "_carried_for", _without_length_check(RoundAdjustments._carried_for))
    with pytest.raises(AssertionError):
        _scenario(0)


def test_a_draft_of_minus_one_past_a_rows_speculation_is_processed_as_token_0():
    """On a device a draw without mass is -1; past a row's num_draft (a request's own k)
    nothing raises for it and no verification reads it. Verification's adjustments must still be
    made (a column of -1 could not be gathered): such a draft counts as token 0, as the target's
    forward feeds it."""
    gen = torch.Generator().manual_seed(0)
    seqs = [_sequence(i, gen) for i in range(3)]  # penalties, bias, none
    adjustments = RoundAdjustments(VOCAB)
    first = adjustments.first(seqs, masks=False)
    drafted = torch.tensor([[5, 6, -1, -1], [7, -1, -1, -1], [-1, -1, -1, -1]])
    logits = torch.randn(3, K + 1, VOCAB, generator=gen)
    every = adjustments.every(first, seqs, drafted)
    assert torch.equal(every.apply(logits), _rebuilt(seqs, drafted.clamp(min=0)).apply(logits))
