"""What the two front ends (OpenAI HTTP, gRPC) check alike and how they turn one request into one
generation per choice: written once so that both APIs answer the same request the same way."""

from __future__ import annotations

import uuid

from serve_app.errors import APIError
from serve_app.types import GenerateRequest
from ssd.core.sampling_params import SamplingParams


def check_model_and_n(model: str, served_model: str, n: int, max_n: int) -> None:
    """The request names the served model and asks for at most `max_n` choices."""
    if model != served_model:
        raise APIError(
            404,
            f"model {model[:100]!r} does not exist; this server serves {served_model!r}",
            "model",
            "model_not_found",
        )
    if n > max_n:
        raise APIError(400, f"n must be at most {max_n}", "n", "invalid_value")


def choice_params(params: SamplingParams, choice: int) -> SamplingParams:
    """The sampling parameters of choice `choice` of a request: the n choices of one prompt must
    differ, so a seeded request gives choice i the seed `seed + i` (choice 0 keeps the seed)."""
    if params.seed is None or choice == 0:
        return params
    return params.model_copy(update={"seed": (params.seed + choice) % 2**64})


def fan_out(
    prompts: list[str | list[int]], n: int, params: SamplingParams, mode: str | None, k: int | None
) -> list[GenerateRequest]:
    """One GenerateRequest per (prompt, choice), prompt-major: index p * n + i."""
    return [
        GenerateRequest(f"{uuid.uuid4().hex}-{p}-{i}", prompt, choice_params(params, i), mode, k)
        for p, prompt in enumerate(prompts)
        for i in range(n)
    ]
