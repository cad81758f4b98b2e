"""OpenAI request bodies (/v1/completions, /v1/chat/completions) as pydantic models.

Unknown fields are refused (400 naming the field) rather than silently ignored, and `suffix`, not
implemented, is accepted only as null, so a client never gets a result computed differently from
what it asked for. Penalties, logit bias,
min_p, min_tokens, allowed token ids and structured output (response_format, structured_outputs)
are applied to the target's distribution at every verified position with that position's own
history (ssd/core/logits_processing.py, ssd/core/grammar.py).
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from serve_app.config import REQUEST_MODES
from serve_app.tool_calls import NO_PARAMETERS, required_schema
from serve_app.tool_protocol import NamedToolChoice, Tool, ToolCall, template_tools
from ssd.core.logprobs import MAX_LOGPROBS
from ssd.core.sampling_params import SamplingParams
from ssd.processing.structured import StructuredOutputs

# Prompts in one /v1/completions request (each gets n choices).
MAX_PROMPTS = 32
# Tools in one chat request.
MAX_TOOLS = 128


class Speculation(BaseModel):
    """Per-request speculation: which decoding serves it and how long its speculations are."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["auto", "ssd", "sd", "ar", "off"] | None = Field(
        None,
        description="auto (the fastest of the three, as measured), ssd, sd or ar (plain decoding; 'off' is its "
        "deprecated spelling, read as ar); None = the server's default.",
    )
    k: int | None = Field(
        None,
        ge=0,
        le=32,
        description="Most draft tokens verified per round for this request (at most the server's K; 0 = none).",
    )

    @field_validator("mode")
    @classmethod
    def _mode_name(cls, v):
        return None if v is None else REQUEST_MODES[v]  # a deprecated spelling as the mode's name


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(max_length=64)
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema", description="The JSON Schema; None = any JSON object.")
    strict: bool | None = Field(None, description="Accepted; the schema is always enforced in full.")


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text, any JSON object, or JSON valid against a schema."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type json_schema, and only with it")
        self.structured()  # a bad schema is named here, as response_format's
        return self

    def structured(self) -> StructuredOutputs | None:
        if self.type == "text":
            return None
        if self.type == "json_object" or self.json_schema.schema_ is None:
            return StructuredOutputs(json_object=True)
        return StructuredOutputs(json=self.json_schema.schema_)


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256)
    speculation: Speculation | None = None
    return_token_ids: bool = Field(False, description="Also return each choice's generated token ids (as vLLM does).")
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = Field(None, description="Token id -> bias in [-100, 100].")
    # Beyond OpenAI, as vLLM names them.
    repetition_penalty: float | None = None
    min_p: float | None = None
    min_tokens: int = 0
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    response_format: ResponseFormat | None = None
    # vLLM's: a JSON schema, a regex, a choice or a grammar (exactly one).
    structured_outputs: StructuredOutputs | None = None

    @model_validator(mode="after")
    def _one_constraint(self):
        if self.response_format is not None and self.response_format.type != "text" and self.structured_outputs:
            raise ValueError("give response_format or structured_outputs, not both")
        return self

    def _structured(self) -> StructuredOutputs | None:
        if self.structured_outputs is not None:
            return self.structured_outputs
        return self.response_format.structured() if self.response_format is not None else None

    @field_validator("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p")
    @classmethod
    def _finite(cls, v):
        if v is not None and not math.isfinite(v):
            raise ValueError("must be a finite number")
        return v

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """Raises pydantic's ValidationError naming the field (reported as the request's param)."""
        limits = (self.max_completion_tokens, self.max_tokens, default_max_tokens)
        fields = {
            "max_tokens": next(m for m in limits if m is not None),
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_k": 0 if self.top_k is None or self.top_k == -1 else self.top_k,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids or [],
            "ignore_eos": self.ignore_eos,
            "seed": self.seed,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": 1.0 if self.repetition_penalty is None else self.repetition_penalty,
            "logit_bias": self.logit_bias or {},
            "min_p": 0.0 if self.min_p is None else self.min_p,
            "min_tokens": self.min_tokens,
            "allowed_token_ids": self.allowed_token_ids,
            "bad_words": self.bad_words,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "structured_outputs": self._structured(),
            **self._logprobs(),
        }
        return SamplingParams(**fields)

    def _logprobs(self) -> dict:
        return {}


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = Field(False, description="Return the prompt before the completion (with logprobs: scored).")
    logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_LOGPROBS,
        description="Each token's log-probability and this many most likely alternatives; with echo, the "
        "prompt's tokens too (max_tokens 0 scores a prompt).",
    )
    suffix: None = None

    def _logprobs(self) -> dict:
        prompt = self.logprobs if self.echo else None
        return {"logprobs": self.logprobs, "prompt_logprobs": prompt}

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list):
            if not v:
                raise ValueError("must not be empty")
            if len(v) > MAX_PROMPTS and not isinstance(v[0], int):
                raise ValueError(f"at most {MAX_PROMPTS} prompts per request")
        return v

    def prompts(self) -> list[str | list[int]]:
        v = self.prompt
        if isinstance(v, str) or (v and isinstance(v[0], int)):
            return [v]
        return list(v)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, max_length=128, description="An assistant message's calls.")
    tool_call_id: str | None = Field(None, max_length=256, description="A tool message: the call it answers.")

    @model_validator(mode="after")
    def _content(self) -> "ChatMessage":
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (it may be null only in an assistant message with tool_calls)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    def for_template(self) -> dict:
        """The message as chat templates read it (keys present only when set: templates test them)."""
        message = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [call.for_template() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1, max_length=1024)
    add_generation_prompt: bool = True
    logprobs: bool = Field(False, description="Return each generated token's log-probability.")
    top_logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="With logprobs: this many most likely alternatives per token."
    )

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v, info):
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return v

    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS, description="Functions the model may call.")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None,
        description="none, auto (the model decides; needs the server's tool_call_parser), required (one call or "
        "more) or a named function; None = auto with tools, none without.",
    )
    parallel_tool_calls: bool = Field(True, description="False: required makes exactly one call.")

    def _logprobs(self) -> dict:
        return {"logprobs": (self.top_logprobs or 0) if self.logprobs else None}

    @field_validator("tools")
    @classmethod
    def _unique_names(cls, v):
        names = [tool.function.name for tool in v or []]
        if len(set(names)) != len(names):
            raise ValueError("function names must be unique")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, choice, info):
        tools = info.data.get("tools") or []
        names = {tool.function.name for tool in tools}
        if choice not in (None, "none") and not names:
            raise ValueError("needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"names {choice.function.name[:64]!r}, which is not among tools")
        forced = choice == "required" or isinstance(choice, NamedToolChoice)
        constrained = info.data.get("structured_outputs") is not None or (
            info.data.get("response_format") is not None and info.data["response_format"].type != "text"
        )
        if forced and constrained:
            raise ValueError(
                "a required or named tool_choice constrains the reply itself: drop response_format and "
                "structured_outputs"
            )
        if choice == "required":  # the combined schema has the bounds of any constraint
            required_schema_of(tools, parallel=True)
        return choice

    def tool_format(self) -> str | None:
        """named, required or auto: how the reply is read for calls; None: it is not."""
        choice = self.tool_choice or ("auto" if self.tools else "none")
        if choice == "none":
            return None
        return "named" if isinstance(choice, NamedToolChoice) else choice

    def tool_function(self) -> str | None:
        return self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None

    def tools_for_template(self) -> list[dict] | None:
        return template_tools(self.tools)

    def _structured(self) -> StructuredOutputs | None:
        fmt = self.tool_format()
        if fmt == "named":
            params = next(t.function.parameters for t in self.tools if t.function.name == self.tool_function())
            return StructuredOutputs(json=params or NO_PARAMETERS)
        if fmt == "required":
            return required_schema_of(self.tools, self.parallel_tool_calls)
        return super()._structured()


def required_schema_of(tools: list[Tool], parallel: bool) -> StructuredOutputs:
    return StructuredOutputs(json=required_schema([(t.function.name, t.function.parameters) for t in tools], parallel))


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's shape): a prompt, or chat messages rendered as /v1/chat/completions
    renders them; tokenized as the server tokenizes prompts (no special tokens added)."""

    model_config = ConfigDict(extra="forbid")

    model: str
    prompt: str | None = Field(None, max_length=1_000_000)
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=1024)
    add_generation_prompt: bool = True
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS, description="With messages: as chat renders them.")

    def tools_for_template(self) -> list[dict] | None:
        return template_tools(self.tools)


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    tokens: list[int] = Field(max_length=1_000_000)
