"""The budget sizer, and tree decodes cut short by an early outcome (still exact)."""

from __future__ import annotations

import pytest
import torch
from refimpl import hf_greedy

from ssd import LLM, SamplingParams
from ssd.core.speculation import Source
from ssd.drafting.budget import BudgetSizer
from ssd.drafting.ssd_proposer import SSDProposer
from ssd.drafting.tree_drafter import TreeDrafter
from ssd.model.demo_models import heldout_prompts

MAX_TOKENS = 24


# ---- budget sizing ------------------------------------------------------------------------------


def _drive(sizer: BudgetSizer, c0: float, c1: float, rounds: int = 200, noise: float = 0.0) -> float:
    gen = torch.Generator().manual_seed(0)
    budget = sizer.budget
    for _ in range(rounds):
        used = max(1, int(round(budget)))
        ratio = c0 + c1 * used + noise * float(torch.randn(1, generator=gen))
        budget = sizer.observe(used, ratio)
    return budget


def test_sizer_finds_the_budget_that_fits_one_verification():
    # Build = 0.5 of a verification plus 0.02 per branch: 25 branches fit exactly.
    sizer = BudgetSizer(max_budget=64)
    assert _drive(sizer, 0.5, 0.02, noise=0.02) == pytest.approx(25, abs=3)
    assert sizer.c0 == pytest.approx(0.5, abs=0.1) and sizer.c1 == pytest.approx(0.02, abs=0.01)


def test_sizer_with_a_large_fixed_cost_keeps_more_than_one_branch():
    """The old proportional rule read 'build = 0.8 verification at B = 2' as 'B = 2 is the
    most that fits' and starved the cache; the fixed share must not be scaled with B."""
    sizer = BudgetSizer(max_budget=32)
    assert _drive(sizer, 0.8, 0.01) == pytest.approx(20, abs=3)


def test_sizer_ignores_a_slow_first_round():
    """Regression: the first builds after loading took up to 5 verifications while B came down
    from 16; least squares read that as a steep per-branch cost (c0 < 0) and held B at its
    minimum for the rest of the run."""
    sizer = BudgetSizer(max_budget=16, min_budget=7)
    for used, ratio in [
        (16, 5.2),
        (15, 4.0),
        (14, 3.1),
        (13, 2.6),
        (12, 2.4),
        (11, 1.8),
        (10, 1.5),
        (9, 1.3),
        (8, 1.2),
    ]:
        sizer.observe(used, ratio)
    assert _drive(sizer, 0.6, 0.02, rounds=40, noise=0.05) >= 14  # 0.6 + 0.02 * 16 < 1: all fit


def test_sizer_respects_its_bounds():
    assert _drive(BudgetSizer(max_budget=16), 0.1, 0.001) == 16  # everything fits
    assert _drive(BudgetSizer(max_budget=16, min_budget=7), 1.5, 0.05) == 7  # nothing fits


# ---- tree decodes cut short -------------------------------------------------------------------


class _CutAfter:
    """An `interrupted` callback that reports the outcome's arrival after `depth` tree depths."""

    def __init__(self, depth: int) -> None:
        self.depth, self.polls = depth, 0

    def __call__(self) -> bool:
        self.polls += 1
        return self.polls >= self.depth


@pytest.mark.parametrize("depth", [1, 2])
def test_cut_trees_stay_exact(tiny_pair, monkeypatch, depth):
    target, draft = tiny_pair
    prompts = heldout_prompts(2, prompt_bytes=60) + ["def add(a, b):\n    return"]
    expected = hf_greedy(target, prompts, MAX_TOKENS)
    original = TreeDrafter.begin_round
    monkeypatch.setattr(
        TreeDrafter,
        "begin_round",
        lambda self, msg, interrupted=None, stale=None: original(self, msg, _CutAfter(depth), stale),
    )
    lengths: list[tuple[int, int]] = []  # (source, num_draft) of every row of every round
    propose = SSDProposer.propose

    def spy(self, seqs, k, sampling):
        spec = propose(self, seqs, k, sampling)
        lengths.extend(zip(spec.source.tolist(), spec.num_draft.tolist()))
        return spec

    monkeypatch.setattr(SSDProposer, "propose", spy)
    with LLM(
        target,
        draft,
        mode="ssd",
        k=4,
        ssd_budget=12,
        ssd_autobudget=False,
        ssd_backup="fast",
        draft_transport="inprocess",
        max_num_seqs=2,
    ) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    assert [o.token_ids for o in outs] == expected
    hits = [n for src, n in lengths if src == int(Source.CACHE)]
    assert hits and all(n == depth for n in hits), lengths


