"""A draft's forms of the adjustments (ssd/processing/draft_adjustments.py's tensor operations and
host_draft_adjustments.py's compiled loops): applied and advanced token by token, each processes
each position as a table built from scratch with that position's whole history does, up to a
rounding, for every kind of row (penalties, bias and min_tokens crossing its minimum, allowed
tokens, token masks, a row without processing among them)."""

from __future__ import annotations

import dataclasses
import sys

import numba.core.caching
import pytest
import torch
from test_penalties import _random_rows

from ssd.processing import adjustments, draft_adjustments, host_draft_adjustments
from ssd.processing.adjustments import build
from ssd.processing.draft_adjustments import DraftAdjustments, draft_form
from ssd.processing.host_draft_adjustments import HostDraftAdjustments

VOCAB, STEPS = 20, 7
FORMS = pytest.mark.parametrize("form_of", [DraftAdjustments.of, HostDraftAdjustments.of], ids=["tensor", "host"])


def close(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal up to a float32 rounding, -inf exactly where the reference has it."""
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


@FORMS
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("masked", [False, True])
def test_stepping_the_draft_form_equals_building_with_the_history(form_of, seed, masked):
    gen = torch.Generator().manual_seed(seed)
    rows = _random_rows(gen, VOCAB)
    b, none = len(rows), torch.zeros(len(rows), 0, dtype=torch.long)
    # Row 0 (min_tokens 9) holds EOS and its stop id back for 4 more tokens: its minimum falls
    # inside the steps. Odd seeds drop min_tokens from every row (the table keeps none).
    rows[0] = (rows[0][0], rows[0][1], [5, 6, 5, 12, 1])
    if seed % 2:
        rows = [(dataclasses.replace(p, min_tokens=0), prompt, out) for p, prompt, out in rows]
    masks = (torch.rand(b, STEPS + 1, VOCAB, generator=gen) > 0.2) if masked else None
    form = form_of(build(rows, none, VOCAB, None if masks is None else masks[:, :1]))
    for j in range(STEPS):
        logits = torch.randn(b, 1, VOCAB, generator=gen) * 3
        at = None if masks is None else masks[:, j : j + 1]
        expected = build(rows, none, VOCAB, at).apply(logits)
        kept = logits.clone()
        close(form.apply(logits), expected)
        assert torch.equal(logits, kept)  # not in place: the input stays as it was
        close(form.apply(logits.bfloat16()), build(rows, none, VOCAB, at).apply(logits.bfloat16()))
        given = logits.clone()
        assert form.apply(given, in_place=True).data_ptr() == given.data_ptr()
        close(given, expected)
        # Strided logits (a wider draft vocabulary cut to the target's), adjusted where they are.
        wide = torch.cat([logits, torch.randn(b, 1, 5, generator=gen)], -1)
        form.apply(wide[..., :VOCAB], in_place=True)
        close(wide[..., :VOCAB], expected)
        # Tokens the rows track already (their history's, a bias key, a stop id) and new ones.
        tokens = torch.randint(VOCAB, (b,), generator=gen)
        if j % 2:
            tokens = torch.tensor([out[-1] if out else prompt[0] for _, prompt, out in rows])
        for (_, _, out), t in zip(rows, tokens.tolist()):
            out.append(t)
        form = form.advanced(tokens, None if masks is None else masks[:, j + 1 : j + 2])


@FORMS
def test_the_draft_form_moves_with_its_fields(form_of):
    gen = torch.Generator().manual_seed(0)
    rows = _random_rows(gen, VOCAB)
    form = form_of(build(rows, torch.zeros(len(rows), 0, dtype=torch.long), VOCAB))
    moved = form.to(torch.device("cpu"))
    logits = torch.randn(len(rows), 1, VOCAB, generator=gen)
    assert torch.equal(moved.apply(logits), form.apply(logits))


def test_a_draft_on_the_host_gets_the_host_form():
    rows = _random_rows(torch.Generator().manual_seed(0), VOCAB)
    first = build(rows, torch.zeros(len(rows), 0, dtype=torch.long), VOCAB)
    assert isinstance(draft_form(first, torch.device("cpu")), HostDraftAdjustments)
    assert isinstance(draft_form(first, torch.device("meta")), DraftAdjustments)


def test_the_host_form_spells_the_column_places_of_the_tables():
    """numba's cache checks only host_draft_adjustments.py for changes, so that module spells the
    places itself; they must be the ones the tables use."""
    host = host_draft_adjustments
    assert (host.POS, host.NEG, host.SHIFT, host.OUT, host.BANNED) == (
        draft_adjustments.POS, draft_adjustments.NEG, draft_adjustments.SHIFT, draft_adjustments.OUT,
        draft_adjustments.BANNED,
    )  # fmt: skip
    table = adjustments
    assert (host.COUNT, host.SEEN, host.BIAS, host.HELD_BACK) == (table.COUNT, table.SEEN, table.BIAS, table.BANNED)


def test_no_writable_cache_names_the_setting_to_change(monkeypatch):
    """Where numba finds no writable place for its cache, a draft's first host form says what
    to set (a read-only install as a user without a home, say)."""
    monkeypatch.setattr(numba.core.caching.CacheImpl, "_locator_classes", [])
    monkeypatch.delitem(sys.modules, "ssd.processing.host_draft_adjustments")  # put back after
    rows = _random_rows(torch.Generator().manual_seed(0), VOCAB)
    first = build(rows, torch.zeros(len(rows), 0, dtype=torch.long), VOCAB)
    with pytest.raises(RuntimeError, match="set NUMBA_CACHE_DIR"):
        draft_form(first, torch.device("cpu"))
