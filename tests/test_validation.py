"""Bad input raises ValueError naming the parameter and its allowed range."""

from __future__ import annotations

import pytest

from ssd import LLM, SamplingParams


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k must be >= 0"),
        ({"max_tokens": -1}, "max_tokens must be >= 0"),
        ({"logprobs": 21}, r"logprobs must be in \[0, 20\]"),
        ({"logprobs": -1}, r"logprobs must be in \[0, 20\]"),
        ({"prompt_logprobs": 99}, r"prompt_logprobs must be in \[0, 20\]"),
        ({"stop": [""]}, "stop"),
        ({"stop": 5}, "stop must be a non-empty string or a list"),
        ({"stop": ["x"] * 33}, "stop takes at most 32 strings, got 33"),
        ({"stop": ["x"] * 10_000}, "stop takes at most 32 strings"),
        ({"stop": "x" * 257}, "stop strings must be at most 256 characters long, got one of 257"),
        ({"stop": ["ok", "x" * 2**20]}, "stop strings must be at most 256 characters"),
        ({"stop_token_ids": [-5]}, "stop_token_ids must be token ids >= 0"),
        ({"stop_token_ids": [3, -1]}, "stop_token_ids must be token ids >= 0.*got -1"),
        ({"seed": 2**70}, r"seed must be in \[0, 2\*\*64 - 1\]"),
        ({"seed": 2**64}, r"seed must be in \[0, 2\*\*64 - 1\]"),
        ({"seed": -1}, r"seed must be in \[0, 2\*\*64 - 1\]"),
        ({"unknown_field": 1}, "unknown_field"),
    ],
)
def test_sampling_params_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_sampling_params_edges_accepted():
    assert SamplingParams(seed=0).seed == 0 and SamplingParams(seed=2**64 - 1).seed == 2**64 - 1
    assert len(SamplingParams(stop=["x" * 256] * 32).stop) == 32
    # Below 1e-5 a temperature is greedy, and stored as 0 so every component sees greedy.
    for tiny in (1e-40, 5e-324, 9.9e-6):
        assert SamplingParams(temperature=tiny).temperature == 0.0 and SamplingParams(temperature=tiny).greedy
    assert SamplingParams(temperature=1e-5).temperature == 1e-5


@pytest.fixture(scope="module")
def llm(tiny_pair):
    return LLM(*tiny_pair, mode="sd", k=3, max_model_len=64)


def test_empty_prompt(llm):
    with pytest.raises(ValueError, match="prompt must not be empty"):
        llm.generate("", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="prompt must not be empty"):
        llm.generate([[]], SamplingParams(max_tokens=2))


def test_token_outside_vocabulary(llm):
    with pytest.raises(ValueError, match=r"token id 9999 is outside the vocabulary \[0, 258\)"):
        llm.generate([[1, 2, 9999]], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[-1]], SamplingParams(max_tokens=2))


def test_stop_token_id_outside_vocabulary(llm):
    for bad in (258, 10**9):
        with pytest.raises(ValueError, match=rf"stop_token_ids: token id {bad} is outside the vocabulary \[0, 258\)"):
            llm.generate("fine", SamplingParams(max_tokens=2, stop_token_ids=[1, bad]))
    assert not llm.engine.has_unfinished()
    assert len(llm.generate("fine", SamplingParams(max_tokens=2, stop_token_ids=[257]))[0].token_ids) >= 1


def test_tiny_temperature_is_greedy(llm, demo_pair):
    """temperature=1e-40 once overflowed 1/T to nan probabilities and sampled PAD (id 257)."""
    prompt = "def f(x):"
    demo = LLM(*demo_pair, mode="ar", max_model_len=64)
    for engine in (llm, demo):
        greedy = engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8))[0].token_ids
        for t in (1e-40, 1e-5):
            assert (
                engine.generate(prompt, SamplingParams(temperature=t, max_tokens=8, seed=3))[0].token_ids == greedy
            ), t
    demo.close()


def test_prompt_plus_max_tokens_beyond_context(llm):
    with pytest.raises(ValueError, match="exceeds the context length 64: lower max_tokens to at most 54"):
        llm.generate("0123456789", SamplingParams(max_tokens=60))


def test_bad_request_leaves_engine_usable(llm):
    with pytest.raises(ValueError):
        llm.generate(["fine", ""], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished()
    # Regression: max_tokens and stop token ids were checked only as each request was queued,
    # so the good requests before a bad one stayed queued.
    for bad in (SamplingParams(max_tokens=60), SamplingParams(max_tokens=2, stop_token_ids=[10**6])):
        with pytest.raises(ValueError):
            llm.generate(["fine", "0123456789"], [SamplingParams(max_tokens=2), bad])
        assert not llm.engine.has_unfinished()
    assert len(llm.generate("fine", SamplingParams(max_tokens=3, temperature=0))[0].token_ids) == 3


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"k": 0}, "k"),
        ({"mode": "beam"}, "mode"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"not_an_option": True}, "not_an_option"),
        ({"seed": -1}, r"seed\s+Input should be greater than or equal to 0"),
        ({"seed": 2**64}, r"seed\s+Input should be less than or equal to 18446744073709551615"),
    ],
)
def test_engine_args_rejected(tiny_pair, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(*tiny_pair, **kwargs)


def test_draft_with_other_vocabulary_refused(tiny_pair, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_pair[1], local_files_only=True)
    tok.add_tokens(["<extra_token>"])
    other = tmp_path / "draft"
    import shutil

    shutil.copytree(tiny_pair[1], other)
    tok.save_pretrained(other)
    with pytest.raises(ValueError, match="draft vocabulary does not match the target's"):
        LLM(tiny_pair[0], str(other), mode="sd")


def test_max_model_len_above_model_limit(tiny_pair):
    with pytest.raises(ValueError, match="exceeds the models' context length 512"):
        LLM(*tiny_pair, max_model_len=4096)
