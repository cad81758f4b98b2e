"""The draft side's device round: SD's proposal and SSD's drafter read nothing back per forward
when their runner is on an accelerator (forced on here, on the CPU, as the engine's test forces
its own device round).

1. The fork and the speculation-cache lookup are tensor functions: they equal their loop
   statements on random grids.
2. The drafters' device steps (the fork's ranking, the lookup, a depth's or a proposal's
   sampling) trace under torch.compile(fullgraph=True, backend="eager"): no host read inside.
3. A drafter on its device round answers exactly what its host round answers: hits, coverage,
   ranks, tokens and distributions, over greedy, sampled and top-k rows, with and without
   Saguaro's scaling, hits and misses (the neural backup) alike.
4. The engine's sd and ssd (an in-process drafter) give the same tokens with the draft's device
   round on as off; a draft that draws from a distribution without mass fails the round there
   as the host's sampler fails it.
"""

from __future__ import annotations

import pytest
import torch
from test_device_round import _sampling, _traces

from ssd import LLM, SamplingParams
from ssd.core.protocol import RANK_DEPTH, AdmitMsg, BeginRoundMsg, ResolveMsg
from ssd.core.sampling import SequenceSampling, process_logits_on_device, sample_on_device
from ssd.drafting.saguaro import saguaro_probs
from ssd.drafting.tree import BranchProbs, SpeculationTree, fork, rank_candidates
from ssd.drafting.tree_drafter import TreeDrafter
from ssd.model.runner import draft_runner


def _fork_by_loops(glue_logits, spec_tokens, lens, row_fan):
    """The fork as the rule states it, row by row: -> candidates [b][N] and (j, candidate) -> n per row."""
    cands, index = [], []
    for r, fan in enumerate(row_fan):
        row, where = [], {}
        for j, f in enumerate(fan):
            logits = glue_logits[r, j].clone()
            if j < int(lens[r]):
                logits[int(spec_tokens[r, j])] = float("-inf")  # never the drafted token
            for t in logits.topk(f).indices.tolist():
                where[(j, t)] = len(row)
                row.append(t)
        cands.append(row)
        index.append(where)
    return cands, index


@pytest.mark.parametrize("seed", range(5))
def test_the_fork_and_the_lookup_equal_their_loop_statements(seed):
    gen = torch.Generator().manual_seed(seed)
    b, k, vocab = 3, 4, 150
    glue = torch.randn(b, k + 1, vocab, generator=gen)
    spec = torch.randint(0, vocab, (b, k), generator=gen)
    lens = torch.tensor([k, 2, 0])
    fans = [[2, 1, 1, 3, 2], [3, 3, 3, 0, 0], [9, 0, 0, 0, 0]]
    grid = fork(glue, spec, lens, fans)
    cands, index = _fork_by_loops(glue, spec, lens, fans)
    assert grid.candidates.tolist() == cands
    assert grid.outcome.tolist() == [[j for j, f in enumerate(fan) for _ in range(f)] for fan in fans]
    for trial in range(20):  # outcomes in the grid and out of it
        acc = torch.randint(0, k + 1, (b,), generator=gen)
        pick = torch.randint(0, 9, (b,), generator=gen)
        bonus = (
            grid.candidates[torch.arange(b), pick] if trial % 2 == 0 else torch.randint(0, vocab, (b,), generator=gen)
        )
        on_host = SpeculationTree([], [], grid, torch.zeros(b, 0, 0, dtype=torch.long), BranchProbs(vocab, [True] * b))
        rows = [2, 0, 1]  # the rows of the round in any order
        found = on_host.lookup(rows, acc[rows].tolist(), bonus[rows].tolist())
        covered, branch, rank = ([x[rows.index(r)] for r in range(b)] for x in found)
        for r in range(b):
            n = index[r].get((int(acc[r]), int(bonus[r])))
            assert (covered[r], branch[r]) == (int(n is not None), n if n is not None else 0)
            order = grid.ranked[r, acc[r]].tolist()
            assert rank[r] == (order.index(int(bonus[r])) if int(bonus[r]) in order else RANK_DEPTH)


