"""The round's device functions: the same rules as the host versions, and capturable.

1. process_logits_on_device, sample_on_device and verify_on_device equal process_logits,
   sample_from and verify_reference on random inputs of many shapes and settings.
2. Each step function of a round (those three, the target's verification forward and the
   draft's tree forward over the static KV cache) traces under torch.compile(fullgraph=True,
   backend="eager"): no graph break, so no host read inside. The check fails on the host versions.
3. The engine's device round (forced on here, as it runs on an accelerator) gives the host
   round's tokens, greedy and sampled, in every mode.
"""

from __future__ import annotations

import pytest
import torch
from refimpl import hf_greedy
from test_verify import random_dists

from ssd import LLM, SamplingParams
from ssd.core.sampling import (
    BatchSampling,
    process_logits,
    process_logits_on_device,
    sample_from,
    sample_on_device,
)
from ssd.engine.verify import verify_on_device, verify_reference
from ssd.model.kv_cache import additive_mask
from ssd.model.runner import draft_runner, target_runner


def _sampling(gen: torch.Generator, b: int, vocab: int) -> BatchSampling:
    """Rows greedy, plain, top-k, top-p and both, at random."""
    kind = torch.randint(0, 5, (b,), generator=gen)
    temperature = torch.where(kind == 0, 0.0, torch.rand(b, generator=gen) * 1.5 + 0.1)
    top_k = torch.where((kind == 2) | (kind == 4), torch.randint(1, vocab + 3, (b,), generator=gen), 0)
    top_p = torch.where(kind >= 3, torch.rand(b, generator=gen) * 0.9 + 0.05, 1.0)
    return BatchSampling(temperature, top_k, top_p)


@pytest.mark.parametrize("seed", range(6))
def test_process_logits_on_device_equals_the_host_version(seed):
    gen = torch.Generator().manual_seed(seed)
    b, n, vocab = int(torch.randint(1, 7, (1,), generator=gen)), int(torch.randint(1, 5, (1,), generator=gen)), 97
    logits = torch.randn(b, n, vocab, generator=gen) * 3
    logits[..., :5] = logits[..., 5:10]  # ties, which top-k keeps together
    for sampling in (_sampling(gen, b, vocab), _sampling(gen, b, vocab)):
        assert torch.equal(process_logits_on_device(logits, sampling), process_logits(logits, sampling))
    greedy = BatchSampling(torch.zeros(b), torch.zeros(b, dtype=torch.long), torch.ones(b))
    assert torch.equal(process_logits_on_device(logits, greedy), process_logits(logits, greedy))


@pytest.mark.parametrize("seed", range(4))
def test_sample_on_device_equals_sample_from(seed):
    gen = torch.Generator().manual_seed(seed)
    probs = random_dists(gen, (64, 3, 50))
    uniforms = torch.rand(64, 3, generator=gen)
    uniforms[0] = float(torch.nextafter(torch.tensor(1.0), torch.tensor(0.0)))  # u * total may round up to total
    assert torch.equal(sample_on_device(probs, uniforms), sample_from(probs, uniforms))
    empty = torch.zeros(2, 50)
    assert sample_on_device(empty, torch.rand(2, generator=gen)).tolist() == [-1, -1]


@pytest.mark.parametrize("seed", range(8))
def test_verify_on_device_equals_the_reference(seed):
    gen = torch.Generator().manual_seed(seed)
    b, k, vocab = int(torch.randint(1, 9, (1,), generator=gen)), int(torch.randint(0, 7, (1,), generator=gen)), 40
    draft_probs = random_dists(gen, (b, k, vocab))
    draft_tokens = sample_from(draft_probs, torch.rand(b, k, generator=gen)) if k else torch.zeros(b, 0).long()
    target_probs = random_dists(gen, (b, k + 1, vocab))
    num_draft = torch.randint(0, k + 1, (b,), generator=gen)
    uniforms = torch.rand(b, k + 1, generator=gen)
    args = (draft_tokens, draft_probs, target_probs, num_draft, uniforms[:, :-1], uniforms[:, -1])
    got, want = verify_on_device(*args), verify_reference(*args)
    assert torch.equal(got.num_accepted, want.num_accepted) and torch.equal(got.bonus_tokens, want.bonus_tokens)


# ---- capturable: no graph break --------------------------------------------------------------------


def _traces(fn, *args) -> None:
    torch._dynamo.reset()
    torch.compile(fn, fullgraph=True, backend="eager")(*args)


