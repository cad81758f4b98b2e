"""The tool parts of an OpenAI chat request: the functions offered, the choice among them and the
calls earlier replies made (serve_app/tool_calls.py reads a reply's calls)."""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ssd.processing.structured import StructuredOutputs


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    arguments: str = Field(description="The arguments as JSON text, as the reply that made the call gave them.")


class ToolCall(BaseModel):
    """A call an earlier assistant message made (sent back in the conversation)."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall

    def for_template(self) -> dict:
        # Chat templates read arguments as a mapping (Llama 3's `| tojson`), so JSON text is parsed.
        try:
            arguments = json.loads(self.function.arguments)
        except ValueError:
            arguments = self.function.arguments
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": arguments}}


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="1 to 64 letters, digits, _ . or -.")
    description: str | None = Field(None, max_length=4096)
    parameters: dict | None = Field(None, description="JSON Schema of the arguments object; None = no parameters.")
    strict: bool | None = Field(None, description="Accepted; a forced call's arguments always follow the schema.")

    @field_validator("parameters")
    @classmethod
    def _schema(cls, v):
        if v is not None:
            StructuredOutputs(json=v)  # the bounds a constraint has (size, depth), named here
        return v


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: NamedFunction


def template_tools(tools: list[Tool] | None) -> list[dict] | None:
    """The tools as chat templates read them (`tools=` of apply_chat_template)."""
    return [tool.model_dump(exclude_none=True) for tool in tools] if tools else None
