"""Log-probabilities through `LLM`: each emitted token's (and each prompt token's) under the
target, compared with a plain Hugging Face forward over the same tokens, in every mode.

Speculation must not show in them: an accepted draft token, a residual or bonus token are all
reported from the target's distribution at their own position. Also: the entries stay aligned
with the tokens through stop rules and streaming, max_tokens=0 scores a prompt, the processed
mode reports the distribution the token was drawn from, and rows that did not ask pay nothing.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from refimpl import reference_probs
from transformers import AutoModelForCausalLM

from ssd import LLM, SamplingParams

PROMPTS = ["def add(a, b):\n    return", "x", "import os\nimport sys\n"]
ENGINES = {
    "ar": dict(mode="ar"),
    "sd": dict(mode="sd", k=4),
    "ssd": dict(mode="ssd", k=4, draft_transport="inprocess", ssd_autobudget=False),
}


@pytest.fixture(scope="module")
def hf_target(tiny_pair):
    return AutoModelForCausalLM.from_pretrained(tiny_pair[0], local_files_only=True, dtype=torch.float32).eval()


@torch.no_grad()
def hf_logprobs(model, tokens: list[int]) -> torch.Tensor:
    """[len(tokens) - 1, V]: row i is log p(. | tokens[: i + 1])."""
    logits = model(input_ids=torch.tensor([tokens])).logits[0, :-1].double()
    return torch.log_softmax(logits, -1)


def check_against_hf(model, prompt_ids: list[int], entries, tokens: list[int], top: int, start: int) -> None:
    """entries[i] describes tokens[i], predicted from prompt_ids + tokens[:i] (start: its offset
    in the full sequence's rows of hf_logprobs)."""
    want = hf_logprobs(model, prompt_ids + tokens)[start : start + len(tokens)]
    assert len(entries) == len(tokens)
    for i, (entry, token) in enumerate(zip(entries, tokens)):
        row = want[i]
        assert entry.chosen.token_id == token
        assert entry.chosen.logprob == pytest.approx(float(row[token]), abs=2e-4)
        assert entry.rank == int((row > row[token] + 1e-5).sum()) + 1
        assert len(entry.top) == top
        if top:
            assert [t.token_id for t in entry.top] == row.topk(top).indices.tolist()
            assert [t.logprob for t in entry.top] == pytest.approx(row.topk(top).values.tolist(), abs=2e-4)


@pytest.mark.parametrize("mode", list(ENGINES))
def test_greedy_logprobs_are_the_targets(tiny_pair, hf_target, mode):
    params = [SamplingParams(temperature=0.0, max_tokens=20, logprobs=top, prompt_logprobs=top) for top in (0, 3, 5)]
    with LLM(*tiny_pair, max_num_seqs=2, **ENGINES[mode]) as llm:
        outs = llm.generate(PROMPTS, params)
    for out, p in zip(outs, params):
        check_against_hf(
            hf_target, out.prompt_token_ids, out.logprobs, out.token_ids, p.logprobs, len(out.prompt_token_ids) - 1
        )
        prompt = out.prompt_logprobs
        assert prompt[0] is None and len(prompt) == len(out.prompt_token_ids)
        check_against_hf(hf_target, out.prompt_token_ids[:1], prompt[1:], out.prompt_token_ids[1:], p.logprobs, 0)


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_raw_logprobs_stay_the_models_under_penalties_and_bias(tiny_pair, hf_target, mode):
    """Processing writes into the logits it is given where nothing reads them after
    (Adjustments.apply's in_place): a round whose rows ask for raw logprobs keeps them as the
    model gave them."""
    bias = {int(t): 4.0 for t in range(97, 123)}  # lowercase letters: the bias changes the greedy path
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=3, repetition_penalty=1.5, logit_bias=bias)
    with LLM(*tiny_pair, **ENGINES[mode]) as llm:
        outs = llm.generate(PROMPTS[:2], params)
    for out in outs:
        check_against_hf(hf_target, out.prompt_token_ids, out.logprobs, out.token_ids, 3, len(out.prompt_token_ids) - 1)


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_sampled_logprobs_raw_and_processed(tiny_pair, hf_target, mode):
    """T=1 with top-p: raw = the model's log_softmax at each drawn token; processed = the log of
    the distribution it was drawn from (checked against the independent numpy reference)."""
    params = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, logprobs=2, seed=s) for s in range(3)]
    for logprobs_mode in ("raw", "processed"):
        with LLM(*tiny_pair, logprobs_mode=logprobs_mode, **ENGINES[mode]) as llm:
            outs = llm.generate(PROMPTS, params)
        for out, p in zip(outs, params):
            tokens = out.prompt_token_ids + out.token_ids
            with torch.no_grad():
                logits = hf_target(input_ids=torch.tensor([tokens])).logits[0].double().numpy()
            start = len(out.prompt_token_ids) - 1
            for i, entry in enumerate(out.logprobs):
                row = logits[start + i]
                if logprobs_mode == "raw":
                    want = row[entry.chosen.token_id] - np.logaddexp.reduce(row)
                else:
                    want = np.log(reference_probs(row, p.temperature, p.top_k, p.top_p)[entry.chosen.token_id])
                assert entry.chosen.logprob == pytest.approx(want, abs=2e-4), (logprobs_mode, i)


