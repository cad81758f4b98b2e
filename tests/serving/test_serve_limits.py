"""What clients can do wrong or too much, on a real Ray Serve deployment (tests/serve_harness.py):

1. a table of bad inputs, each answered with its status, the OpenAI error envelope and the
   parameter named; messages bounded, with no paths or addresses; the server healthy after;
2. backpressure at the exact bound (the "small" app: batch 1 + queue 1 = 2 requests, the third
   gets 429 with Retry-After at once, and a request after they finish succeeds);
3. a client that disconnects mid-stream stops its generation (the row and its draft state are
   freed long before max_tokens);
4. 32 concurrent streams all complete, each with the text it gets alone.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

openai = pytest.importorskip("openai")
requests = pytest.importorskip("requests")

from ray import serve  # noqa: E402

BIG = 10**9
BAD = [  # (body or raw bytes, status, param)
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (b"\xff\xfe", 400, None),
    ({"model": "tiny"}, 400, "prompt"),
    ({"model": "tiny", "prompt": ""}, 400, "prompt"),
    ({"model": "tiny", "prompt": []}, 400, "prompt"),
    ({"model": "tiny", "prompt": [999999]}, 400, "prompt"),
    ({"model": "tiny", "prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"model": "tiny", "prompt": "x", "temperature": "hot"}, 400, "temperature"),
    (b'{"model": "tiny", "prompt": "x", "temperature": NaN}', 400, "temperature"),
    ({"model": "tiny", "prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"model": "tiny", "prompt": "x", "top_k": -5}, 400, "top_k"),
    ({"model": "tiny", "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "x", "max_tokens": BIG}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 1e400}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "x", "n": 99}, 400, "n"),
    ({"model": "tiny", "prompt": "x", "seed": -1}, 400, "seed"),
    ({"model": "tiny", "prompt": "x", "stop": ["s"] * 5000}, 400, "stop"),
    ({"model": "tiny", "prompt": "x", "stop_token_ids": [BIG]}, 400, "stop_token_ids"),
    ({"model": "tiny", "prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ({"model": "tiny", "prompt": "x", "logprobs": -1}, 400, "logprobs"),
    ({"model": "tiny", "prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ({"model": "tiny", "prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ({"model": "tiny", "prompt": "x", "logit_bias": {"999999": 1}}, 400, "logit_bias"),
    ({"model": "tiny", "prompt": "x", "frobnicate": True}, 400, "frobnicate"),
    ({"model": "tiny", "prompt": "x", "speculation": {"mode": "turbo"}}, 400, "speculation.mode"),
    ({"model": "tiny", "prompt": "x", "speculation": {"k": 99}}, 400, "speculation.k"),
    ({"model": "tiny", "prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"model": "gpt-5", "prompt": "x"}, 404, "model"),
    ({"model": "tiny", "prompt": "x" * 70000}, 413, None),
    ({"model": "tiny", "prompt": "\U0001f600\u202e\x00 ünïcödé", "max_tokens": 2}, 200, None),
]


def post(served, body, path="/v1/completions", stream=False, timeout=60):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return requests.post(
        served.http + path,
        data=data,
        stream=stream,
        timeout=timeout,
        headers={"Authorization": f"Bearer {served.api_key}", "Content-Type": "application/json"},
    )


@pytest.mark.parametrize("body,status,param", BAD, ids=[f"{i}-{s}-{p}" for i, (_, s, p) in enumerate(BAD)])
def test_bad_input_gets_its_status_and_names_the_param(served, body, status, param):
    r = post(served, body)
    assert r.status_code == status, r.text
    if status == 200:
        return
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
    assert len(err["message"]) <= 512 and "/work" not in err["message"] and "127.0.0.1" not in err["message"]


def test_bad_chat_input_and_unknown_routes(served):
    for body, param in (
        ({"model": "tiny", "messages": []}, "messages"),
        ({"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
            "top_logprobs",
        ),
    ):
        r = post(served, body, "/v1/chat/completions")
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert requests.get(served.http + "/v1/nothing").status_code == 404
    assert requests.get(served.http + "/v1/completions").status_code == 405
    assert requests.get(served.http + "/health").status_code == 200  # still serving after the barrage


def _target_stats(app: str) -> dict:
    return serve.get_deployment_handle("Target", app_name=app).stats.remote().result()


def test_backpressure_at_the_exact_bound(served):
    body = {
        "model": "tiny-small",
        "prompt": "def f(x):",
        "max_tokens": 400,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    first = post(served, body, "/small/v1/completions", stream=True)
    assert first.status_code == 200
    second: dict = {}
    waiter = threading.Thread(
        target=lambda: second.setdefault("r", post(served, body, "/small/v1/completions", stream=True))
    )
    waiter.start()
    deadline = time.monotonic() + 30
    while _target_stats("small")["requests"] < 2:  # the second waits in the replica's queue
        assert time.monotonic() < deadline
        time.sleep(0.02)
    started = time.monotonic()
    third = post(served, {**body, "stream": False}, "/small/v1/completions")
    assert third.status_code == 429 and time.monotonic() - started < 5
    assert third.headers["Retry-After"] == "2" and third.json()["error"]["code"] == "overloaded"
    assert first.text.endswith("data: [DONE]\n\n")
    waiter.join(60)
    assert second["r"].status_code == 200 and second["r"].text.endswith("data: [DONE]\n\n")
    assert post(served, {**body, "stream": False, "max_tokens": 4}, "/small/v1/completions").status_code == 200


def test_a_disconnected_client_stops_its_generation(served):
    before = _target_stats("main")["ssd_metrics"]["generated_tokens"]
    body = {
        "model": "tiny",
        "prompt": "def g(y):",
        "max_tokens": 480,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    with post(served, body, stream=True) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line).startswith(b"data: ")
    deadline = time.monotonic() + 20
    while True:
        stats = _target_stats("main")
        if stats["requests"] == 0 and stats["ssd"]["running"] == 0:
            break
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)
    assert stats["ssd_metrics"]["generated_tokens"] - before < 480  # stopped early


def test_32_concurrent_streams_all_complete(served):
    client = openai.AsyncOpenAI(base_url=served.http + "/v1", api_key=served.api_key, max_retries=0, timeout=300)
    prompts = [f"def f{i}(x):\n    return" for i in range(32)]

    async def one(prompt: str) -> tuple[str, str]:
        stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True)
        text, finish = "", None
        async for chunk in stream:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return text, finish

    async def run():
        return await asyncio.gather(*(one(p) for p in prompts))

    results = asyncio.run(run())
    assert all(finish in ("stop", "length") for _, finish in results)
    alone = openai.OpenAI(base_url=served.http + "/v1", api_key=served.api_key, max_retries=0)
    for i in (0, 31):
        solo = alone.completions.create(model="tiny", prompt=prompts[i], max_tokens=12, temperature=0)
        assert solo.choices[0].text == results[i][0]


@pytest.mark.parametrize("megabytes", [8, 32])
def test_a_body_far_over_the_limit_still_gets_413_with_the_envelope(served, megabytes):
    """Reported: bodies of 8 MB or more got a TCP reset (the `openai` client then retries)
    instead of the 413 that 2 MB gets. Not reproduced on this deployment, through `requests`
    or the `openai` client, whose whole body is sent before the answer is read: this holds it."""
    r = post(served, b"{" * (megabytes << 20), timeout=120)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large", r.text[:200]
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=served.http + "/v1", api_key=served.api_key, max_retries=0, timeout=120)
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(model="tiny", prompt="x" * (megabytes << 20), max_tokens=1)
    assert err.value.status_code == 413


def test_the_drain_board_names_the_current_deploy(served):
    """`ssd serve` stamps its deploy on the app's drain board (a real detached actor here); a
    later deploy of the same app takes it over, and the one it replaced then stops nothing."""
    from serve_app.drain import deployed_by, remove_board, reset_board

    assert deployed_by("owner-test") is None
    reset_board("owner-test", "first")
    assert deployed_by("owner-test") == "first"
    reset_board("owner-test", "second")
    assert deployed_by("owner-test") == "second"
    remove_board("owner-test")
    assert deployed_by("owner-test") is None