def test_the_drafters_device_steps_trace_without_a_graph_break():
    gen = torch.Generator().manual_seed(0)
    b, k, vocab, n = 2, 4, 64, 6
    glue = torch.randn(b, k + 1, vocab, generator=gen)
    spec, real = torch.randint(0, vocab, (b, k), generator=gen), torch.ones(b, k, dtype=torch.bool)
    flat = torch.randint(0, (k + 1) * 8, (b, n), generator=gen)
    _traces(lambda *a: rank_candidates(*a, 8), glue, spec, real, flat)
    sampling = _sampling(gen, b, vocab)

    def depth(step_logits, fan, uniforms):  # one tree depth's (or one proposal position's) draw
        probs = saguaro_probs(process_logits_on_device(step_logits, sampling), fan, 0.5)
        return sample_on_device(probs, uniforms), probs

    _traces(depth, torch.randn(b, n, vocab, generator=gen), torch.full((b, n), 2), torch.rand(b, n, generator=gen))


def _drafter(tiny_pair, device_round: bool, saguaro_c: float) -> TreeDrafter:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_pair[1], local_files_only=True).eval()
    d = TreeDrafter(draft_runner(model, "cpu", True), model.config.vocab_size, 4, saguaro_c=saguaro_c)
    d.device_round = d.just_in_time.device_round = device_round
    return d


def _replies(d: TreeDrafter, rounds: int = 6) -> list:
    """Rounds over a greedy, a sampled and a top-k row; outcomes alternate between branches of
    the round's grid (hits) and tokens it lacks (misses, answered by the neural backup)."""
    gen = torch.Generator().manual_seed(1)
    rows = [SequenceSampling(0.0, 0, 1.0), SequenceSampling(1.0, 0, 1.0), SequenceSampling(0.8, 5, 0.9)]
    prompts = [torch.randint(0, 200, (n,), generator=gen).tolist() for n in (7, 3, 12)]
    d.admit(AdmitMsg([0, 1, 2], prompts, [11, 12, 13], rows))
    fanout, out = [2, 2, 1, 1, 3], []
    for i in range(rounds):
        spec = torch.randint(0, 200, (3, 4), generator=gen)
        assert d.begin_round(BeginRoundMsg(i, [0, 1, 2], spec, torch.tensor([4, 4, 2]), fanout))
        acc = torch.tensor([i % 3, 2, 1])
        grid = d.round.grid
        in_grid = grid.candidates[torch.arange(3), (grid.outcome == acc.unsqueeze(1)).long().argmax(1)]
        bonus = torch.where(torch.tensor([i % 2 == 0, True, i % 3 == 0]), in_grid.cpu(), torch.tensor(255))
        d.resolve(ResolveMsg(i, [0, 1, 2], acc, bonus, True, fanout))
        out.append(d.reply())
    return out


@pytest.mark.parametrize("saguaro_c", [1.0, 0.5])
def test_a_drafter_answers_the_same_on_its_device_round(tiny_pair, saguaro_c):
    host, device = (_replies(_drafter(tiny_pair, on, saguaro_c)) for on in (False, True))
    assert any(bool(r.hit.any()) for r in host) and any(not bool(r.hit.all()) for r in host)
    for h, d in zip(host, device):
        for field in ("hit", "covered", "bonus_rank", "tokens", "num_draft", "probs"):
            assert torch.equal(getattr(h, field), getattr(d, field)), field


