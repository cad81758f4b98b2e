"""End to end through `LLM`: sampled output follows the target model's own distribution.

Tiny random Llama models (byte vocabulary, 258 tokens) with weights scaled up so next-token
distributions are peaked and vary with the context. One fixed prompt is repeated N times with
distinct seeds; the empirical distribution of the first generated token, and of the pair
(first, second), is compared by chi-square with the exact distribution computed from a plain
Hugging Face forward of the target plus an independent (numpy) statement of temperature /
top-k / top-p. Under mode "sd" the second token comes from every path: an accepted draft token,
the residual after a rejection, or the bonus after full acceptance in the previous round.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from refimpl import chi_square_p, reference_probs
from tiny_models import noisy_copy, peaked_model, save_models
from transformers import AutoModelForCausalLM

from ssd import LLM, SamplingParams
from ssd.model.demo_models import ModelShape

P_MIN = 1e-3  # chi-square threshold; seeds are fixed, so a pass is reproducible
PROMPT = "def f(x):"
N = 4000  # samples per case
WEIGHT_SCALE = 30.0  # peaked distributions: a handful of tokens hold most of the mass


# ---- models --------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def single_thread():
    """These models are tiny: intra-op threads only add synchronization (10x slower on a busy
    machine). One thread for this module; the previous setting comes back afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    """target; close (the target plus weight noise: acceptance ~0.15-0.3 at k=3); far (an
    independent model: almost every round rejects everything)."""
    target = peaked_model(0, ModelShape(64, 2, 2, 128), WEIGHT_SCALE)
    close = noisy_copy(target, seed=5, relative=0.05)
    far = peaked_model(1, ModelShape(32, 1, 2, 64), WEIGHT_SCALE)
    return save_models(tmp_path_factory.mktemp("exactness_models"), {"target": target, "close": close, "far": far})


@pytest.fixture(scope="module")
def engines(model_dirs) -> dict[str, LLM]:
    kw = dict(max_num_seqs=4096)
    return {
        "sd": LLM(model_dirs["target"], model_dirs["close"], mode="sd", k=3, **kw),
        "sd_far": LLM(model_dirs["target"], model_dirs["far"], mode="sd", k=3, **kw),
        "ar": LLM(model_dirs["target"], model_dirs["close"], mode="ar", **kw),
    }


@pytest.fixture(scope="module")
def hf_models(model_dirs) -> dict:
    return {
        name: AutoModelForCausalLM.from_pretrained(model_dirs[name], local_files_only=True, dtype=torch.float32).eval()
        for name in ("target", "far")
    }


# ---- exact distributions -------------------------------------------------------------------


@torch.no_grad()
def next_token_probs(model, contexts: list[list[int]], params: SamplingParams) -> np.ndarray:
    """Exact next-token distributions [len(contexts), V] (contexts of equal length)."""
    logits = model(input_ids=torch.tensor(contexts)).logits[:, -1].double().numpy()
    return np.stack([reference_probs(row, params.temperature, params.top_k, params.top_p) for row in logits])


def sample_first_two(llm: LLM, params: SamplingParams, seed_base: int, n: int = N):
    prompt_ids = llm.tokenizer.encode(PROMPT, add_special_tokens=False)
    plist = [params.model_copy(update={"seed": seed_base + i, "max_tokens": 2, "ignore_eos": True}) for i in range(n)]
    # A few first: if generation raises, it does so before thousands of requests are queued
    # (aborting them one by one after an error is slow).
    outs = llm.generate([prompt_ids] * 8, plist[:8])
    outs += llm.generate([prompt_ids] * (n - 8), plist[8:])
    assert all(len(o.token_ids) == 2 for o in outs)
    return prompt_ids, outs


def check_first_two(target, prompt_ids, outs, params: SamplingParams) -> dict:
    """Chi-square of the first token, of the pair (first, second), and of the second token given
    the most common first token, against the target's exact distributions."""
    vocab = target.config.vocab_size
    first = np.array([o.token_ids[0] for o in outs])
    second = np.array([o.token_ids[1] for o in outs])
    p1 = next_token_probs(target, [prompt_ids], params)[0]  # [V]
    firsts = sorted(set(first.tolist()) | set(np.nonzero(p1 > 1e-4)[0].tolist()))
    p2 = next_token_probs(target, [prompt_ids + [t] for t in firsts], params)  # [F, V]

    p_first = chi_square_p(np.bincount(first, minlength=vocab), p1)
    # Joint over (t1 in firsts) x V plus one bin for first tokens outside `firsts`.
    index = {t: i for i, t in enumerate(firsts)}
    joint_counts = np.zeros(len(firsts) * vocab + 1)
    for a, b in zip(first, second):
        joint_counts[index[int(a)] * vocab + int(b)] += 1
    joint_probs = np.concatenate([(p1[firsts, None] * p2).ravel(), [max(0.0, 1.0 - p1[firsts].sum())]])
    p_joint = chi_square_p(joint_counts, joint_probs)
    top = Counter(first.tolist()).most_common(1)[0][0]
    p_cond = chi_square_p(np.bincount(second[first == top], minlength=vocab), p2[index[top]])
    return {"first": p_first, "joint": p_joint, "second_given_top": p_cond, "p1": p1}


