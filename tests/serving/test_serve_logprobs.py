"""Log-probabilities over HTTP with the official `openai` client, on the real Serve deployment:
completions (`logprobs`, `echo`, the scoring call lm-evaluation-harness makes: echo, max_tokens
0, logprobs 1), chat (`logprobs`, `top_logprobs`), streamed or not; each number is the target's,
checked against a plain Hugging Face forward over the same tokens."""

from __future__ import annotations

import pytest
import torch

openai = pytest.importorskip("openai")

from transformers import AutoModelForCausalLM  # noqa: E402

PROMPT = "def add(a, b):\n    return"


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.http + "/v1", api_key=served.api_key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def hf_rows(tiny_pair):
    """token ids -> [len - 1, V] log-probabilities, row i predicting token i + 1."""
    model = AutoModelForCausalLM.from_pretrained(tiny_pair[0], local_files_only=True, dtype=torch.float32).eval()

    @torch.no_grad()
    def rows(ids: list[int]) -> torch.Tensor:
        return torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, :-1].double(), -1)

    return rows


def prompt_ids(served_tokenizer, text: str) -> list[int]:
    return served_tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def tokenizer(tiny_pair):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_pair[0], local_files_only=True)


@pytest.mark.parametrize("mode", ["ssd", "sd", "ar"])
def test_completion_logprobs_are_the_targets(client, tokenizer, hf_rows, mode):
    resp = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        logprobs=3,
        extra_body={"return_token_ids": True, "speculation": {"mode": mode}},
    )
    choice = resp.choices[0]
    ids = choice.token_ids
    rows = hf_rows(prompt_ids(tokenizer, PROMPT) + ids)[-len(ids) :]
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids)
    if "\ufffd" not in "".join(lp.tokens):  # a byte of a multi-byte character decodes to U+FFFD alone
        assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
    for i, token in enumerate(ids):
        assert lp.token_logprobs[i] == pytest.approx(float(rows[i, token]), abs=2e-4)
        top = rows[i].topk(3)
        # Keyed by the token's text: tokens that decode alike (bytes of a multi-byte character)
        # share a key, as in OpenAI's format; each value is still one of the top 3.
        values = sorted(lp.top_logprobs[i].values(), reverse=True)
        want = top.values.tolist()
        if len(values) == len(want):
            assert values == pytest.approx(want, abs=2e-4)
        assert all(min(abs(v - w) for w in want) < 2e-4 for v in values)


def test_scoring_a_prompt_with_echo_and_max_tokens_zero(client, tokenizer, hf_rows):
    """lm-evaluation-harness's loglikelihood request."""
    resp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1, temperature=0)
    choice = resp.choices[0]
    ids = prompt_ids(tokenizer, PROMPT)
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert resp.usage.completion_tokens == 0
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and len(lp.tokens) == len(ids)
    rows = hf_rows(ids)
    want = [float(rows[i, t]) for i, t in enumerate(ids[1:])]
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=2e-4)
    assert "".join(lp.tokens) == PROMPT


def test_echo_with_a_completion_streamed_and_not(client):
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0, echo=True, logprobs=2)
    whole = client.completions.create(**kw).choices[0]
    chunks = list(client.completions.create(stream=True, **kw))
    text = "".join(c.choices[0].text for c in chunks)
    assert text == whole.text and whole.text.startswith(PROMPT)
    streamed = [x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    # To float rounding: under the served auto mode the two requests' rounds may run in different
    # modes, whose forwards round differently in the last bits.
    assert streamed == pytest.approx(whole.logprobs.token_logprobs, abs=1e-5)
    offsets = [x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.text_offset]
    assert offsets == whole.logprobs.text_offset


def test_chat_logprobs_streamed_and_not(client):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=10, temperature=0)
    plain = client.chat.completions.create(**kw).choices[0]
    assert plain.logprobs is None
    whole = client.chat.completions.create(logprobs=True, top_logprobs=2, **kw).choices[0]
    assert whole.message.content == plain.message.content
    content = whole.logprobs.content
    if "\ufffd" not in "".join(c.token for c in content):
        assert "".join(c.token for c in content) == whole.message.content
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content)
    assert all(bytes(c.bytes).decode() == c.token for c in content)
    chunks = list(client.chat.completions.create(logprobs=True, top_logprobs=2, stream=True, **kw))
    streamed = [x.logprob for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.content]
    assert streamed == pytest.approx([c.logprob for c in content], abs=1e-5)  # as above: rounding only
