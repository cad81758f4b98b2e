"""What the two front ends (OpenAI HTTP, gRPC) check alike, how they turn one request into one
generation per choice and how they read the choices' chunks back as one stream: written once so
that both APIs answer the same request the same way.

`Generate` is any function GenerateRequest -> async iterator of GenerateChunk: a Serve handle
to the target deployment in production, an EngineLoop in-process in tests.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable

from serve_app.errors import APIError
from serve_app.types import GenerateChunk, GenerateRequest
from ssd.core.sampling_params import SamplingParams

Generate = Callable[[GenerateRequest], AsyncIterator[GenerateChunk]]


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


async def interleave(
    streams: list[AsyncIterator[GenerateChunk]], firsts: list | None = None
) -> AsyncIterator[tuple[int, GenerateChunk]]:
    """The chunks of several generations (the choices of one request) as they arrive, each with
    its stream's index; firsts[i], when given and not None, is stream i's chunk already read. A
    stream that fails ends the whole with its APIError (500 for anything else); closing this
    stops every stream, which cancels their generations."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int) -> None:
        try:
            if firsts is not None and firsts[index] is not None:
                await queue.put((index, firsts[index]))
            async for chunk in streams[index]:
                await queue.put((index, chunk))
            await queue.put((index, None))
        except Exception as err:  # noqa: BLE001 - handed to the consumer, which reports it
            await queue.put((index, err))

    tasks = [asyncio.create_task(pump(i)) for i in range(len(streams))]
    try:
        running = len(streams)
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise (
                    item
                    if isinstance(item, APIError)
                    else APIError(500, "generation failed; retry the request", None, "engine_failed")
                )
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)