@pytest.mark.parametrize("depth", [1, 2])
def test_cut_speculations_still_hit(tiny_pair, monkeypatch, depth):
    """Regression: the branches of a cut speculation (L < K tokens) went to the round's
    outcomes past L, which cannot happen; with a draft equal to the target all the budget sits
    at full acceptance, so every cut speculation missed (hit rate 0.70 over the shm channel)."""
    target = tiny_pair[0]
    original = TreeDrafter.begin_round
    monkeypatch.setattr(
        TreeDrafter,
        "begin_round",
        lambda self, msg, interrupted=None, stale=None: original(self, msg, _CutAfter(depth), stale),
    )
    with LLM(
        target,
        target,
        mode="ssd",
        k=4,
        ssd_budget=8,
        ssd_autobudget=False,
        ssd_backup="neural",
        draft_transport="inprocess",
        max_num_seqs=1,
    ) as llm:
        llm.generate(["def add(a, b):\n    return"], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
        m = llm.metrics()
    # The first round has no cache; every later one hits with `depth` tokens, all accepted.
    assert m["cache_hits"] == m["rounds"] - 1, m
    assert m["acceptance_rate"] >= 0.98, m


# ---- rounds begun on a prediction ---------------------------------------------------------------


def _drafter(tiny_pair, k: int = 4) -> TreeDrafter:
    from transformers import AutoModelForCausalLM

    from ssd.model.runner import draft_runner

    model = AutoModelForCausalLM.from_pretrained(tiny_pair[1], local_files_only=True).eval()
    return TreeDrafter(draft_runner(model, "cpu", True), model.config.vocab_size, k)


def _snapshot(drafter: TreeDrafter) -> tuple:
    cache = drafter.cache
    lengths = cache.lengths()
    layers = cache._storage.layers.values()
    committed = [keys[r, :, : int(n)].clone() for keys, _ in layers for r, n in enumerate(lengths)]
    return lengths, committed, drafter.states[1].generator.get_state()


@pytest.mark.parametrize("when", ["after the glue", "mid-tree", "after the build"])
def test_a_predicted_round_is_taken_back_whole(tiny_pair, when):
    """The draft worker begins the next round on a prediction (after a reply that carried every
    row's speculation) before the target announces it. When the announcement differs, the round
    is taken back: cache and generator as before, so the real round draws and caches exactly
    what it would have."""
    from ssd.core.protocol import AdmitMsg, BeginRoundMsg, ResolveMsg
    from ssd.core.sampling import SequenceSampling

    k, fanout = 4, [1, 1, 1, 1, 2]
    runs = []
    for predicted in (False, True):
        drafter = _drafter(tiny_pair, k)
        drafter.admit(AdmitMsg([1], [list(b"def add(a, b):\n    ret")], [7], [SequenceSampling(1.0, 0, 1.0)]))
        first = BeginRoundMsg(1, [1], torch.tensor([[117, 114, 110, 32]]), torch.tensor([4]), fanout)
        assert drafter.begin_round(first)
        resolve = ResolveMsg(1, [1], torch.tensor([4]), torch.tensor([97]), False, fanout)
        drafter.resolve(resolve)
        reply = drafter.reply()
        if predicted:
            before = _snapshot(drafter)
            guess = (
                drafter.predict_round(resolve, reply)
                if bool(reply.hit.all())
                else BeginRoundMsg(2, [1], torch.tensor([[1, 2, 3, 4]]), torch.tensor([4]), fanout)
            )
            polls = {"after the glue": 1, "mid-tree": 3, "after the build": None}[when]
            count = iter(range(1, 100))
            built = drafter.begin_round(guess, stale=lambda: polls is not None and next(count) >= polls)
            assert built == (polls is None)
            if built:
                drafter.abandon_round()
            after = _snapshot(drafter)
            assert torch.equal(before[0], after[0]) and all(torch.equal(x, y) for x, y in zip(before[1], after[1]))
            assert torch.equal(before[2], after[2]) and drafter.round is None
        # The round the target really announces (a different speculation than the guess).
        actual = BeginRoundMsg(2, [1], torch.tensor([[10, 32, 43, 32]]), torch.tensor([4]), fanout)
        assert drafter.begin_round(actual)
        runs.append((drafter.round.tokens.clone(), drafter.round.probs.dense(0)))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


def test_prediction_needs_every_rows_speculation_and_the_next_fanout(tiny_pair):
    """A worker predicts the next round when its reply carried every row's next speculation: a
    hit's branch or a miss's just-in-time draft (the target verifies either), not when a row was
    left to another shard or to the target's fast backup (num_draft 0)."""
    from ssd.core.protocol import AdmitMsg, BeginRoundMsg, ResolveMsg, SpeculationReply
    from ssd.core.sampling import SequenceSampling

    drafter = _drafter(tiny_pair)
    drafter.admit(AdmitMsg([1, 2], [[1, 2, 3], [4, 5]], [1, 2], [SequenceSampling(0.0, 0, 1.0)] * 2))
    tokens, probs = torch.tensor([[5, 6, 7, 8], [9, 9, 0, 0]]), torch.zeros(2, 4, 3)
    hit = SpeculationReply(3, [1, 2], torch.tensor([True, True]), tokens, probs, torch.tensor([4, 2]))
    miss = SpeculationReply(3, [1, 2], torch.tensor([True, False]), tokens, probs, torch.tensor([4, 0]))
    resolve = ResolveMsg(3, [1, 2], torch.tensor([1, 2]), torch.tensor([7, 7]), False, [1, 1, 1, 1, 1])
    guess = drafter.predict_round(resolve, hit)
    # committed: the drafter's own token counts (here the prompts': no outcome was resolved)
    assert guess.same_round(BeginRoundMsg(4, [1, 2], tokens, torch.tensor([4, 2]), [1, 1, 1, 1, 1], [3, 2]))
    assert not guess.same_round(BeginRoundMsg(4, [1, 2], tokens, torch.tensor([4, 2]), [1, 1, 1, 1, 1], [3, 3]))
    assert drafter.predict_round(resolve, miss) is None
    drafted = SpeculationReply(3, [1, 2], torch.tensor([True, False]), tokens, probs, torch.tensor([4, 4]))
    after_miss = drafter.predict_round(resolve, drafted)  # row 2's miss drafted just in time
    assert after_miss.same_round(BeginRoundMsg(4, [1, 2], tokens, torch.tensor([4, 4]), [1, 1, 1, 1, 1], [3, 2]))
    assert drafter.predict_round(ResolveMsg(3, [1, 2], torch.tensor([1, 2]), torch.tensor([7, 7]), False), hit) is None


def test_the_drafter_keeps_its_accepted_drafts_columns_and_glues_only_what_is_new(tiny_pair):
    """After an outcome the drafter's cache holds every committed token but the last (the
    invariant every glue starts from), the accepted drafts' columns from the round's own glue:
    they hold what a prefill of the committed tokens computes, and the next glue feeds only the
    bonus token and the next speculation (it fed the accepted drafts again before)."""
    from ssd.core.protocol import AdmitMsg, BeginRoundMsg, ResolveMsg
    from ssd.core.sampling import SequenceSampling

    k, fanout, prompt = 4, [1, 1, 1, 1, 2], list(b"def add(a, b):\n    ret")
    spec = [117, 114, 110, 32]
    drafter = _drafter(tiny_pair, k)
    drafter.admit(AdmitMsg([1], [prompt], [7], [SequenceSampling(0.0, 0, 1.0)]))
    assert drafter.begin_round(BeginRoundMsg(1, [1], torch.tensor([spec]), torch.tensor([4]), fanout))
    drafter.resolve(ResolveMsg(1, [1], torch.tensor([2]), torch.tensor([97]), False, fanout))
    committed = prompt + spec[:2] + [97]
    assert drafter.states[1].tokens == committed and int(drafter.cache.lengths()[0]) == len(committed) - 1

    fresh = _drafter(tiny_pair, k)
    fresh.admit(AdmitMsg([1], [committed], [7], [SequenceSampling(0.0, 0, 1.0)]))
    n = len(committed) - 1
    for (keys, values), (want_k, want_v) in zip(
        drafter.cache._storage.layers.values(), fresh.cache._storage.layers.values()
    ):
        torch.testing.assert_close(keys[0, :, :n], want_k[0, :, :n], atol=1e-5, rtol=0)
        torch.testing.assert_close(values[0, :, :n], want_v[0, :, :n], atol=1e-5, rtol=0)

    fed = []
    forward = drafter.runner.forward
    drafter.runner.forward = lambda cache, tokens, *a, **kw: (
        fed.append(tokens.shape[1]) or forward(cache, tokens, *a, **kw)
    )
    assert drafter.begin_round(BeginRoundMsg(2, [1], torch.tensor([[10, 32, 43, 32]]), torch.tensor([4]), fanout))
    assert fed[0] == 1 + 4  # the glue: the bonus token, then the speculation
