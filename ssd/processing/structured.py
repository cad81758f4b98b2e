"""Structured output: a request's constraint on the shape of its text (a JSON schema, any JSON
object, a regular expression, a choice among strings or a Lark grammar), as the user gives it.

The constraint becomes a grammar (`grammar_text`) that grammar.py compiles against the
tokenizer; the token masks it yields (token_masks.py) are among the adjustments applied to the
target's logits at every position (adjustments.py), so speculation stays exact with respect to
the masked target distribution. Shaped like vLLM's `StructuredOutputsParams`.
"""

from __future__ import annotations

import json

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Bounds on what one request may ask the grammar compiler to do (compilation runs on the
# serving process before the request is queued): a larger or deeper schema is refused with 400.
MAX_SCHEMA_CHARS = 32_768
MAX_SCHEMA_DEPTH = 16
MAX_REGEX_CHARS = 4_096
MAX_GRAMMAR_CHARS = 32_768
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1_024

KINDS = ("json", "json_object", "regex", "choice", "grammar")
# JSON as json.dumps writes it ({"a": 1, "b": [2, 3]}): no whitespace beyond one space after
# each separator. Flexible whitespace lets a model emit blank lines until max_tokens (small ones
# do); a schema's own "x-guidance" options override this.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class StructuredOutputs(BaseModel):
    """Exactly one of the fields below: the text generated must match it (and ends, with EOS, once
    it is complete)."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    json_schema: dict | None = Field(
        None,
        alias="json",
        description=f"A JSON Schema (an object, at most {MAX_SCHEMA_CHARS} characters as JSON and "
        f"{MAX_SCHEMA_DEPTH} levels deep): the text is one JSON value valid against it.",
    )
    json_object: bool = Field(False, description="True: the text is one JSON object (any keys and values).")
    regex: str | None = Field(
        None,
        description=f"The text matches this regular expression in full (at most "
        f"{MAX_REGEX_CHARS} characters; Rust regex syntax, no look-around or back-references).",
    )
    choice: list[str] | None = Field(
        None,
        description=f"The text is exactly one of these strings (1 to {MAX_CHOICES}, each at most "
        f"{MAX_CHOICE_CHARS} characters).",
    )
    grammar: str | None = Field(
        None,
        description=f"A Lark grammar (llguidance's dialect, at most {MAX_GRAMMAR_CHARS} characters) whose "
        "`start` rule the text matches.",
    )

    @model_validator(mode="after")
    def _exactly_one(self) -> "StructuredOutputs":
        given = [k for k in KINDS if self._value(k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs takes exactly one of {', '.join(KINDS)}; got {given or 'none'}")
        if self.json_schema is not None:
            _check_schema(self.json_schema)
        if self.regex is not None and not 0 < len(self.regex) <= MAX_REGEX_CHARS:
            raise ValueError(f"structured_outputs.regex must have 1 to {MAX_REGEX_CHARS} characters")
        if self.grammar is not None and not 0 < len(self.grammar) <= MAX_GRAMMAR_CHARS:
            raise ValueError(f"structured_outputs.grammar must have 1 to {MAX_GRAMMAR_CHARS} characters")
        if self.choice is not None:
            if not 0 < len(self.choice) <= MAX_CHOICES:
                raise ValueError(f"structured_outputs.choice takes 1 to {MAX_CHOICES} strings, got {len(self.choice)}")
            if any(not 0 < len(c) <= MAX_CHOICE_CHARS for c in self.choice):
                raise ValueError(f"structured_outputs.choice strings must have 1 to {MAX_CHOICE_CHARS} characters")
        return self

    def _value(self, kind: str):
        return self.json_schema if kind == "json" else getattr(self, kind)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if self._value(k) not in (None, False))

    def grammar_text(self) -> str:
        """The constraint as an llguidance grammar (what grammar.py compiles)."""
        from llguidance import LLMatcher

        if self.json_schema is not None:
            return LLMatcher.grammar_from_json_schema(self.json_schema, defaults=JSON_LAYOUT)
        if self.json_object:
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)
        if self.regex is not None:
            return LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            # Lark string literals take JSON's escapes, so json.dumps quotes any choice exactly.
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.choice))
        return LLMatcher.grammar_from_lark(self.grammar)


def _check_schema(schema: dict) -> None:
    # Depth first, without recursion: json.dumps of a schema nested thousands deep would raise
    # RecursionError instead of naming the bound.
    depth = _depth(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise ValueError(
            f"structured_outputs.json: the schema nests more than {MAX_SCHEMA_DEPTH} levels deep; at most "
            f"{MAX_SCHEMA_DEPTH}"
        )
    text = json.dumps(schema)
    if len(text) > MAX_SCHEMA_CHARS:
        raise ValueError(
            f"structured_outputs.json: the schema has {len(text)} characters as JSON; at most {MAX_SCHEMA_CHARS}"
        )


def _depth(value) -> int:
    """Levels of nested objects and arrays, counted up to one past MAX_SCHEMA_DEPTH."""
    deepest, stack = 0, [(value, 1)]
    while stack and deepest <= MAX_SCHEMA_DEPTH:
        item, level = stack.pop()
        deepest = max(deepest, level)
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        stack.extend((child, level + 1) for child in children if isinstance(child, (dict, list)))
    return deepest
