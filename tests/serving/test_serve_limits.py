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


TOO_LARGE = {
    "message": "the body is larger than 65536 bytes",
    "type": "invalid_request_error",
    "param": None,
    "code": "body_too_large",
}


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_40_mb_body_gets_413_from_a_client_that_closes_the_connection(served, chunked):
    """Reported: a 40 MB body got a TCP reset where 2 MB got 413. urllib asks for `Connection:
    close`: the 413 came before the body was read, the HTTP proxy then closed the connection with
    the body unread, and the kernel's reset discarded the 413 while the client was still sending.
    Now the body is read (and dropped) first: 413 with the envelope, with a Content-Length (urllib)
    and chunked (http.client, in paced parts, so that the answer would come mid-body)."""
    import http.client
    import urllib.error
    import urllib.parse
    import urllib.request

    headers = {"Authorization": f"Bearer {served.api_key}", "Content-Type": "application/json"}
    if not chunked:
        request = urllib.request.Request(served.http + "/v1/completions", data=b"{" * (40 << 20), headers=headers)
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(request, timeout=120)
        assert err.value.code == 413 and json.loads(err.value.read()) == {"error": TOO_LARGE}
        return

    def parts():
        for _ in range(40):
            yield b"{" * (1 << 20)
            time.sleep(0.01)

    url = urllib.parse.urlsplit(served.http)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
    try:  # an iterable body and no Content-Length: http.client sends it chunked
        connection.request("POST", "/v1/completions", body=parts(), headers={**headers, "Connection": "close"})
        response = connection.getresponse()
        assert response.status == 413 and json.loads(response.read()) == {"error": TOO_LARGE}
    finally:
        connection.close()


@pytest.mark.parametrize(
    "path, key, status, code",
    [("/v1/completions", "wrong", 401, "invalid_api_key"), ("/v1/nowhere", None, 404, "not_found")],
    ids=["wrong key", "no such route"],
)
def test_a_40_mb_body_refused_unread_gets_its_refusal_not_a_reset(served, path, key, status, code):
    """A refusal that comes before the body is read (a wrong API key, a route that does not exist)
    from a client that closes the connection (urllib): the rest of the body is read and dropped
    first, as for a 413, so the client gets the status and its envelope, not a TCP reset."""
    import urllib.error
    import urllib.request

    headers = {"Authorization": f"Bearer {key or served.api_key}", "Content-Type": "application/json"}
    request = urllib.request.Request(served.http + path, data=b"{" * (40 << 20), headers=headers)
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=120)
    assert err.value.code == status and json.loads(err.value.read())["error"]["code"] == code


def test_an_oversized_body_is_read_to_its_end_before_its_413(monkeypatch):
    """serve_app.http_body.read_body, without a server: over the limit (declared or as read), the
    rest is read and dropped up to DRAIN_MAX_BYTES, then 413; a client leaving meanwhile changes
    nothing; a body declared past DRAIN_MAX_BYTES gets its 413 at once."""
    from serve_app import http_body
    from serve_app.errors import APIError

    monkeypatch.setattr(http_body, "DRAIN_MAX_BYTES", 8 << 20)
    read = []

    async def parts(n: int, leave_at: int | None = None):
        for i in range(n):
            if i == leave_at:
                raise ConnectionError("the client left")  # as starlette's ClientDisconnect, an Exception
            read.append(i)
            yield b"{" * (1 << 20)

    def outcome(body, length: str | None):
        read.clear()
        try:
            return asyncio.run(http_body.read_body(body, length, 65536))
        except APIError as err:
            return err.status, err.code, len(read)

    assert outcome(parts(4), str(4 << 20)) == (413, "body_too_large", 4)  # all of it read
    assert outcome(parts(4), None) == (413, "body_too_large", 4)  # chunked
    assert outcome(parts(20), None) == (413, "body_too_large", 9)  # stops once past the drain cap
    assert outcome(parts(20), str(20 << 20)) == (413, "body_too_large", 0)  # declared past it: at once
    assert outcome(parts(4, leave_at=2), str(4 << 20)) == (413, "body_too_large", 2)
    with pytest.raises(ConnectionError):  # leaving within the limit is not a 413
        outcome(parts(4, leave_at=0), str(1000))

    async def small():
        yield b'{"a": '
        yield b"1}"

    assert outcome(small(), None) == b'{"a": 1}'


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
    assert deployed_by("owner-test") is None  # once removed, gone (ray.kill alone returns before)
    reset_board("owner-test", "third")  # a new deploy right after gets a board of its own
    assert deployed_by("owner-test") == "third"
    remove_board("owner-test")
    assert deployed_by("owner-test") is None
