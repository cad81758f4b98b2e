"""Stop strings, stop tokens, EOS, max_tokens, context length, and streaming deltas."""

from __future__ import annotations

import pytest
import torch

from ssd import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_pair):
    return LLM(*tiny_pair, mode="sd", k=4)


def test_stop_string_truncates_text_at_first_occurrence(llm):
    free = llm.generate("def f(x):", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    stop = free.text[10:12]
    assert stop and free.text.find(stop) >= 0
    out = llm.generate("def f(x):", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == free.text[: free.text.find(stop)]
    # The tokens stop with the one that completed the stop string: a prefix of the free run.
    assert out.token_ids == free.token_ids[: len(out.token_ids)]
    assert llm.tokenizer.decode(out.token_ids).endswith(stop) or stop in llm.tokenizer.decode(out.token_ids)


def test_stop_token_id_and_max_tokens(llm):
    free = llm.generate("import", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 30
    target = free.token_ids[7]
    out = llm.generate("import", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[target]))[0]
    first = free.token_ids.index(target)
    assert out.token_ids == free.token_ids[: first + 1] and out.finish_reason == "stop"


def test_eos_ends_unless_ignored(tiny_pair):
    # The test edits the loaded weights in place; packed copies (made at load) would not see that.
    llm = LLM(*tiny_pair, mode="ar", pack_target_weights=False)
    eos = llm.engine.stopper.eos_token_id
    # Make EOS the greedy choice after any input by biasing the target's output layer.
    with torch.no_grad():
        llm.engine.target.model.lm_head.weight[eos].fill_(0.0)
        llm.engine.target.model.lm_head.bias = None
        llm.engine.target.model.lm_head.weight[eos] += 50 * llm.engine.target.model.model.norm.weight.sign()
    out = llm.generate("abc", SamplingParams(temperature=0, max_tokens=10))[0]
    assert out.token_ids[-1] == eos and out.finish_reason == "stop" and len(out.token_ids) < 10
    out = llm.generate("abc", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    assert len(out.token_ids) == 10 and out.finish_reason == "length"


def test_context_length_is_never_exceeded(tiny_pair):
    llm = LLM(*tiny_pair, mode="sd", k=6, max_model_len=24)
    prompt = "0123456789"
    out = llm.generate(prompt, SamplingParams(temperature=1.0, max_tokens=14, ignore_eos=True, seed=3))[0]
    assert len(out.token_ids) == 14


def test_stream_deltas_add_up_to_final_output(llm):
    params = SamplingParams(temperature=0.8, max_tokens=40, seed=11, stop=["\n\n"])
    final = llm.generate("class A:", params)[0]
    chunks = list(llm.generate_stream("class A:", params))
    assert chunks[-1].finished and all(not c.finished for c in chunks[:-1])
    assert "".join(c.delta_text for c in chunks) == final.text
    assert sum((c.delta_token_ids for c in chunks), []) == final.token_ids


def test_stream_holds_back_partial_stop_string(llm):
    free = llm.generate("x = ", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    stop = free.text[5:9]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop])
    sent = ""
    for chunk in llm.generate_stream("x = ", params):
        sent += chunk.delta_text
        assert stop not in sent
    assert sent == free.text[: free.text.find(stop)]


def test_generate_returns_only_its_own_requests(llm):
    """Regression: requests added to the engine directly used to count toward generate()'s
    completion, which then failed looking up its own unfinished outputs."""
    llm.engine.add_request("other", SamplingParams(max_tokens=2, temperature=0))
    outs = llm.generate("mine", SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    assert len(outs) == 1 and outs[0].prompt_token_ids == list(b"mine") and len(outs[0].token_ids) == 20
    while llm.engine.has_unfinished():
        llm.engine.step()
