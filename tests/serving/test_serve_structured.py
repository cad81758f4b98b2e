"""Structured output over HTTP (the official `openai` client's response_format, vLLM's
structured_outputs) and gRPC, in every served mode: the offline engine's tokens for the same
constraint (which tests/test_structured_output.py holds to Hugging Face `generate`), text that
validates, and 400s naming the field for what does not compile."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
grpc = pytest.importorskip("grpc")
jsonschema = pytest.importorskip("jsonschema")
requests = pytest.importorskip("requests")

from serve_app._proto import ssd_serve_pb2 as pb  # noqa: E402
from serve_app._proto import ssd_serve_pb2_grpc as pb_grpc  # noqa: E402
from ssd import LLM, SamplingParams  # noqa: E402
from ssd.processing.structured import StructuredOutputs  # noqa: E402

PROMPT = "def add(a, b):\n    return"
SCHEMA = {
    "type": "object",
    "properties": {"id": {"enum": [1, 2, 3]}, "name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"}},
    "required": ["id", "name", "ok"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "row", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def offline(tiny_pair) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=48, structured_outputs=StructuredOutputs(json=SCHEMA))
    with LLM(*tiny_pair, mode="sd", k=4) as llm:
        return llm.generate(PROMPT, params)[0].token_ids


def client(served):
    return openai.OpenAI(base_url=served.http + "/v1", api_key=served.api_key, max_retries=0, timeout=120)


@pytest.mark.parametrize("mode", ["ssd", "sd", "ar"])
def test_response_format_gives_the_offline_tokens_and_valid_json(served, offline, mode):
    resp = client(served).completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=48,
        temperature=0,
        extra_body={"return_token_ids": True, "speculation": {"mode": mode}, "response_format": RESPONSE_FORMAT},
    )
    assert resp.choices[0].token_ids == offline
    jsonschema.validate(json.loads(resp.choices[0].text), SCHEMA)


def test_chat_response_format_streamed_and_not(served):
    messages = [{"role": "user", "content": "a row, please"}]
    chat = client(served).chat.completions
    whole = chat.create(model="tiny", messages=messages, max_tokens=48, temperature=0, response_format=RESPONSE_FORMAT)
    jsonschema.validate(json.loads(whole.choices[0].message.content), SCHEMA)
    stream = chat.create(
        model="tiny", messages=messages, max_tokens=48, temperature=0, response_format=RESPONSE_FORMAT, stream=True
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == whole.choices[0].message.content
    sampled = chat.create(
        model="tiny", messages=messages, max_tokens=48, temperature=1.0, seed=3, response_format=RESPONSE_FORMAT
    )
    jsonschema.validate(json.loads(sampled.choices[0].message.content), SCHEMA)
    # Any object: the random test model's strings may outrun max_tokens, so only its start is checked.
    anything = chat.create(model="tiny", messages=messages, max_tokens=8, response_format={"type": "json_object"})
    assert anything.choices[0].message.content.startswith("{")


def test_structured_outputs_choice_and_regex(served):
    completions = client(served).completions
    for constraint, check in (
        ({"choice": ["yes", "no", "maybe"]}, lambda t: t in ("yes", "no", "maybe")),
        ({"regex": "[0-9]{2}-[a-f]{3}"}, lambda t: len(t) == 6 and t[2] == "-"),
    ):
        resp = completions.create(
            model="tiny", prompt=PROMPT, max_tokens=16, temperature=1.0, extra_body={"structured_outputs": constraint}
        )
        assert check(resp.choices[0].text), resp.choices[0].text


def test_grpc_structured_outputs(served, offline):
    with grpc.insecure_channel(served.grpc) as channel:
        stub = pb_grpc.GenerationStub(channel)
        meta = [("application", "main"), ("authorization", f"Bearer {served.api_key}")]
        request = pb.GenerateRequest(
            model="tiny",
            prompt=PROMPT,
            max_tokens=48,
            temperature=0.0,
            structured_outputs=pb.StructuredOutputs(json_schema=json.dumps(SCHEMA)),
        )
        assert list(stub.Generate(request, metadata=meta).choices[0].token_ids) == offline
        bad = pb.GenerateRequest(
            model="tiny", prompt=PROMPT, structured_outputs=pb.StructuredOutputs(regex="(unclosed")
        )
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(bad, metadata=meta)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "structured_outputs" in err.value.details()


def test_constraints_that_cannot_be_followed_get_400_naming_the_field(served):
    auth = {"Authorization": f"Bearer {served.api_key}"}
    deep: dict = {"type": "string"}
    for _ in range(40):
        deep = {"type": "array", "items": deep}
    cases = (
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": deep}}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
        ({"structured_outputs": {"json": {"type": "no-such-type"}}}, "structured_outputs"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, None),
    )
    for extra, param in cases:
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, **extra}
        r = requests.post(served.http + "/v1/completions", json=body, headers=auth, timeout=60)
        assert r.status_code == 400, r.text
        if param is not None:
            assert r.json()["error"]["param"].startswith(param), r.text
    # A body nested past the JSON parser's depth is the client's mistake too, not a 500.
    nested = b'{"model": "tiny", "prompt": ' + b"[" * 20_000 + b"]" * 20_000 + b"}"
    r = requests.post(served.http + "/v1/completions", data=nested, headers=auth, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    # The replica goes on serving.
    ok = client(served).completions.create(model="tiny", prompt=PROMPT, max_tokens=2, temperature=0)
    assert ok.choices[0].text is not None