# ---- tests ---------------------------------------------------------------------------------

CASES = {
    "temperature1": SamplingParams(temperature=1.0),
    "top_p0.8": SamplingParams(temperature=1.0, top_p=0.8),
    "top_k5": SamplingParams(temperature=1.0, top_k=5),
    "t0.7_k8_p0.9": SamplingParams(temperature=0.7, top_k=8, top_p=0.9),
}


@pytest.mark.parametrize("case", list(CASES))
def test_sd_first_tokens_follow_target_distribution(engines, hf_models, case):
    params = CASES[case]
    llm = engines["sd"]
    prompt_ids, outs = sample_first_two(llm, params, seed_base=100_000 * (1 + list(CASES).index(case)))
    result = check_first_two(hf_models["target"], prompt_ids, outs, params)
    assert result["first"] > P_MIN, result
    assert result["joint"] > P_MIN, result
    assert result["second_given_top"] > P_MIN, result
    # Both acceptance and rejection happened on the way.
    accepted = sum(o.metrics["accepted_tokens"] for o in outs)
    drafted = sum(o.metrics["draft_tokens"] for o in outs)
    assert 0.05 * drafted < accepted < 0.9 * drafted, (accepted, drafted)


@pytest.mark.parametrize("case", ["temperature1", "t0.7_k8_p0.9"])
def test_ar_first_tokens_follow_target_distribution(engines, hf_models, case):
    params = CASES[case]
    prompt_ids, outs = sample_first_two(engines["ar"], params, seed_base=900_000)
    result = check_first_two(hf_models["target"], prompt_ids, outs, params)
    assert min(result["first"], result["joint"], result["second_given_top"]) > P_MIN, result


def test_sd_with_unrelated_draft_rejects_often_and_stays_exact(engines, hf_models):
    """An independent random draft: most rounds reject every draft token (the bonus then comes
    from the residual), yet the output follows the target, not the draft."""
    params = SamplingParams(temperature=1.0)
    llm = engines["sd_far"]
    prompt_ids, outs = sample_first_two(llm, params, seed_base=500_000)
    nothing_accepted = sum(o.metrics["accepted_tokens"] == 0 for o in outs)
    rounds = sum(o.metrics["rounds"] for o in outs)
    accepted = sum(o.metrics["accepted_tokens"] for o in outs)
    # Each sequence that accepted nothing ran only all-rejected rounds (2 of them here).
    assert nothing_accepted > 0.6 * N, (nothing_accepted, rounds)
    assert accepted > 0  # a few draft tokens do get through
    result = check_first_two(hf_models["target"], prompt_ids, outs, params)
    assert result["first"] > P_MIN, result
    assert result["joint"] > P_MIN, result
    assert result["second_given_top"] > P_MIN, result
    # Power: the same samples are clearly not from the draft's distribution.
    draft_p1 = next_token_probs(hf_models["far"], [prompt_ids], params)[0]
    first = np.array([o.token_ids[0] for o in outs])
    assert chi_square_p(np.bincount(first, minlength=len(draft_p1)), draft_p1) < 1e-6


def test_seeded_requests_are_reproducible(engines):
    llm = engines["sd"]
    prompts = [PROMPT, "import os\n", "x", "class A:\n    def", "# comment", "return"]
    params = [
        SamplingParams(temperature=1.0, max_tokens=24, seed=7, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, seed=8, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=5, max_tokens=20, seed=9, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1.2, max_tokens=24, seed=10, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=20, top_p=0.95, max_tokens=18, seed=11, ignore_eos=True),
    ]
    alone = [llm.generate(prompts[0], params[0])[0].token_ids for _ in range(2)]
    assert alone[0] == alone[1]
    assert len(alone[0]) == 24
    batch = [[o.token_ids for o in llm.generate(prompts, params)] for _ in range(2)]
    assert batch[0] == batch[1]
    # A request's stream depends only on its own seed: the same tokens alone and in a batch.
    assert batch[0][0] == alone[0]
    # Different seeds give different samples.
    others = llm.generate([PROMPT] * 4, [params[0].model_copy(update={"seed": s}) for s in (101, 102, 103, 104)])
    assert len({tuple(o.token_ids) for o in others} | {tuple(alone[0])}) == 5
    # The same seeds through ar: reproducible too.
    ar = engines["ar"]
    assert ar.generate(prompts, params)[2].token_ids == ar.generate(prompts, params)[2].token_ids
