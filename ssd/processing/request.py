"""One request's processing (`Processing`): its penalties, bias, allowed tokens, min_tokens,
min_p, stop ids and bad words, resolved once at admission to token ids. Every role that
processes logits for the request reads it (the glossary is ssd/processing/__init__.py's):
the target's verification and the SD draft build their adjustments from it (adjustments.py),
and the draft protocol carries it to SSD's drafters (SequenceSampling.processing)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Processing:
    """A request's logits processing as every role that processes logits for it needs it: the
    engine's verification and SD draft, and SSD's drafters (the draft protocol carries it, so it
    holds token ids, not text). The fields mean what SamplingParams' of the same names mean, with
    two resolved at admission: stop_token_ids includes EOS unless the request ignores it (what
    min_tokens holds back), and bad_words holds each word's token ids (bad_words.word_tokens)."""

    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: dict[int, float] = field(default_factory=dict)
    allowed_token_ids: tuple[int, ...] | None = None  # sorted, unique
    stop_token_ids: tuple[int, ...] = ()  # sorted, unique
    bad_words: tuple[tuple[int, ...], ...] = ()

    @classmethod
    def of(cls, params, eos: int | None, bad_words: tuple[tuple[int, ...], ...] = ()) -> "Processing":
        """From a request's SamplingParams, the tokenizer's EOS and its bad words' token ids."""
        stops = set(params.stop_token_ids) | ({eos} if eos is not None and not params.ignore_eos else set())
        allowed = None if params.allowed_token_ids is None else tuple(sorted(set(params.allowed_token_ids)))
        return cls(
            params.repetition_penalty, params.frequency_penalty, params.presence_penalty, params.min_p,
            params.min_tokens, dict(params.logit_bias), allowed, tuple(sorted(stops)), tuple(bad_words),
        )  # fmt: skip

    @property
    def active(self) -> bool:
        """Whether `build` must give the row its real scalars and tracked columns (a row without
        gets neutral ones and no tracked tokens; its bad words are token masks, not this)."""
        return bool(
            self.repetition_penalty != 1.0
            or self.frequency_penalty
            or self.presence_penalty
            or self.logit_bias
            or self.allowed_token_ids is not None
            or self.min_tokens
            or self.min_p
        )

    @property
    def any(self) -> bool:
        """Whether it changes the row's distribution at all (bad words included)."""
        return self.active or bool(self.bad_words)
