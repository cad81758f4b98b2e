"""One request's state inside the engine, and what the engine hands back for it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ssd.sampling_params import SamplingParams

if TYPE_CHECKING:
    from ssd.engine.stopping import IncrementalDetokenizer


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context length


@dataclass
class SpecMetrics:
    """Speculation counters of one sequence (or, summed, of the engine)."""

    rounds: int = 0
    draft_tokens: int = 0  # speculated tokens offered to the target
    accepted_tokens: int = 0  # of which accepted
    emitted_tokens: int = 0  # accepted + bonus, before stop truncation
    # SSD only: rows served from the speculation cache, and by each backup.
    cache_hits: int = 0
    backup_neural: int = 0
    backup_fast: int = 0
    accepted_on_hit: int = 0

    @property
    def mean_accepted(self) -> float:
        """Mean accepted draft tokens per round (0..K)."""
        return self.accepted_tokens / self.rounds if self.rounds else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def tokens_per_round(self) -> float:
        return self.emitted_tokens / self.rounds if self.rounds else 0.0

    def record(self, drafted: int, accepted: int, emitted: int, source: int) -> None:
        """One round of one sequence; source is a speculation.Source value."""
        self.rounds += 1
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        self.emitted_tokens += emitted
        if source == 1:
            self.cache_hits += 1
            self.accepted_on_hit += accepted
        elif source == 2:
            self.backup_neural += 1
        elif source == 3:
            self.backup_fast += 1

    def add(self, other: "SpecMetrics") -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def as_dict(self) -> dict:
        out = {
            "rounds": self.rounds,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "mean_accepted_per_round": round(self.mean_accepted, 4),
            "acceptance_rate": round(self.acceptance_rate, 4),
            "tokens_per_round": round(self.tokens_per_round, 4),
        }
        ssd_rounds = self.cache_hits + self.backup_neural + self.backup_fast
        if ssd_rounds:
            misses = ssd_rounds - self.cache_hits
            out.update(
                cache_hits=self.cache_hits,
                cache_hit_rate=round(self.cache_hits / ssd_rounds, 4),
                mean_accepted_on_hit=round(self.accepted_on_hit / max(self.cache_hits, 1), 4),
                mean_accepted_on_miss=round((self.accepted_tokens - self.accepted_on_hit) / max(misses, 1), 4),
                backup_neural_rounds=self.backup_neural,
                backup_fast_rounds=self.backup_fast,
            )
        return out


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
    # Streaming bookkeeping: how much of the output was already handed out.
    # Most draft tokens this request's rounds verify (a per-request cap below the engine's K; 0
    # decodes it without speculation); None = the engine's K. Truncating a speculation keeps
    # verification exact: fewer proposals, same rules.
    max_draft: int | None = None
    sent_tokens: int = 0
    sent_text: int = 0
    # The output text, decoded as tokens arrive (made by the engine's StopChecker on first use).
    detokenizer: IncrementalDetokenizer | None = field(default=None, repr=False)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

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

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
