"""The OpenAI-compatible HTTP API on a real Ray Serve deployment (tests/serve_harness.py), called
with the official `openai` client and with raw HTTP:

1. greedy completions through HTTP equal Hugging Face `generate` token for token and the offline
   `LLM`'s text, for the default mode (ssd over Ray draft workers) and each per-request mode,
   concurrently (so requests of several modes share the replica's loop), and with a per-request k;
2. streaming (completions and chat) gives the same text, ends with `data: [DONE]`, and reports
   usage; chat renders the documented default template;
3. /v1/models, /health, the API key (every route but /health).
Bad inputs, backpressure, disconnects and concurrency are in test_serve_limits.py.
"""

from __future__ import annotations

import asyncio

import pytest

openai = pytest.importorskip("openai")
requests = pytest.importorskip("requests")

from refimpl import hf_greedy  # noqa: E402

from ssd import LLM, SamplingParams  # noqa: E402
from ssd.model.demo_models import heldout_prompts  # noqa: E402

MAX_TOKENS = 24
PROMPTS = heldout_prompts(2, prompt_bytes=80) + ["def add(a, b):\n    return"]


@pytest.fixture(scope="module")
def reference(tiny_pair) -> list[list[int]]:
    return hf_greedy(tiny_pair[0], PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.http + "/v1", api_key=served.api_key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def aclient(served):
    return openai.AsyncOpenAI(base_url=served.http + "/v1", api_key=served.api_key, max_retries=0, timeout=120)


def complete(client, prompt: str, **extra):
    return client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"return_token_ids": True, **extra},
    )


def test_greedy_completions_equal_hf_and_the_offline_llm_in_every_mode(served, aclient, tiny_pair, reference):
    modes = [None, "ssd", "sd", "ar", "off"]  # off: ar's deprecated spelling, still accepted

    async def all_at_once():
        calls = [
            aclient.completions.create(
                model="tiny",
                prompt=p,
                max_tokens=MAX_TOKENS,
                temperature=0,
                extra_body={"return_token_ids": True, **({"speculation": {"mode": m}} if m else {})},
            )
            for m in modes
            for p in PROMPTS
        ]
        return await asyncio.gather(*calls)

    results = asyncio.run(all_at_once())
    with LLM(*tiny_pair, mode="sd", k=4) as llm:
        offline = [o.text for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))]
    for i, resp in enumerate(results):
        mode, p = modes[i // len(PROMPTS)], i % len(PROMPTS)
        choice = resp.choices[0]
        assert choice.model_extra["token_ids"] == reference[p], (mode, p)
        assert choice.text == offline[p], (mode, p)
        assert resp.usage.completion_tokens == len(reference[p])
        assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
        served_by = resp.model_extra["speculation"][0]["mode"]
        assert served_by == {None: "ssd", "ssd": "ssd", "sd": "sd", "ar": "ar", "off": "ar"}[mode]
    ssd_stats = results[0].model_extra["speculation"][0]
    assert ssd_stats["rounds"] > 0 and "cache_hit_rate" in ssd_stats and ssd_stats["tokens_per_round"] > 1


def test_a_per_request_k_caps_the_speculation_and_keeps_the_output(client, reference):
    resp = complete(client, PROMPTS[0], speculation={"mode": "ssd", "k": 1})
    stats = resp.model_extra["speculation"][0]
    assert resp.choices[0].model_extra["token_ids"] == reference[0]
    assert stats["draft_tokens"] <= stats["rounds"]  # at most one draft token per round
    off = complete(client, PROMPTS[0], speculation={"k": 0})
    assert (
        off.choices[0].model_extra["token_ids"] == reference[0]
        and off.model_extra["speculation"][0]["draft_tokens"] == 0
    )


def test_streaming_completion_matches_and_ends_with_done(served, client, reference):
    whole = complete(client, PROMPTS[1]).choices[0].text
    stream = client.completions.create(
        model="tiny",
        prompt=PROMPTS[1],
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == len(reference[1]) and chunks[-1].choices == []
    raw = requests.post(
        served.http + "/v1/completions",
        headers={"Authorization": f"Bearer {served.api_key}"},
        timeout=60,
        json={"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0, "stream": True},
    )
    assert raw.headers["content-type"].startswith("text/event-stream")
    events = [line for line in raw.text.split("\n\n") if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)


def test_chat_uses_the_default_template_stream_or_not(client):
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "def add(a, b):"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    rendered = "system: Be terse.\nuser: def add(a, b):\nassistant:"
    plain = client.completions.create(model="tiny", prompt=rendered, max_tokens=12, temperature=0)
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == plain.choices[0].text
    assert chat.usage.prompt_tokens == plain.usage.prompt_tokens
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat.choices[0].message.content


def test_n_choices_and_seeded_sampling(client):
    # sd: a seeded request reproduces exactly (ssd does only with engine.ssd_reproducible, whose
    # trees do not depend on timing; the distribution is exact either way).
    sd = {"speculation": {"mode": "sd"}}
    resp = client.completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=16, temperature=1.0, n=3, seed=7, extra_body=sd
    )
    again = client.completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=16, temperature=1.0, n=3, seed=7, extra_body=sd
    )
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert [c.text for c in resp.choices] == [c.text for c in again.choices]  # seeded: reproducible
    assert len({c.text for c in resp.choices}) > 1  # each choice its own seed
    one = client.completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=16, temperature=1.0, seed=7, extra_body=sd
    )
    assert one.choices[0].text == resp.choices[0].text  # choice 0 keeps the request's seed
    assert resp.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counts once, whatever n
    assert resp.usage.completion_tokens == 3 * 16