def test_logprobs_follow_the_tokens_through_stops_and_streams(tiny_pair):
    with LLM(*tiny_pair, **ENGINES["sd"]) as llm:
        free = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=24, logprobs=1))[0]
        stop_at = free.token_ids[7]
        cut = SamplingParams(temperature=0.0, max_tokens=24, logprobs=1, stop_token_ids=[stop_at])
        stopped = llm.generate(PROMPTS[0], cut)[0]
        assert stopped.token_ids == free.token_ids[: free.token_ids.index(stop_at) + 1]
        assert stopped.logprobs == free.logprobs[: len(stopped.token_ids)]
        chunks = list(llm.generate_stream(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=24, logprobs=1)))
        assert len(chunks) > 1
        assert [e for c in chunks for e in c.delta_logprobs] == free.logprobs
        plain = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=24))[0]
        assert plain.token_ids == free.token_ids
        assert plain.logprobs is None and plain.delta_logprobs is None and plain.prompt_logprobs is None


@pytest.mark.parametrize("mode", list(ENGINES))
def test_max_tokens_zero_scores_the_prompt_beside_running_requests(tiny_pair, hf_target, mode):
    from refimpl import hf_greedy

    scoring = SamplingParams(max_tokens=0, prompt_logprobs=1)
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    with LLM(*tiny_pair, max_num_seqs=3, **ENGINES[mode]) as llm:
        outs = llm.generate(PROMPTS + PROMPTS, [scoring] * 3 + [greedy] * 3)
        alone = llm.generate("x", scoring)[0]
    for out in outs[:3]:
        assert out.finish_reason == "length" and out.token_ids == [] and out.text == ""
        check_against_hf(hf_target, out.prompt_token_ids[:1], out.prompt_logprobs[1:], out.prompt_token_ids[1:], 1, 0)
    assert [o.token_ids for o in outs[3:]] == hf_greedy(tiny_pair[0], PROMPTS, 16)
    assert alone.prompt_logprobs == [None]


def test_the_device_round_reports_the_same_logprobs(tiny_pair):
    params = SamplingParams(temperature=1.0, max_tokens=16, logprobs=3, seed=7)
    got = {}
    for device_round in (False, True):
        with LLM(*tiny_pair, **ENGINES["sd"]) as llm:
            llm.engine.device_round = device_round
            got[device_round] = llm.generate(PROMPTS, params)
    for host, device in zip(got[False], got[True]):
        assert host.token_ids == device.token_ids
        assert host.logprobs == device.logprobs
