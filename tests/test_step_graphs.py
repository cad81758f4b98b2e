"""A round's captured device steps (ssd/model/step_graphs.py): the same results as the
uncaptured functions, and the buffers' mechanics, on CPU.

1. verify_step's greedy shortcut (two kernels from the logits) equals the reference rule on the
   processed one-hot distributions, ties and drafts of -1 included; its "logits" form equals
   processing then verifying; draw_step's greedy draw equals sampling the processed one-hot rows.
2. StepGraphs(capture=False) runs each step on static buffers as a replay would: rows padded
   to a power of two, refilled per call, the call's rows copied out, None inputs kept, a
   signature past MAX_GRAPHS or a failed capture run eagerly.
3. The engine's device round through StepGraphs(capture=False), the SD draft's draws and the
   SSD tree's too, gives the host round's tokens, greedy (= Hugging Face) and sampled.
4. Both steps trace under torch.compile(fullgraph=True): capturable.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from refimpl import hf_greedy
from test_device_round import _sampling, _traces
from test_verify import random_dists

from ssd import LLM, SamplingParams
from ssd.core.sampling import BatchSampling, process_logits, sample_from
from ssd.drafting.sd_proposer import draw_step
from ssd.engine.verify import verify_reference, verify_step
from ssd.model import step_graphs
from ssd.model.cuda_graphs import GraphStats
from ssd.model.step_graphs import StepGraphs

CPU = torch.device("cpu")


def _round_inputs(gen: torch.Generator, b: int, k: int, vocab: int):
    logits = torch.randn(b, k + 1, vocab, generator=gen) * 3
    logits[..., :4] = logits[..., 4:8]  # ties: the argmax is the first of them, as process_logits' one-hot
    best = logits.argmax(-1)
    # Drafts that follow the target's argmax for a while, then stray; some rows draft fewer; one -1.
    drafted = torch.where(
        torch.rand(b, k, generator=gen) < 0.8, best[:, :k], torch.randint(0, vocab, (b, k), generator=gen)
    )
    num_draft = torch.randint(0, k + 1, (b,), generator=gen)
    drafted[0, 0] = -1 if b > 1 else drafted[0, 0]
    return logits, drafted, num_draft, torch.rand(b, k + 1, generator=gen)


@pytest.mark.parametrize("seed", range(6))
def test_the_greedy_verify_step_equals_the_reference_rule(seed):
    gen = torch.Generator().manual_seed(seed)
    b, k, vocab = int(torch.randint(1, 7, (1,), generator=gen)), int(torch.randint(1, 7, (1,), generator=gen)), 50
    logits, drafted, num_draft, uniforms = _round_inputs(gen, b, k, vocab)
    logits[-1, -1, 9] = float("nan")  # a non-finite logit: both rules take the same argmax
    greedy = BatchSampling(torch.zeros(b), torch.zeros(b, dtype=torch.long), torch.ones(b))
    (counts,) = verify_step("greedy", logits, drafted, num_draft, None, None)
    one_hot = process_logits(logits, greedy)
    draft_probs = random_dists(gen, (b, k, vocab))  # a greedy target reads none of it
    for probs in (None, draft_probs):
        want = verify_reference(drafted.clamp(min=0), probs, one_hot, num_draft, uniforms[:, :-1], uniforms[:, -1])
        assert torch.equal(counts[:, :2], torch.stack([want.num_accepted, want.bonus_tokens], 1))
    in_spec = torch.arange(k).unsqueeze(0) < num_draft.unsqueeze(1)
    assert counts[:, 2].tolist() == ((drafted < 0) & in_spec).any(1).long().tolist()
    (as_logits,) = verify_step("logits", logits, drafted, num_draft, uniforms, None, *_settings(greedy))
    assert torch.equal(as_logits, counts)


def _settings(sampling: BatchSampling):
    return sampling.temperature, sampling.top_k, sampling.top_p


@pytest.mark.parametrize("seed", range(4))
def test_the_sampled_verify_step_equals_processing_then_the_reference(seed):
    gen = torch.Generator().manual_seed(seed)
    b, k, vocab = 5, 4, 60
    logits, drafted, num_draft, uniforms = _round_inputs(gen, b, k, vocab)
    drafted = drafted.clamp(min=0)
    sampling = _sampling(gen, b, vocab)
    draft_probs = random_dists(gen, (b, k, vocab))
    (counts,) = verify_step("logits", logits, drafted, num_draft, uniforms, draft_probs, *_settings(sampling))
    target = process_logits(logits, sampling)
    want = verify_reference(drafted, draft_probs, target, num_draft, uniforms[:, :-1], uniforms[:, -1])
    assert torch.equal(counts[:, :2], torch.stack([want.num_accepted, want.bonus_tokens], 1))
    (of_probs,) = verify_step("probs", target, drafted, num_draft, uniforms, draft_probs)
    assert torch.equal(of_probs, counts)


def test_the_greedy_draw_step_is_the_sampled_one_hot():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 2, 40, generator=gen)
    logits[..., 7] = logits[..., 3]  # a tie
    greedy = BatchSampling(torch.zeros(3), torch.zeros(3, dtype=torch.long), torch.ones(3))
    u = torch.rand(3, 2, generator=gen)
    (tokens,) = draw_step(48, True, logits, None)  # a target vocabulary larger than the draft's
    tok, probs = draw_step(48, False, logits, u, *_settings(greedy))
    assert torch.equal(tokens, tok) and probs.shape == (3, 2, 48)
    assert torch.equal(tokens, sample_from(process_logits(logits, greedy), u, one_hot=True))


def test_step_buffers_refill_copy_out_and_stop_capturing_past_the_limit(monkeypatch):
    stats = GraphStats()
    steps = StepGraphs(CPU, stats, capture=False)
    calls = []

    def fn(x, maybe, y):
        calls.append(maybe is None)
        return x * 2, x + y

    a, b = steps("f", fn, torch.ones(3), None, torch.full((3,), 5.0))
    assert a.tolist() == [2.0] * 3 and b.tolist() == [6.0] * 3 and calls == [True]
    a.fill_(0)  # a caller's copy: the step's own outputs are not touched
    a2, b2 = steps("f", fn, torch.arange(4.0), None, torch.zeros(4))  # 3 and 4 rows: one bucket
    assert a2.tolist() == [0.0, 2.0, 4.0, 6.0] and b2.tolist() == [0.0, 1.0, 2.0, 3.0]
    a3, _ = steps("f", fn, torch.full((3,), 7.0), None, torch.zeros(3))  # the rows given, not the bucket's
    assert a3.tolist() == [14.0] * 3 and len(steps.steps) == 1
    assert (stats.step_captures, stats.step_replays, stats.step_eager) == (1, 3, 0)
    steps("f", fn, torch.ones(5), None, torch.ones(5))  # another bucket: another step
    steps("g", fn, torch.ones(4), None, torch.ones(4))  # another name: another step
    assert len(steps.steps) == 3
    monkeypatch.setattr(step_graphs, "MAX_GRAPHS", 3)
    (c, _) = steps("f", fn, torch.ones(9), None, torch.ones(9))
    assert c.tolist() == [2.0] * 9 and stats.step_eager == 1 and len(steps.steps) == 3


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_the_device_round_through_step_buffers_gives_the_host_rounds_tokens(tiny_pair, mode):
    prompts = ["def add(a, b):\n    return", "x", "import os\n"]
    # SSD with Saguaro's scaling (C < 1), which the tree's draw step applies.
    options = {"ssd_reproducible": True, "draft_transport": "inprocess", "saguaro_c": 0.5} if mode == "ssd" else {}
    with LLM(*tiny_pair, max_num_seqs=4, mode=mode, k=4, **options) as llm:
        engine, stats = llm.engine, GraphStats()
        proposer = engine.proposers.get(mode)
        drafts = [] if mode == "ar" else [proposer] if mode == "sd" else [proposer.client, proposer.client.just_in_time]
        runners = [engine.target] + [d.runner for d in drafts]
        for runner in runners:
            runner.steps = StepGraphs(CPU, stats, capture=False)

        def generate(on_device: bool, params) -> list[list[int]]:
            engine.device_round = on_device
            for d in drafts:
                d.device_round = on_device
            return [o.token_ids for o in llm.generate(prompts, params)]

        assert generate(True, SamplingParams(temperature=0.0, max_tokens=24)) == hf_greedy(tiny_pair[0], prompts, 24)
        for seed in range(2):
            params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24, seed=seed)
            assert generate(True, params) == generate(False, params)
    names = {key[0].split(" V=")[0] for runner in runners for key in runner.steps.steps}
    want = {"ar": set(), "sd": {"draw"}, "ssd": {"tree draw"}}[mode] | {"verify greedy", "verify logits"}
    assert want <= names, names
    assert stats.step_replays > 0 and stats.step_eager == 0


def test_the_steps_trace_without_a_graph_break():
    gen = torch.Generator().manual_seed(0)
    b, k, vocab = 3, 4, 64
    logits, drafted, num_draft, uniforms = _round_inputs(gen, b, k, vocab)
    settings = _settings(_sampling(gen, b, vocab))
    draft_probs = random_dists(gen, (b, k, vocab))
    _traces(partial(verify_step, "greedy"), logits, drafted, num_draft, None, None)
    _traces(partial(verify_step, "logits"), logits, drafted, num_draft, uniforms, draft_probs, *settings)
    _traces(partial(draw_step, vocab, False), logits[:, :1], uniforms[:, :1], *settings)
    fanout = torch.randint(0, 4, (b, 1), generator=gen)
    _traces(partial(draw_step, vocab, False, c=0.5), logits[:, :1], uniforms[:, :1], *settings, fanout)


def test_a_step_that_cannot_be_captured_runs_eagerly_and_says_why(monkeypatch, caplog):
    stats = GraphStats()
    steps = StepGraphs(CPU, stats, capture=False)

    def refused(*args):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(steps, "_capture", refused)
    with caplog.at_level("WARNING", logger="ssd.model.step_graphs"):
        for _ in range(2):
            (out,) = steps("h", lambda x: (x + 1,), torch.zeros(2))
            assert out.tolist() == [1.0, 1.0]
    assert stats.step_eager == 2 and stats.step_captures == 0 and stats.step_replays == 0
    assert [r.getMessage().count("could not be captured") for r in caplog.records] == [1]  # said once