@pytest.mark.parametrize("cut", [0, 2])
def test_a_device_round_queues_the_next_depth_and_a_cut_drops_it(tiny_pair, cut):
    """The device round issues depth d + 1 before it asks whether to stop after depth d (the
    device then never waits for the host); an outcome arriving after depth `cut` leaves the
    same cut tree as the host round's, the queued depth dropped."""

    def built(device_round: bool):
        d = _drafter(tiny_pair, device_round, 0.5)
        rows = [SequenceSampling(1.0, 0, 1.0), SequenceSampling(0.0, 0, 1.0)]
        d.admit(AdmitMsg([0, 1], [[5, 9, 14], [3, 7]], [1, 2], rows))
        forward, issued, asked = d.runner.forward, [0], []

        def counted(*args, **kwargs):
            issued[0] += 1
            return forward(*args, **kwargs)

        def interrupted() -> bool:  # the outcome arrives after depth `cut`
            asked.append(issued[0])
            return len(asked) > cut

        d.runner.forward = counted
        spec = torch.tensor([[11, 12, 13, 14], [21, 22, 23, 24]])
        assert d.begin_round(BeginRoundMsg(0, [0, 1], spec, torch.tensor([4, 3]), [2, 2, 1, 1, 2]), interrupted)
        hits = d.round.grid.candidates[:, 0].cpu()  # outcome 0's first branch in both rows
        d.resolve(ResolveMsg(0, [0, 1], torch.tensor([0, 0]), hits, True, [2, 2, 1, 1, 2]))
        return d.reply(), asked

    (host, host_asked), (device, device_asked) = built(False), built(True)
    assert host.hit.all() and host.num_draft.tolist() == [cut + 1, cut + 1]
    for field in ("hit", "tokens", "num_draft", "probs"):
        assert torch.equal(getattr(host, field), getattr(device, field)), field
    # Forwards issued when depth d's halt was asked: the glue's, then depths 0..d (host) or 0..d+1.
    assert host_asked == [d + 2 for d in range(cut + 1)]
    assert device_asked == [d + 3 for d in range(cut + 1)]


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_the_engine_gives_the_same_tokens_with_the_drafts_device_round(tiny_pair, mode):
    prompts = ["def add(a, b):\n    return", "x", "import os\n"]
    options = {"ssd_reproducible": True, "draft_transport": "inprocess"} if mode == "ssd" else {}
    with LLM(*tiny_pair, max_num_seqs=4, mode=mode, k=4, **options) as llm:
        proposer = llm.engine.proposers[mode]
        drafts = [proposer] if mode == "sd" else [proposer.client, proposer.client.just_in_time]

        def generate(device_round: bool, params) -> list[list[int]]:
            llm.engine.device_round = device_round
            for d in drafts:
                d.device_round = device_round
            return [o.token_ids for o in llm.generate(prompts, params)]

        greedy = SamplingParams(temperature=0.0, max_tokens=20)
        assert generate(True, greedy) == generate(False, greedy)
        for seed in range(2):
            params = SamplingParams(temperature=1.0, top_k=20, max_tokens=20, seed=seed)
            assert generate(True, params) == generate(False, params)
        # Penalties and logprobs follow the drafts on the host: the device round reads them back first.
        params = SamplingParams(temperature=1.0, max_tokens=20, seed=5, repetition_penalty=1.3, logprobs=2)
        assert generate(True, params) == generate(False, params)


def test_a_draft_without_mass_fails_the_device_round_as_it_fails_the_host_round(tiny_pair):
    with LLM(*tiny_pair, max_num_seqs=2, mode="sd", k=4) as llm:
        sd = llm.engine.proposers["sd"]
        forward = sd.runner.forward

        def non_finite(*args, **kwargs):  # every draft logit NaN, as a draft overflowing its dtype gives
            logits = forward(*args, **kwargs)
            return None if logits is None else logits * float("nan")

        sd.runner.forward = non_finite
        plain = SamplingParams(temperature=1.0, max_tokens=8, seed=0)
        # With penalties the drafts meet the adjustments' lookups first, and the engine's host copy.
        penalized = SamplingParams(temperature=1.0, max_tokens=8, seed=0, repetition_penalty=1.3, logprobs=1)
        for device_round in (False, True):
            llm.engine.device_round = sd.device_round = device_round
            for params in (plain, penalized):
                with pytest.raises(RuntimeError, match="distribution has no positive mass"):
                    llm.generate(["x"], params)