def test_models_health_and_the_api_key(served, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("org/other-model")
    assert requests.get(served.http + "/health").status_code == 200  # no key needed
    body = {"model": "tiny", "prompt": "x", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": served.api_key}):
        r = requests.post(served.http + "/v1/completions", json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert served.api_key not in r.text
    assert requests.get(served.http + "/v1/models").status_code == 401
    assert requests.get(served.http + "/v1/models/tiny").status_code == 401
    wrong = openai.OpenAI(base_url=served.http + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model="tiny", prompt="x", max_tokens=2)


def test_tokenize_and_detokenize(served, client):
    """vLLM's /tokenize and /detokenize: the counts are the ones usage reports."""
    auth = {"Authorization": f"Bearer {served.api_key}"}

    def post(path, body):
        return requests.post(served.http + path, json={"model": "tiny", **body}, headers=auth, timeout=60)

    prompt = "def add(a, b):\n    return"
    tokens = post("/tokenize", {"prompt": prompt}).json()
    usage = client.completions.create(model="tiny", prompt=prompt, max_tokens=1, temperature=0).usage
    assert tokens["count"] == len(tokens["tokens"]) == usage.prompt_tokens
    assert post("/detokenize", {"tokens": tokens["tokens"]}).json() == {"prompt": prompt}
    messages = [{"role": "user", "content": "hi"}]
    chat = post("/tokenize", {"messages": messages}).json()
    chat_usage = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1, temperature=0).usage
    assert chat["count"] == chat_usage.prompt_tokens
    for path, body, status, param in (
        ("/detokenize", {"tokens": [10**6]}, 400, "tokens"),
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"prompt": "x", "frobnicate": 1}, 400, "frobnicate"),
        ("/tokenize", {"prompt": "x", "model": "gpt-5"}, 404, "model"),
    ):
        r = requests.post(served.http + path, json={"model": "tiny", **body}, headers=auth, timeout=60)
        assert r.status_code == status and r.json()["error"]["param"] == param, r.text
    assert requests.post(served.http + "/tokenize", json={"model": "tiny", "prompt": "x"}).status_code == 401
