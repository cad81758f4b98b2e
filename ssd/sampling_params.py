"""Per-request sampling parameters (the user boundary: validated, YAML/JSON-able)."""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field, field_validator


class SamplingParams(BaseModel):
    """How one request samples; shaped like vLLM's `SamplingParams`.

    Validation errors are `pydantic.ValidationError`, a subclass of `ValueError`, and name the
    field and its allowed range.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(1.0, description="Softmax temperature, >= 0; 0 means greedy (argmax).")
    top_p: float = Field(1.0, description="Nucleus sampling mass in (0, 1]; 1 disables it.")
    top_k: int = Field(0, description="Keep only the k most likely tokens, >= 0; 0 disables it.")
    max_tokens: int = Field(64, description="Maximum number of generated tokens, >= 1.")
    stop: list[str] = Field(default_factory=list, description="Strings that end generation; not included in the output.")
    stop_token_ids: list[int] = Field(default_factory=list, description="Token ids that end generation (kept in the output).")
    ignore_eos: bool = Field(False, description="Keep generating after the end-of-sequence token.")
    seed: int | None = Field(None, description="Per-request random seed; the same seed reproduces the same output.")

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v: float) -> float:
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {v}")
        return v

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
        if v < 1:
            raise ValueError(f"max_tokens must be >= 1, got {v}")
        return v

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v):
        if v is None:
            return []
        if isinstance(v, str):
            v = [v]
        if any(not isinstance(s, str) or not s for s in v):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        return v

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
