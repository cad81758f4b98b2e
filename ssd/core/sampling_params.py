"""Per-request sampling parameters (the user boundary: validated, YAML/JSON-able)."""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ssd.core.logprobs import MAX_LOGPROBS
from ssd.processing.bad_words import MAX_BAD_WORD_CHARS, MAX_BAD_WORDS
from ssd.processing.structured import StructuredOutputs

# Temperatures below this are greedy (stored as 0, the epsilon vLLM uses too): a token then keeps
# weight exp(-gap / T) relative to the argmax, so only logits within a few 1e-4 of the max, the
# level of the model's own rounding, keep any mass; the user means argmax.
GREEDY_BELOW_TEMPERATURE = 1e-5
# torch.Generator.manual_seed takes any 64-bit pattern; negative seeds would only alias
# positive ones (-1 is 2**64 - 1), so the range is the unsigned one.
MAX_SEED = 2**64 - 1
# Stop strings are matched at every generated token and held back while streaming (cost grows
# with count x length^2), so one request must not be able to make that arbitrarily large.
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 256
# OpenAI's bounds: at most 300 biased tokens, each by -100..100; penalties in [-2, 2].
MAX_LOGIT_BIAS = 300


class SamplingParams(BaseModel):
    """How one request samples; shaped like vLLM's `SamplingParams`.

    Validation errors are `pydantic.ValidationError`, a subclass of `ValueError`, and name the
    field and its allowed range.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(
        1.0,
        description="Softmax temperature, >= 0; 0 means greedy (argmax), and so does any temperature below "
        f"{GREEDY_BELOW_TEMPERATURE:g} (it is stored as 0).",
    )
    top_p: float = Field(1.0, description="Nucleus sampling mass in (0, 1]; 1 disables it.")
    top_k: int = Field(0, description="Keep only the k most likely tokens, >= 0; 0 disables it.")
    max_tokens: int = Field(
        64,
        description="Maximum number of generated tokens, >= 0; 0 only reads the prompt (with prompt_logprobs: scores "
        "it).",
    )
    stop: list[str] = Field(
        default_factory=list,
        description="Strings that end generation; not included in the output. At most "
        f"{MAX_STOP_STRINGS} strings of 1 to "
        f"{MAX_STOP_STRING_CHARS} characters.",
    )
    stop_token_ids: list[int] = Field(
        default_factory=list,
        description="Token ids that end generation (kept in the output); each >= 0 and below the "
        "model's vocabulary size "
        "(checked when the request is added).",
    )
    ignore_eos: bool = Field(False, description="Keep generating after the end-of-sequence token.")
    include_stop_str_in_output: bool = Field(
        False, description="Keep the stop string that ended generation at the end of the text."
    )
    presence_penalty: float = Field(
        0.0, description="OpenAI's: subtract this from the logit of every token already in the output, in [-2, 2]."
    )
    frequency_penalty: float = Field(
        0.0, description="OpenAI's: subtract this times the token's count in the output from its logit, in [-2, 2]."
    )
    repetition_penalty: float = Field(
        1.0,
        description="Hugging Face's: divide a positive (multiply a negative) logit of a token in the prompt or the "
        "output by this, > 0; 1 = off.",
    )
    logit_bias: dict[int, float] = Field(
        default_factory=dict,
        description=f"Token id -> bias in [-100, 100] added to its logit; at most {MAX_LOGIT_BIAS} tokens.",
    )
    min_p: float = Field(0.0, description="Drop tokens below min_p times the most likely one's probability, [0, 1].")
    min_tokens: int = Field(
        0, description="No EOS or stop token id before this many output tokens, >= 0 (at most max_tokens)."
    )
    allowed_token_ids: list[int] | None = Field(
        None, description="Only these token ids may be generated (a non-empty list); None = all."
    )
    bad_words: list[str] | None = Field(
        None,
        description=f"Words the output must not contain (vLLM's; at most {MAX_BAD_WORDS}, each 1 to "
        f"{MAX_BAD_WORD_CHARS} characters): each word's last token is refused where the output ends with its "
        "others. None = none.",
    )
    structured_outputs: StructuredOutputs | None = Field(
        None,
        description="Constrain the text to a JSON schema, any JSON object, a regex, a choice of strings or a Lark "
        "grammar (exactly one; StructuredOutputs); None = free text.",
    )
    logprobs: int | None = Field(
        None,
        description=f"Return each generated token's log-probability under the target and its this many most likely "
        f"alternatives (0 to {MAX_LOGPROBS}); None = none.",
    )
    prompt_logprobs: int | None = Field(
        None,
        description=f"The same for each prompt token after the first (0 to {MAX_LOGPROBS}); None = none.",
    )
    seed: int | None = Field(
        None,
        description="Per-request random seed in [0, 2**64 - 1]; the same seed reproduces the same "
        "output. None = drawn from "
        "the engine's seed.",
    )

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v: float) -> float:
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {v}")
        return 0.0 if v < GREEDY_BELOW_TEMPERATURE else v

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, v: float) -> float:
        if not (0.0 < v <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {v}")
        return v

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {v}")
        return v

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, v: int) -> int:
        if v < 0:
            raise ValueError(f"max_tokens must be >= 0, got {v}")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _penalty(cls, v: float, info) -> float:
        if not (math.isfinite(v) and -2.0 <= v <= 2.0):
            raise ValueError(f"{info.field_name} must be in [-2, 2], got {v}")
        return v

    @field_validator("repetition_penalty")
    @classmethod
    def _repetition(cls, v: float) -> float:
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 = off), got {v}")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[int, float]) -> dict[int, float]:
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens, got {len(v)}")
        for token, bias in v.items():
            if token < 0:
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {token}")
            if not (math.isfinite(bias) and -100.0 <= bias <= 100.0):
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for token {token}")
        return v

    @field_validator("min_p")
    @classmethod
    def _min_p(cls, v: float) -> float:
        if not (math.isfinite(v) and 0.0 <= v <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {v}")
        return v

    @field_validator("min_tokens")
    @classmethod
    def _min_tokens(cls, v: int, info) -> int:
        if v < 0 or v > info.data.get("max_tokens", v):
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {v}")
        return v

    @field_validator("allowed_token_ids")
    @classmethod
    def _allowed(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and (not v or min(v) < 0):
            raise ValueError("allowed_token_ids must be a non-empty list of token ids >= 0 (or None)")
        return v

    @field_validator("bad_words")
    @classmethod
    def _bad_words(cls, v: list[str] | None) -> list[str] | None:
        if v is not None:
            if len(v) > MAX_BAD_WORDS:
                raise ValueError(f"bad_words takes at most {MAX_BAD_WORDS} words, got {len(v)}")
            if any(not 0 < len(w.strip()) <= MAX_BAD_WORD_CHARS for w in v):
                raise ValueError(f"bad_words must be non-blank strings of at most {MAX_BAD_WORD_CHARS} characters")
        return v or None

    @field_validator("logprobs", "prompt_logprobs")
    @classmethod
    def _logprobs(cls, v: int | None, info) -> int | None:
        if v is not None and not 0 <= v <= MAX_LOGPROBS:
            raise ValueError(f"{info.field_name} must be in [0, {MAX_LOGPROBS}] (or None), got {v}")
        return v

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v):
        if v is None:
            return []
        if isinstance(v, str):
            v = [v]
        if not isinstance(v, (list, tuple)) or any(not isinstance(s, str) or not s for s in v):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        if len(v) > MAX_STOP_STRINGS:
            raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(v)}")
        longest = max((len(s) for s in v), default=0)
        if longest > MAX_STOP_STRING_CHARS:
            raise ValueError(
                f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters long, got one of {longest}"
            )
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_token_ids(cls, v: list[int]) -> list[int]:
        bad = [t for t in v if t < 0]
        if bad:
            raise ValueError(f"stop_token_ids must be token ids >= 0 (and below the vocabulary size), got {bad[0]}")
        return v

    @field_validator("seed")
    @classmethod
    def _seed(cls, v: int | None) -> int | None:
        if v is not None and not 0 <= v <= MAX_SEED:
            raise ValueError(f"seed must be in [0, 2**64 - 1] (or None), got {v}")
        return v

    @model_validator(mode="after")
    def _structured(self) -> "SamplingParams":
        # A grammar ends its text with EOS, the only token it allows once complete: generating
        # past EOS, or refusing it, would leave no token to sample.
        if self.structured_outputs is not None:
            for name in ("ignore_eos", "min_tokens"):
                if getattr(self, name):
                    raise ValueError(
                        f"{name} cannot be combined with structured_outputs (a complete grammar allows only EOS): "
                        f"drop {name}"
                    )
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
