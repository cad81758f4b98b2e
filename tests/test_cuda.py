"""The exactness tests on a CUDA device (the whole module is skipped without one).

On CUDA the engine runs its device round (sampling, verification and the speculation's logits on
the GPU, one copy to the host per round), which CPU runs only when a test forces it. Here it runs
as users run it:
1. greedy output equals Hugging Face `generate` on the same device, in ar, sd and ssd (the draft
   pool over shm, its workers on the GPU too), batched with admissions mid-flight;
2. sampled output follows the target's distribution (chi-square of the first two tokens, as in
   test_sampling_exactness.py) in sd and ssd at T=1 and with top-p;
3. the device functions on CUDA agree with the host reference on inputs where float rounding
   cannot flip a decision;
4. with two GPUs, a tensor-parallel target over NCCL gives Hugging Face's greedy output.
"""

from __future__ import annotations

import pytest
import torch
from test_sampling_exactness import CASES, P_MIN, check_first_two, sample_first_two
from test_verify import random_dists
from tiny_models import noisy_copy, peaked_model, save_models
from transformers import AutoModelForCausalLM, AutoTokenizer

from ssd import LLM, SamplingParams
from ssd.engine.verify import verify_on_device, verify_reference
from ssd.model.demo_models import ModelShape

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPTS = ["def add(a, b):\n    return", "x", "import os\n", "class Stack:\n    def push(self, item):"]
MAX_TOKENS = 32


def hf_greedy_on(path: str, prompts: list[str], device: str) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32).to(device).eval()
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    outs = []
    for prompt in prompts:
        ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)], device=device)
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_TOKENS)
        outs.append(gen[0, ids.shape[1] :].tolist())
    return outs


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_greedy_on_cuda_matches_hf_generate(tiny_pair, mode):
    expected = hf_greedy_on(tiny_pair[0], PROMPTS, "cuda")
    with LLM(*tiny_pair, mode=mode, k=4, device="cuda", max_num_seqs=2, ssd_autobudget=False) as llm:
        assert llm.engine.device_round
        # Lengths differ: rows finish at different rounds and queued ones are admitted mid-flight.
        params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS - 6 * (i % 3)) for i in range(len(PROMPTS))]
        outs = llm.generate(PROMPTS, params)
        graphs = llm.engine.engine_metrics()["cuda_graphs"]
    for out, want, p in zip(outs, expected, params):
        assert out.token_ids == want[: p.max_tokens]
    assert graphs["target"]["replays"] > 0 and (mode != "sd" or graphs["draft"]["replays"] > 0), graphs


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("mode", ["ar", "sd"])
def test_steady_state_runs_no_eager_forward(tiny_pair, mode, temperature):
    """Once every bucket met is captured, decoding replays graphs only: a second identical
    generate captures nothing and runs no eager forward but its prefill; the round's device steps
    (verification, SD's sampled draws) replay theirs, none run eagerly."""
    with LLM(*tiny_pair, mode=mode, k=4, device="cuda", max_num_seqs=4) as llm:
        params = SamplingParams(temperature=temperature, max_tokens=MAX_TOKENS, ignore_eos=True, seed=0)
        llm.generate(PROMPTS, params)
        before = llm.engine.engine_metrics()["cuda_graphs"]
        llm.generate(PROMPTS, params)
        after = llm.engine.engine_metrics()["cuda_graphs"]
    for name in after:
        assert after[name]["captures"] == before[name]["captures"], (before, after)
        assert after[name]["eager_forwards"] - before[name]["eager_forwards"] <= 1, (before, after)  # the prefill
        assert after[name]["replays"] > before[name]["replays"], (before, after)
        assert after[name]["step_captures"] == before[name]["step_captures"] and after[name]["step_eager"] == 0
    assert after["target"]["step_replays"] > before["target"]["step_replays"], (before, after)
    if mode == "sd" and temperature > 0:
        assert after["draft"]["step_replays"] > before["draft"]["step_replays"], (before, after)


def test_enforce_eager_gives_the_graphs_output(tiny_pair):
    outs = {}
    for eager in (False, True):
        with LLM(*tiny_pair, mode="sd", k=4, device="cuda", max_num_seqs=2, enforce_eager=eager) as llm:
            assert (llm.engine.target.graphs is None) == eager
            outs[eager] = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24))]
    assert outs[False] == outs[True]