def test_sampling_and_verification_trace_without_a_graph_break():
    gen = torch.Generator().manual_seed(0)
    b, k, vocab = 3, 4, 64
    sampling = _sampling(gen, b, vocab)
    logits = torch.randn(b, k + 1, vocab, generator=gen)
    _traces(process_logits_on_device, logits, sampling)
    probs = random_dists(gen, (b, k, vocab))
    _traces(sample_on_device, probs, torch.rand(b, k, generator=gen))
    args = (sample_from(probs, torch.rand(b, k, generator=gen)), probs, random_dists(gen, (b, k + 1, vocab)),
            torch.full((b,), k), torch.rand(b, k, generator=gen), torch.rand(b, generator=gen))  # fmt: skip
    _traces(verify_on_device, *args)
    # The check is real: the host versions read device values to branch, and fail it.
    with pytest.raises(Exception, match="(?i)graph break|data-dependent|Unsupported"):
        _traces(process_logits, logits, sampling)
    with pytest.raises(Exception, match="(?i)graph break|data-dependent|Unsupported"):
        _traces(sample_from, probs, torch.rand(b, k, generator=gen))


def _loaded(path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype).eval()


@pytest.mark.parametrize("role", ["target", "draft"])
def test_forwards_over_the_static_cache_trace_without_a_graph_break(demo_pair, role):
    """The target's verification forward and the draft's tree forward (a scratch forward at
    explicit columns under a prebuilt mask), as a captured step would run them: the runner
    prepares the cache and the rotary table on the host, the step reads nothing back."""
    if role == "target":
        runner = target_runner(_loaded(demo_pair[0]), "cpu", True, pack=True)
    else:
        runner = draft_runner(_loaded(demo_pair[1], torch.bfloat16), "cpu", True)
    cache = runner.new_cache(2)
    runner.forward(cache, torch.randint(0, 200, (2, 9)), torch.arange(9).expand(2, 9) < torch.tensor([[9], [6]]))
    lengths = cache.lengths()
    if role == "target":  # [last token, K = 4 drafts]
        tokens, columns = torch.randint(0, 200, (2, 5)), None
        positions = lengths.unsqueeze(1) + torch.arange(5)
        width = cache.begin_forward(5, runner.device)
        mask = cache.attention_mask(torch.ones(2, 5, dtype=torch.bool), runner.attention_dtype, runner.device)
    else:  # one tree depth of 3 branches written past the longest row
        top = int(lengths.max())
        tokens, columns = torch.randint(0, 200, (2, 3)), (top + torch.arange(3)).expand(2, 3)
        positions = lengths.unsqueeze(1).expand(2, 3)
        width = cache.begin_forward(3, runner.device, columns)
        history = (torch.arange(top).view(1, 1, -1) < lengths.view(2, 1, 1)).expand(2, 3, top)
        allowed = torch.cat([history, torch.eye(3, dtype=torch.bool).expand(2, 3, 3)], dim=-1)
        mask = additive_mask(allowed, runner.attention_dtype).unsqueeze(1)
    assert mask.shape[-1] == width
    runner.lean.reserve_positions(int(positions.max()) + 1, runner.device)

    def step(tokens, mask, positions):
        return runner.lean(tokens, mask, positions, cache)

    with torch.inference_mode():
        _traces(step, tokens, mask, positions)


# ---- the engine's device round ---------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_the_device_round_gives_the_host_rounds_tokens(tiny_pair, mode):
    prompts = ["def add(a, b):\n    return", "x", "import os\n"]
    # ssd_reproducible: SSD's draws then never depend on timing (trees built whole), so two runs
    # with the same seeds can be compared token for token; one engine serves both kinds of round
    # (its drafter's seeds come from each request's).
    with LLM(*tiny_pair, max_num_seqs=4, ssd_reproducible=True, mode=mode, k=4) as llm:

        def generate(device_round: bool, params) -> list[list[int]]:
            llm.engine.device_round = device_round
            return [o.token_ids for o in llm.generate(prompts, params)]

        assert generate(True, SamplingParams(temperature=0.0, max_tokens=24)) == hf_greedy(tiny_pair[0], prompts, 24)
        for seed in range(3):
            params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24, seed=seed)
            host = generate(False, params)
            assert generate(True, params) == host
            assert host != generate(False, params.model_copy(update={"seed": seed + 10}))  # seeds matter here
