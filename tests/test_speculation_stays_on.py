"""Every request field that changes the distribution keeps speculation on: under each one, in sd
and in ssd through a 2-worker pool, the response's statistics show more than one accepted draft
token per round (the demo pair, greedy, K=6). A field that turned speculation off, or a drafter
that ignored it badly, would show about 0 here."""

from __future__ import annotations

import pytest
from workers import live_draft_workers

from ssd import LLM, SamplingParams
from ssd.processing.structured import StructuredOutputs

PROMPT = "def add(a, b):\n    return"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}
FIELDS = {
    "logprobs": dict(logprobs=5, prompt_logprobs=2),
    "frequency_presence": dict(frequency_penalty=0.5, presence_penalty=0.5),
    "repetition": dict(repetition_penalty=1.2),
    "logit_bias": dict(logit_bias={32: 2.0, 101: -5.0}),
    "min_p": dict(min_p=0.1),
    "min_tokens": dict(min_tokens=48),
    "allowed_token_ids": dict(allowed_token_ids=list(range(9, 127))),
    "bad_words": dict(bad_words=["self", " de"]),
    "json_schema": dict(structured_outputs=StructuredOutputs(json=SCHEMA)),
    "regex": dict(structured_outputs=StructuredOutputs(regex=r"[a-z]+\(a, b\)( [+*-] [a-z]+\(a, b\))*")),
}


@pytest.fixture
def no_leaked_workers():
    yield
    assert live_draft_workers() == []


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_every_field_keeps_more_than_one_accepted_token_per_round(demo_pair, mode, no_leaked_workers):
    params = [SamplingParams(temperature=0.0, max_tokens=48, **fields) for fields in FIELDS.values()]
    engine = dict(mode=mode, k=6, max_num_seqs=len(params))
    if mode == "ssd":
        engine["draft_workers"] = 2
    with LLM(*demo_pair, **engine) as llm:
        outs = llm.generate([PROMPT] * len(params), params)
    accepted = {name: out.metrics["mean_accepted_per_round"] for name, out in zip(FIELDS, outs)}
    assert all(a > 1 for a in accepted.values()), accepted
