"""The gRPC API (protos/ssd_serve.proto) through Ray Serve's gRPC proxy, with a client built from
the generated stubs: greedy output equals Hugging Face `generate`, streaming equals unary, the
standard health service and server reflection answer, status codes map like HTTP, and the
message size is bounded."""

from __future__ import annotations

import pytest

grpc = pytest.importorskip("grpc")

from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc  # noqa: E402
from refimpl import hf_greedy  # noqa: E402

from serve_app._proto import ssd_serve_pb2 as pb  # noqa: E402
from serve_app._proto import ssd_serve_pb2_grpc as pb_grpc

PROMPT = "def add(a, b):\n    return"
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def channel(served):
    with grpc.insecure_channel(served.grpc) as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(channel):
    return pb_grpc.GenerationStub(channel)


def meta(served, key: str | None = "own", app: str = "main"):
    out = [("application", app)]
    if key is not None:
        out.append(("authorization", f"Bearer {served.api_key if key == 'own' else key}"))
    return out


def request(**kw) -> pb.GenerateRequest:
    fields = {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0, **kw}
    return pb.GenerateRequest(**fields)


def test_unary_and_stream_greedy_equal_hf(served, stub, tiny_pair):
    expected = hf_greedy(tiny_pair[0], [PROMPT], MAX_TOKENS)[0]
    reply = stub.Generate(request(), metadata=meta(served))
    choice = reply.choices[0]
    assert list(choice.token_ids) == expected and choice.finish_reason == "length"
    assert (
        reply.usage.completion_tokens == MAX_TOKENS
        and reply.usage.total_tokens == reply.usage.prompt_tokens + MAX_TOKENS
    )
    assert choice.speculation.mode == "ssd" and choice.speculation.rounds > 0
    parts = list(stub.GenerateStream(request(), metadata=meta(served)))
    assert [t for p in parts for t in p.choices[0].token_ids] == expected
    assert "".join(p.choices[0].text for p in parts) == choice.text
    assert parts[-1].usage.completion_tokens == MAX_TOKENS and parts[-1].choices[0].speculation.rounds > 0
    by_ids = stub.Generate(  # mode off: ar's deprecated spelling, still accepted (and reported as ar)
        request(
            prompt="", prompt_token_ids=list(reply.choices[0].token_ids[:3]), speculation=pb.Speculation(mode="off")
        ),
        metadata=meta(served),
    )
    assert by_ids.choices[0].speculation.mode == "ar" and len(by_ids.choices[0].token_ids) == MAX_TOKENS


def test_models_health_and_reflection(served, stub, channel):
    assert list(stub.ListModels(pb.ListModelsRequest(), metadata=meta(served)).models) == ["tiny"]
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), metadata=meta(served, key=None))
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    answers = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    services = {s.name for a in answers for s in a.list_services_response.service}
    assert {"ssd.serve.v1.Generation", "grpc.health.v1.Health"} <= services


@pytest.mark.parametrize(
    "req,key,code,word",
    [
        (request(temperature=-1.0), "own", grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
        (request(max_tokens=10**6), "own", grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
        (
            request(speculation=pb.Speculation(mode="turbo")),
            "own",
            grpc.StatusCode.INVALID_ARGUMENT,
            "speculation.mode",
        ),
        (request(prompt=""), "own", grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
        (request(model="gpt-5"), "own", grpc.StatusCode.NOT_FOUND, "model"),
        (request(), None, grpc.StatusCode.UNAUTHENTICATED, "API key"),
        (request(), "wrong", grpc.StatusCode.UNAUTHENTICATED, "API key"),
    ],
)
def test_errors_map_to_status_codes(served, stub, req, key, code, word):
    for call in (
        lambda: stub.Generate(req, metadata=meta(served, key)),
        lambda: list(stub.GenerateStream(req, metadata=meta(served, key))),
    ):
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == code and word in info.value.details()


def test_the_message_size_is_bounded(served, stub):
    with pytest.raises(grpc.RpcError) as info:
        stub.Generate(request(prompt="x" * (5 << 20)), metadata=meta(served))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert stub.Generate(request(max_tokens=2), metadata=meta(served)).usage.completion_tokens == 2


def test_logprobs_unary_and_streamed(served, stub, tiny_pair):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reply = stub.Generate(request(logprobs=2, prompt_logprobs=1), metadata=meta(served))
    choice = reply.choices[0]
    ids = list(choice.token_ids)
    assert [e.chosen.token_id for e in choice.logprobs] == ids and all(len(e.top) == 2 for e in choice.logprobs)
    prompt = AutoTokenizer.from_pretrained(tiny_pair[0], local_files_only=True).encode(PROMPT, add_special_tokens=False)
    assert [e.chosen.token_id for e in choice.prompt_logprobs] == prompt[1:]
    model = AutoModelForCausalLM.from_pretrained(tiny_pair[0], local_files_only=True, dtype=torch.float32).eval()
    with torch.no_grad():
        rows = torch.log_softmax(model(input_ids=torch.tensor([prompt + ids])).logits[0, :-1].double(), -1)
    want = [float(rows[i, t]) for i, t in enumerate(prompt[1:] + ids)]
    got = [e.chosen.logprob for e in list(choice.prompt_logprobs) + list(choice.logprobs)]
    assert got == pytest.approx(want, abs=2e-4)
    parts = list(stub.GenerateStream(request(logprobs=2, prompt_logprobs=1), metadata=meta(served)))
    # The same entries, to float rounding: the served mode is auto, so the two requests' rounds may
    # run in different modes, whose forwards (1 or K + 1 positions) round differently in the last bits.
    assert_same_entries([e for p in parts for e in p.choices[0].logprobs], list(choice.logprobs))
    assert_same_entries(list(parts[0].choices[0].prompt_logprobs), list(choice.prompt_logprobs))
    assert not any(p.choices[0].prompt_logprobs for p in parts[1:])


def assert_same_entries(got: list, want: list) -> None:
    """TokenLogprobs messages: equal token ids, ranks and texts; log-probabilities within 1e-5."""

    def flat(entries):
        return [(e.rank, [(x.token_id, x.token) for x in (e.chosen, *e.top)]) for e in entries]

    def values(entries):
        return [x.logprob for e in entries for x in (e.chosen, *e.top)]

    assert flat(got) == flat(want)
    assert values(got) == pytest.approx(values(want), abs=1e-5)