@pytest.mark.parametrize("transport", ["shm", "torch", "grpc"])
def test_ssd_draft_transports_on_cuda_match_hf_generate(tiny_pair, transport):
    """Two draft workers on a GPU, over each transport; torch moves tensors GPU to GPU over NCCL,
    which refuses two processes on one GPU: with one GPU the engine says so, with two the
    workers draft on cuda:1."""
    expected = hf_greedy_on(tiny_pair[0], PROMPTS, "cuda")
    args = dict(mode="ssd", k=4, device="cuda", draft_transport=transport, draft_workers=2, max_num_seqs=2)
    if transport == "torch" and torch.cuda.device_count() < 2:
        with pytest.raises(ValueError, match="NCCL, which refuses two processes on one GPU"):
            LLM(*tiny_pair, **args)
        return
    if transport == "torch":
        args["draft_device"] = "cuda:1"
    with LLM(*tiny_pair, **args, ssd_autobudget=False) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
        m = llm.metrics()
    assert [o.token_ids for o in outs] == expected
    assert m["ssd"]["draft_worker_failures"] == 0, m


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallelism over NCCL needs two GPUs")
@pytest.mark.parametrize("mode", ["ar", "ssd"])
def test_tensor_parallel_on_two_gpus_matches_hf_generate(tiny_pair, mode):
    """The target over two ranks on cuda:0 and cuda:1, its collectives over NCCL (never run so far:
    the project's GPU machine has one GPU)."""
    expected = hf_greedy_on(tiny_pair[0], PROMPTS, "cuda")
    with LLM(*tiny_pair, mode=mode, k=4, device="cuda", tensor_parallel_size=2, max_num_seqs=2) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    assert [o.token_ids for o in outs] == expected


@pytest.fixture(scope="module")
def peaked_dirs(tmp_path_factory) -> dict[str, str]:
    target = peaked_model(0, ModelShape(64, 2, 2, 128), 30.0)
    close = noisy_copy(target, seed=5, relative=0.05)
    return save_models(tmp_path_factory.mktemp("cuda_exactness"), {"target": target, "close": close})


@pytest.mark.parametrize("mode", ["sd", "ssd"])
@pytest.mark.parametrize("case", ["temperature1", "top_p0.8"])
def test_sampling_on_cuda_follows_the_target_distribution(peaked_dirs, mode, case):
    params = CASES[case]
    with LLM(peaked_dirs["target"], peaked_dirs["close"], mode=mode, k=3, device="cuda", max_num_seqs=512) as llm:
        prompt_ids, outs = sample_first_two(llm, params, seed_base=300_000)
    target = AutoModelForCausalLM.from_pretrained(peaked_dirs["target"], local_files_only=True).eval()
    result = check_first_two(target, prompt_ids, outs, params)  # exact law from a CPU float32 forward
    assert min(result["first"], result["joint"], result["second_given_top"]) > P_MIN, result


@pytest.mark.parametrize("seed", range(4))
def test_verify_on_cuda_equals_the_reference(seed):
    """Uniforms kept away from every acceptance threshold, so that float rounding differences
    between devices cannot decide a draw; the bonus draw is checked where it is a point mass."""
    gen = torch.Generator().manual_seed(seed)
    b, k, vocab = 8, 5, 50
    draft_probs = random_dists(gen, (b, k, vocab))
    draft_tokens = draft_probs.argmax(-1)
    target_probs = random_dists(gen, (b, k + 1, vocab))
    drafted = draft_tokens.unsqueeze(-1)
    ratio = (target_probs[:, :k].gather(-1, drafted) / draft_probs.gather(-1, drafted)).squeeze(-1)  # [b, k]
    # u < p/q accepts: aim at half the ratio (accept) or halfway to 1 (reject), never near it.
    reject = (torch.rand(b, k, generator=gen) < 0.4) & (ratio < 0.9)
    uniforms = torch.where(reject, (ratio + 1) / 2, ratio.clamp(max=1) / 2)
    bonus_u = torch.zeros(b)  # the first token of positive mass: the same on every device
    num_draft = torch.randint(0, k + 1, (b,), generator=gen)
    args = (draft_tokens, draft_probs, target_probs, num_draft, uniforms, bonus_u)
    want = verify_reference(*args)
    got = verify_on_device(*(a.cuda() for a in args))
    assert torch.equal(got.num_accepted.cpu(), want.num_accepted)
    assert torch.equal(got.bonus_tokens.cpu(), want.bonus_tokens)


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_penalties_and_logprobs_on_cuda_match_the_cpu_engine(tiny_pair, mode):
    """The round's adjustments and log-probabilities where the logits are (the device)."""
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, frequency_penalty=0.8, logit_bias={32: -3.0}, logprobs=3),
        SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=1.3, min_tokens=20, logprobs=1),
    ]
    outs = {}
    for device in ("cpu", "cuda"):
        with LLM(*tiny_pair, mode=mode, k=4, device=device, ssd_autobudget=False) as llm:
            outs[device] = llm.generate(PROMPTS[:2], params)
    for cpu, gpu in zip(outs["cpu"], outs["cuda"]):
        assert gpu.token_ids == cpu.token_ids
        for a, b in zip(cpu.logprobs, gpu.logprobs):
            assert a.chosen.token_id == b.chosen.token_id and abs(a.chosen.logprob - b.chosen.logprob) < 1e-3
