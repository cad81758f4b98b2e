"""The gRPC API (protos/ssd_serve.proto) as a plain class: convert a request to the same
GenerateRequests the HTTP path makes, and the chunks back to replies; errors become status
codes through APIError.

Serve's gRPC proxy deserializes requests and calls the ingress deployment's method of the same
name with a RayServegRPCContext; these methods take that context (set_code, set_details,
invocation_metadata), so they also run under a plain grpc.aio server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

from pydantic import ValidationError

from serve_app.auth import GRPC_HINT, authorize
from serve_app.config import REQUEST_MODES, ServeSettings
from serve_app.errors import APIError, from_validation
from serve_app.fan_out import Generate, check_model_and_n, fan_out, interleave
from serve_app.types import GenerateChunk, GenerateRequest
from ssd.core.sampling_params import SamplingParams
from ssd.processing.structured import StructuredOutputs

logger = logging.getLogger(__name__)

# Import paths of the servicer functions Serve's gRPC proxy registers (gRPCOptions).
SERVICER_FUNCTIONS = [
    "serve_app._proto.ssd_serve_pb2_grpc.add_GenerationServicer_to_server",
    "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server",
]


def _pb():
    try:
        from serve_app._proto import ssd_serve_pb2
    except ImportError as err:
        raise ImportError(
            "the gRPC stubs of protos/ssd_serve.proto are missing: run `make protos` (make install does)"
        ) from err
    return ssd_serve_pb2


class GrpcFrontend:
    def __init__(
        self,
        settings: ServeSettings,
        generate: Generate,
        api_key: str | None,
        health: Callable[[], Awaitable[bool]],
    ) -> None:
        """api_key: the key every method but Health/Check requires (None: none)."""
        self.settings, self.model_name, self._generate = settings, settings.model_name, generate
        self.api_key, self.health = api_key, health
        self.pb = _pb()

    # ---- conversion ----------------------------------------------------------------------------

    def _authorize(self, context, hint: str | None = GRPC_HINT) -> None:
        """401 (UNAUTHENTICATED) unless the call's metadata `authorization` carries the key."""
        authorize(dict(context.invocation_metadata()).get("authorization"), self.api_key, hint)

    def _check(self, request, context) -> list[GenerateRequest]:
        self._authorize(context)
        if request.prompt and request.prompt_token_ids:
            raise APIError(400, "prompt: give prompt or prompt_token_ids, not both", "prompt", "invalid_value")
        prompt = request.prompt or list(request.prompt_token_ids)
        if not prompt:
            raise APIError(400, "prompt: give prompt or prompt_token_ids", "prompt", "invalid_value")
        n = request.n or 1
        check_model_and_n(request.model, self.model_name, n, self.settings.max_n)
        fields = {
            "max_tokens": request.max_tokens if request.HasField("max_tokens") else self.settings.default_max_tokens,
            "temperature": request.temperature if request.HasField("temperature") else 1.0,
            "top_p": request.top_p if request.HasField("top_p") else 1.0,
            "top_k": request.top_k if request.HasField("top_k") else 0,
            "stop": list(request.stop),
            "stop_token_ids": list(request.stop_token_ids),
            "seed": request.seed if request.HasField("seed") else None,
            "ignore_eos": request.ignore_eos,
            "logprobs": request.logprobs if request.HasField("logprobs") else None,
            "prompt_logprobs": request.prompt_logprobs if request.HasField("prompt_logprobs") else None,
            "presence_penalty": request.presence_penalty,
            "frequency_penalty": request.frequency_penalty,
            "repetition_penalty": request.repetition_penalty if request.HasField("repetition_penalty") else 1.0,
            "logit_bias": dict(request.logit_bias),
            "min_p": request.min_p,
            "min_tokens": request.min_tokens,
            "allowed_token_ids": list(request.allowed_token_ids) or None,
            "include_stop_str_in_output": request.include_stop_str_in_output,
            "bad_words": list(request.bad_words) or None,
        }
        try:
            fields["structured_outputs"] = structured(request)
            params = SamplingParams(**fields)
        except ValidationError as err:
            raise from_validation(err) from None
        spec = request.speculation
        mode = spec.mode or None
        if mode is not None and mode not in REQUEST_MODES:
            raise APIError(
                400, "speculation.mode must be auto, ssd, sd or ar ('off' = ar)", "speculation.mode", "invalid_value"
            )
        mode = None if mode is None else REQUEST_MODES[mode]  # a deprecated spelling as the mode's name
        k = spec.k if spec.HasField("k") else None
        if k is not None and k > 32:
            raise APIError(400, "speculation.k must be at most 32", "speculation.k", "invalid_value")
        return fan_out([prompt], n, params, mode, k)

    def _stats(self, chunk: GenerateChunk):
        s = chunk.speculation
        return self.pb.SpeculationStats(
            mode=chunk.mode,
            rounds=s.get("rounds", 0),
            mean_accepted_per_round=s.get("mean_accepted_per_round", 0.0),
            acceptance_rate=s.get("acceptance_rate", 0.0),
            tokens_per_round=s.get("tokens_per_round", 0.0),
            cache_hits=s.get("cache_hits", 0),
            cache_hit_rate=s.get("cache_hit_rate", 0.0),
            rounds_by_mode=s.get("rounds_by_mode", {}),
        )

    def _logprobs(self, entries) -> list:
        """TokenLogprobs messages of these entries (None entries, the prompt's first token, left out)."""

        def one(lp):
            return self.pb.Logprob(token_id=lp.token_id, token=lp.text, logprob=lp.logprob)

        return [
            self.pb.TokenLogprobs(chosen=one(e.chosen), rank=e.rank, top=[one(t) for t in e.top])
            for e in entries or []
            if e is not None
        ]

    @staticmethod
    def _fail(context, err: APIError) -> None:
        context.set_code(err.grpc_code)
        context.set_details(err.message)

    # ---- methods --------------------------------------------------------------------------------

    async def generate(self, request, context):
        try:
            gens = self._check(request, context)
            tasks = [asyncio.create_task(self._drain(g)) for g in gens]
            try:
                results = await asyncio.gather(*tasks)
            finally:  # one choice failed or the call was cancelled: stop the others
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        except APIError as err:
            self._fail(context, err)
            return self.pb.GenerateResponse()
        except Exception:  # noqa: BLE001 - logged here; the client gets a bounded message, no traceback
            logger.exception("gRPC Generate failed")
            self._fail(context, APIError(500, "generation failed; retry the request", None, "internal"))
            return self.pb.GenerateResponse()
        choices, prompt_tokens, completion_tokens = [], 0, 0
        for index, chunks in enumerate(results):
            last = chunks[-1]
            prompt_tokens = last.prompt_tokens
            completion_tokens += last.completion_tokens
            choices.append(
                self.pb.Choice(
                    index=index,
                    text="".join(c.delta_text for c in chunks),
                    token_ids=[t for c in chunks for t in c.delta_token_ids],
                    finish_reason=last.finish_reason or "",
                    speculation=self._stats(last),
                    logprobs=self._logprobs([e for c in chunks for e in c.delta_logprobs or []]),
                    prompt_logprobs=self._logprobs(chunks[0].prompt_logprobs),
                )
            )
        usage = self.pb.Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )
        return self.pb.GenerateResponse(
            id=f"gen-{uuid.uuid4().hex}", model=self.model_name, choices=choices, usage=usage
        )

    async def _drain(self, gen: GenerateRequest) -> list[GenerateChunk]:
        return [chunk async for chunk in self._generate(gen)]

    async def generate_stream(self, request, context) -> AsyncIterator:
        try:
            gens = self._check(request, context)
        except APIError as err:
            # A stream that yields nothing ends with OK under Serve's proxy; raising after
            # set_code makes it end with the code and details set here.
            self._fail(context, err)
            raise
        rid = f"gen-{uuid.uuid4().hex}"
        streams = [self._generate(g) for g in gens]
        try:
            async with contextlib.aclosing(interleave(streams)) as merged:
                async for index, item in merged:
                    choice = self.pb.Choice(
                        index=index,
                        text=item.delta_text,
                        token_ids=item.delta_token_ids,
                        finish_reason=item.finish_reason or "",
                        logprobs=self._logprobs(item.delta_logprobs),
                        prompt_logprobs=self._logprobs(item.prompt_logprobs),
                    )
                    usage = None
                    if item.finish_reason:  # set before the reply copies the choice in
                        choice.speculation.CopyFrom(self._stats(item))
                        usage = self.pb.Usage(
                            prompt_tokens=item.prompt_tokens,
                            completion_tokens=item.completion_tokens,
                            total_tokens=item.prompt_tokens + item.completion_tokens,
                        )
                    yield self.pb.GenerateResponse(id=rid, model=self.model_name, choices=[choice], usage=usage)
        except APIError as err:  # see above: raised, so the call ends with this code
            self._fail(context, err)
            raise

    async def list_models(self, request, context):
        try:
            self._authorize(context, hint=None)
        except APIError as err:
            self._fail(context, err)
            return self.pb.ListModelsResponse()
        return self.pb.ListModelsResponse(models=[self.model_name])

    async def health_check(self, request, context):
        """grpc.health.v1.Health/Check (no auth, like GET /health)."""
        from grpc_health.v1 import health_pb2

        status = (
            health_pb2.HealthCheckResponse.SERVING
            if await self.health()
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        return health_pb2.HealthCheckResponse(status=status)


def structured(request) -> StructuredOutputs | None:
    """A GenerateRequest's structured_outputs message -> StructuredOutputs (or None when unset)."""
    if not request.HasField("structured_outputs"):
        return None
    message = request.structured_outputs
    kind = message.WhichOneof("constraint")
    if kind is None:
        raise APIError(400, "structured_outputs: set one constraint", "structured_outputs", "invalid_value")
    if kind == "json_schema":
        try:
            schema = json.loads(message.json_schema)
        except (ValueError, RecursionError) as err:  # RecursionError: nested past the parser's depth
            raise APIError(
                400, f"structured_outputs.json_schema is not JSON: {err}", "structured_outputs", "invalid_value"
            ) from None
        if not isinstance(schema, dict):
            raise APIError(
                400, "structured_outputs.json_schema must be a JSON object", "structured_outputs", "invalid_value"
            )
        return StructuredOutputs(json=schema)
    if kind == "choice":
        return StructuredOutputs(choice=list(message.choice.options))
    return StructuredOutputs(**{kind: getattr(message, kind)})
