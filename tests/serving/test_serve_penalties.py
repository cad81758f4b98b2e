"""Penalties, logit bias, min_p, min_tokens, allowed token ids and bad words over HTTP (the official `openai`
client) and gRPC, in every served mode: the same tokens as the offline engine with the same
SamplingParams (which tests/test_penalties.py holds to Hugging Face `generate`)."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")
grpc = pytest.importorskip("grpc")

from serve_app._proto import ssd_serve_pb2 as pb  # noqa: E402
from serve_app._proto import ssd_serve_pb2_grpc as pb_grpc  # noqa: E402
from ssd import LLM, SamplingParams  # noqa: E402

PROMPT = "def add(a, b):\n    return"
FIELDS = dict(frequency_penalty=0.8, presence_penalty=0.3, logit_bias={32: -4.0})
EXTRA = dict(repetition_penalty=1.2, min_tokens=12, allowed_token_ids=list(range(10, 127)), bad_words=["P", "xg"])


@pytest.fixture(scope="module")
def offline(tiny_pair) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=16, **FIELDS, **EXTRA)
    with LLM(*tiny_pair, mode="sd", k=4) as llm:
        return llm.generate(PROMPT, params)[0].token_ids


@pytest.mark.parametrize("mode", ["ssd", "sd", "ar"])
def test_http_fields_give_the_offline_tokens(served, offline, mode):
    client = openai.OpenAI(base_url=served.http + "/v1", api_key=served.api_key, max_retries=0, timeout=120)
    resp = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=16,
        temperature=0,
        frequency_penalty=FIELDS["frequency_penalty"],
        presence_penalty=FIELDS["presence_penalty"],
        logit_bias={str(t): b for t, b in FIELDS["logit_bias"].items()},
        extra_body={"return_token_ids": True, "speculation": {"mode": mode}, **EXTRA},
    )
    assert resp.choices[0].token_ids == offline


def test_grpc_fields_give_the_offline_tokens(served, offline):
    with grpc.insecure_channel(served.grpc) as channel:
        stub = pb_grpc.GenerationStub(channel)
        request = pb.GenerateRequest(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0.0, **FIELDS, **EXTRA)
        meta = [("application", "main"), ("authorization", f"Bearer {served.api_key}")]
        reply = stub.Generate(request, metadata=meta)
    assert list(reply.choices[0].token_ids) == offline
