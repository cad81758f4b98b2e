"""The hand-off between the ingress and a target replica (pickled through a Serve handle)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ssd.core.logprobs import TokenLogprobs
from ssd.core.sampling_params import SamplingParams


@dataclass(frozen=True)
class GenerateRequest:
    """One completion to generate (a request with n > 1 becomes n of these)."""

    request_id: str
    prompt: str | list[int]  # text (tokenized by the target replica) or token ids
    params: SamplingParams
    mode: str | None = None  # speculation mode asked for: "auto", "ssd", "sd", "ar"; None = the server's default
    k: int | None = None  # per-request cap on draft tokens per round; None = the engine's K


@dataclass(frozen=True)
class GenerateChunk:
    """What one round added to one request; the last chunk has finish_reason set and the
    request's speculation statistics."""

    request_id: str
    delta_text: str
    delta_token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int  # so far
    mode: str  # the engine mode that served it: "ssd", "sd", "ar"
    speculation: dict = field(default_factory=dict)  # SpecMetrics.as_dict() of the request (last chunk)
    # With SamplingParams.logprobs: those of delta_token_ids. With prompt_logprobs: the prompt's,
    # on the request's first chunk only (one per prompt token, None for the first).
    delta_logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
