"""A drafter holding no other rows drafts a new row's first speculation while the target prefills
it (ssd/drafting/early_draft.py): served to the neural backup's DRAFT_NOW, or taken back, with
the rows' generators restored, when the fast backup speculated first. Either way a seeded
request samples what it samples without it."""

from __future__ import annotations

import pytest

from ssd import LLM, SamplingParams
from ssd.drafting.tree_drafter import TreeDrafter

PROMPTS = ["def f(x):", "hello", "import os\n"]


def run(pair, backup: str) -> tuple[list[list[int]], int]:
    """Each prompt alone (so each is admitted to an idle drafter), then all three at once (admitted
    together) -> their tokens and how many first speculations were served from admission."""
    params = [SamplingParams(temperature=1.0, max_tokens=24, seed=s, ignore_eos=True) for s in (7, 8, 9)]
    options = dict(mode="ssd", k=4, draft_transport="inprocess", ssd_reproducible=True, ssd_backup=backup)
    with LLM(*pair, **options) as llm:
        alone = [llm.generate(p, q)[0].token_ids for p, q in zip(PROMPTS, params)]
        together = [o.token_ids for o in llm.generate(PROMPTS, params)]
        served = llm.metrics()["ssd"]["drafter_first_drafts_early"]
    return alone + together, served


@pytest.mark.parametrize("backup", ["neural", "fast"])
def test_a_first_speculation_drafted_at_admission_changes_no_output(tiny_pair, monkeypatch, backup):
    early, served = run(tiny_pair, backup)
    monkeypatch.setattr(TreeDrafter, "_draft_early", lambda self, new: None)
    plain, none = run(tiny_pair, backup)
    assert early == plain and early[:3] == early[3:]
    assert none == 0 and served == (6 if backup == "neural" else 0), served
