"""SSD's drafters process their speculations as verification will (ssd/drafting/tree_adjustments.py):
penalties, bias, allowed tokens, min_tokens and bad words, each position with its own history.

1. the fork's position j and every tree branch at every depth are processed as a row built from
   scratch with that position's whole history (committed tokens, s_T[:j], the branch's
   candidate and its earlier tokens): the fork exactly, the branches up to a rounding;
2. a 2-worker pool under penalties gives the greedy output of Hugging Face `generate` with the
   same processing and is accepted as often as SD's processed draft (a drafter that ignores the
   penalties is accepted less: measured below).
Sampled exactness through a pool under penalties: tests/test_ssd_process_sampling.py.
"""

from __future__ import annotations

import pytest
import torch
from test_penalties import hf_adjusted_greedy
from workers import live_draft_workers

from ssd import LLM, SamplingParams
from ssd.core.sampling import BatchSampling, SequenceSampling
from ssd.drafting.tree_adjustments import ForkAdjustments, processes
from ssd.processing.adjustments import build
from ssd.processing.bad_words import bad_word_masks
from ssd.processing.request import Processing

VOCAB = 24
K = 3


def rows() -> list[tuple[SequenceSampling, list[int]]]:
    """Three rows: penalties, bias, min_tokens and a two-token bad word; allowed tokens and
    presence; nothing (a neutral row batched with them)."""
    first = Processing(1.3, 0.7, 0.0, 0.0, 6, {5: 2.0, 9: -3.0}, None, (0, 11), ((7, 8), (13,)))
    second = Processing(1.0, 0.0, 1.5, 0.0, 0, {}, tuple(range(4, 20)), (), ())
    return [
        (SequenceSampling(1.0, 0, 1.0, output_from=3, processing=first), [1, 2, 3, 5, 7, 5]),
        (SequenceSampling(0.0, 0, 1.0, output_from=2, processing=second), [4, 4, 6]),
        (SequenceSampling(1.0, 0, 1.0, output_from=1), [2, 3]),
    ]


def from_scratch(sampling: SequenceSampling, tokens: list[int], logits: torch.Tensor) -> torch.Tensor:
    """logits [V] after `tokens` (committed and drafted alike), processed by a row built anew."""
    p, start = sampling.processing, sampling.output_from
    adjust = build([(p, tokens[:start], tokens[start:])], torch.zeros(1, 0, dtype=torch.long), VOCAB)
    out = adjust.apply(logits.view(1, 1, VOCAB))[0, 0]
    if p.bad_words:
        allowed = bad_word_masks([(p.bad_words, tokens[start:])], torch.zeros(1, 0, dtype=torch.long), VOCAB)[0, 0]
        out = out.masked_fill(~allowed, float("-inf"))
    return out


def test_the_fork_and_every_branch_are_processed_with_their_own_history():
    gen = torch.Generator().manual_seed(0)
    table = rows()
    spec = torch.tensor([[7, 8, 5], [6, 4, 9], [1, 1, 1]])
    rnd = ForkAdjustments(table, spec, VOCAB)
    glue = torch.randn(3, K + 1, VOCAB, generator=gen)
    got = rnd.glue(glue, None)
    for r, (sampling, tokens) in enumerate(table):
        for accepted in range(K + 1):
            history = tokens + spec[r, :accepted].tolist()
            assert torch.equal(got[r, accepted], from_scratch(sampling, history, glue[r, accepted]))
    # Branches: outcome (accepted count), candidate c; then two depths of drawn tokens.
    outcome = torch.tensor([[0, 1, 2, 3], [0, 0, 3, 3], [1, 2, 2, 0]])
    cand = torch.tensor([[8, 7, 9, 13], [5, 6, 7, 4], [3, 2, 7, 8]])
    tree = rnd.tree(cand, outcome, BatchSampling.of([s for s, _ in table]))
    drawn: list[torch.Tensor] = []
    for depth in range(3):
        logits = torch.randn(3, 4, VOCAB, generator=gen)
        processed = tree.adjust.apply(logits.view(12, 1, VOCAB)).view(3, 4, VOCAB)
        masks = tree.masks()
        if masks is not None:
            processed = processed.masked_fill(~masks, float("-inf"))
        for r, (sampling, tokens) in enumerate(table):
            for n in range(4):
                accepted, c = int(outcome[r, n]), int(cand[r, n])
                history = tokens + spec[r, :accepted].tolist() + [c] + [int(d[r, n]) for d in drawn]
                expected = from_scratch(sampling, history, logits[r, n])
                # A draft's form rounds a penalty otherwise (ssd/processing/draft_adjustments.py); -inf where it is.
                torch.testing.assert_close(processed[r, n], expected, rtol=1e-6, atol=1e-6, msg=str((depth, r, n)))
        drawn.append(torch.randint(4, 20, (3, 4), generator=gen))
        # Branch (0, 1) ends in its candidate 7 (so 8 is refused at depth 0), draws 4 (8 allowed
        # again), then 7 (refused again): the bad word (7, 8) follows the branch's own tail.
        drawn[-1][0, 1] = 4 if depth == 0 else 7
        tree.advance(drawn[-1])


def test_which_sequences_are_processed():
    table = rows()
    assert [processes(s) for s, _ in table] == [True, True, False]
    assert processes(SequenceSampling(1.0, 0, 1.0, processing=Processing(bad_words=((3,),))))


@pytest.fixture
def no_leaked_workers():
    yield
    assert live_draft_workers() == []


def test_a_two_worker_pool_drafts_under_penalties_and_is_accepted(demo_pair, no_leaked_workers):
    """Demo pair, 8 held-out prompts, 64 tokens, K=6, frequency and presence penalty 0.5, a
    2-worker shm pool (tests/test_penalties.py measures SD's draft the same way): acceptance 0.50
    with drafters that ignore the penalties, 0.64 with them (SD's processed draft: 0.63)."""
    from ssd.model.demo_models import heldout_prompts

    params = SamplingParams(temperature=0.0, max_tokens=64, frequency_penalty=0.5, presence_penalty=0.5)
    prompts = heldout_prompts(8, prompt_bytes=80)
    with LLM(*demo_pair, mode="ssd", k=6, draft_workers=2) as llm:
        assert llm.engine.config.draft_transport == "shm"
        outs = llm.generate(prompts, params)
        ssd = llm.metrics()["ssd"]
    assert ssd["draft_workers_live"] == 2 and ssd["draft_worker_failures"] == 0, ssd
    acceptance = sum(o.metrics["accepted_tokens"] for o in outs) / sum(o.metrics["draft_tokens"] for o in outs)
    assert acceptance > 0.58, acceptance
    assert outs[0].token_ids == hf_adjusted_greedy(demo_pair[0], prompts[0], params)
