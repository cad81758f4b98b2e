"""A drafter holding no other rows drafts a new row's first speculation at admission, while the
target prefills it (ssd/drafting/neural_backup.py): served to the neural backup's NEURAL_BACKUP for
exactly those rows, or taken back, with the rows' generators restored, when anything else comes
first. Either way what is drafted and sampled is what it would be without it."""

from __future__ import annotations

import pytest
import torch

from ssd import LLM, SamplingParams
from ssd.core.protocol import AdmitMsg, NeuralBackupMsg, ReleaseMsg
from ssd.core.sampling import SequenceSampling
from ssd.drafting.tree_drafter import TreeDrafter
from ssd.model.runner import draft_runner

PROMPTS = ["def f(x):", "hello", "import os\n"]


def run(pair, **options) -> tuple[list[list[int]], int]:
    """Each prompt alone (so each is admitted to an idle drafter), then all three at once (admitted
    together) -> their tokens and how many first speculations were served from admission."""
    params = [SamplingParams(temperature=1.0, max_tokens=24, seed=s, ignore_eos=True) for s in (7, 8, 9)]
    with LLM(*pair, mode="ssd", k=4, draft_transport="inprocess", ssd_reproducible=True, **options) as llm:
        alone = [llm.generate(p, q)[0].token_ids for p, q in zip(PROMPTS, params)]
        together = [o.token_ids for o in llm.generate(PROMPTS, params)]
        served = llm.metrics()["ssd"]["drafter_first_drafts_early"]
    return alone + together, served


def test_the_neural_backup_is_served_the_first_speculations_drafted_at_admission(tiny_pair, monkeypatch):
    early, served = run(tiny_pair, ssd_backup="neural")
    monkeypatch.setattr(TreeDrafter, "_draft_early", lambda self, new: None)
    plain, none = run(tiny_pair, ssd_backup="neural")
    assert early == plain and early[:3] == early[3:]
    assert served == 6 and none == 0, served
    monkeypatch.undo()
    assert run(tiny_pair, ssd_backup="fast")[1] == 0  # a fixed fast backup never asks: none drafted


@pytest.fixture(scope="module")
def draft_model(tiny_pair):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_pair[1], local_files_only=True).eval()


def admitted(model, early: bool) -> TreeDrafter:
    drafter = TreeDrafter(draft_runner(model, "cpu", True), model.config.vocab_size, 3, early_drafts=early)
    sampling = [SequenceSampling(1.0, 0, 1.0)] * 2
    drafter.admit(AdmitMsg([1, 2], [list(b"def f(x):"), list(b"import os")], [11, 12], sampling))
    return drafter


@pytest.mark.parametrize("then", ["asked", "other order", "one row", "release"])
def test_what_comes_after_an_early_draft_gets_what_it_would_have_got(draft_model, then):
    """NEURAL_BACKUP for the admitted rows in their order is served from the early draft; in another
    order, for some of them, or after a RELEASE it is drafted afresh from generators put back:
    the replies and the generators' states equal a drafter's that never drafted early."""
    drafters = [admitted(draft_model, True), admitted(draft_model, False)]
    assert drafters[0].backup.early is not None and drafters[1].backup.early is None
    ids, need = {"asked": ([1, 2], [True, True]), "other order": ([2, 1], [True, True])}.get(
        then, ([1, 2], [True, False])
    )
    if then == "release":
        for d in drafters:
            d.release(ReleaseMsg([2]))
        ids, need = [1], [True]
    replies = [d.neural_backup(NeuralBackupMsg(1, ids, need)) for d in drafters]
    needed = torch.tensor(need)
    assert torch.equal(replies[0].tokens[needed], replies[1].tokens[needed])
    assert torch.equal(replies[0].probs[needed], replies[1].probs[needed])
    for s in ids:
        assert torch.equal(drafters[0].states[s].generator.get_state(), drafters[1].states[s].generator.get_state())
    assert drafters[0].counters.drafted_early == (2 if then == "asked" else 0)
