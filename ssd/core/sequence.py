"""One request's state inside the engine, and what the engine hands back for it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from ssd.core.detokenizer import IncrementalDetokenizer
from ssd.core.logprobs import TokenLogprobs
from ssd.core.sampling import SequenceSampling
from ssd.core.sampling_params import SamplingParams
from ssd.core.speculation import SpecMetrics
from ssd.processing.request import Processing
from ssd.processing.tracked import TrackedHistory


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context length


@dataclass
class Sequence:
    seq_id: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    output_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_text: str | None = None  # the stop string that ended it, if any
    truncated_text: str | None = None  # output text cut before that stop string
    metrics: SpecMetrics = field(default_factory=SpecMetrics)
    # Most draft tokens this request's rounds verify: its own K, a cap on the engine's (0 decodes
    # it without speculation); None = the engine's K. Truncating a speculation keeps
    # verification exact: fewer proposals, same rules.
    k: int | None = None
    # Streaming bookkeeping: how much of the output was already handed out.
    sent_tokens: int = 0
    sent_text: int = 0
    # With params.logprobs: one entry per output token (same length as output_ids). With
    # params.prompt_logprobs: one per prompt token, None for the first (nothing predicts it).
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # With params.structured_outputs: the grammar's matcher, at the end of output_ids (ssd/processing/grammar.py).
    matcher: object | None = field(default=None, repr=False)
    # The request's penalties, bias, allowed tokens, stop ids and bad words' token ids, resolved
    # once at admission (ssd/processing/request.py): what verification and every drafter read.
    processing: Processing = field(default_factory=Processing)
    # Its prompt and output as the processing's tracked tokens, brought up to date each round.
    tracked: TrackedHistory = field(default_factory=TrackedHistory, repr=False, compare=False)
    # With params.structured_outputs: its grammar as llguidance's text and the EOS it ends with,
    # what a drafter needs to mask its own speculations (SequenceSampling.grammar).
    grammar: str = ""
    grammar_eos: int = -1
    # The output text, decoded as tokens arrive (made by the engine's StopChecker on first use).
    detokenizer: IncrementalDetokenizer | None = field(default=None, repr=False)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def adjusted(self) -> bool:
        """Whether its logits have adjustments, not only shaping (ssd/processing/)."""
        return self.processing.any or self.matcher is not None

    @property
    def bad_words(self) -> tuple[tuple[int, ...], ...]:
        """Each of params.bad_words' token ids (ssd/processing/bad_words.py; tokenized once, at admission)."""
        return self.processing.bad_words

    @property
    def sampling(self) -> SequenceSampling:
        p = self.params
        return SequenceSampling(
            p.temperature, p.top_k, p.top_p, self.grammar, len(self.prompt_ids), self.grammar_eos, self.processing
        )

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    def token(self, index: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[index] if index < n else self.output_ids[index - n]

    def tokens_from(self, start: int) -> list[int]:
        n = len(self.prompt_ids)
        if start >= n:
            return self.output_ids[start - n :]
        return self.prompt_ids[start:] + self.output_ids


@dataclass(frozen=True)
class CompletionOutput:
    """What a finished (or, when streaming, partial) request returns; shaped like vLLM's."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    metrics: dict
    # Streaming only: the tokens and text added since the previous output of this request.
    delta_token_ids: list[int] = field(default_factory=list)
    delta_text: str = ""
    # When the request asked for them (SamplingParams.logprobs / prompt_logprobs), else None;
    # logprobs[i] is token_ids[i]'s, delta_logprobs those of delta_token_ids, prompt_logprobs[0] None.
    logprobs: list[TokenLogprobs] | None = None
    delta_logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
