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
        ({"max_tokens": 0}, "max_tokens must be >= 1"),
        ({"stop": [""]}, "stop"),
        ({"unknown_field": 1}, "unknown_field"),
    ],
)
def test_sampling_params_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


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


def test_prompt_plus_max_tokens_beyond_context(llm):
    with pytest.raises(ValueError, match="exceeds the context length 64: lower max_tokens to at most 54"):
        llm.generate("0123456789", SamplingParams(max_tokens=60))


def test_bad_request_leaves_engine_usable(llm):
    with pytest.raises(ValueError):
        llm.generate(["fine", ""], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished()
    assert len(llm.generate("fine", SamplingParams(max_tokens=3, temperature=0))[0].token_ids) == 3


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"k": 0}, "k"),
        ({"mode": "beam"}, "mode"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"not_an_option": True}, "not_an_option"),
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
