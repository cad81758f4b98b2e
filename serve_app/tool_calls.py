"""Tool calls in a chat reply: reading them out of the generated text, whole or as it streams.

Formats, by what the text of a reply that calls tools looks like:
- named: tool_choice names a function; the text is that call's arguments, a JSON object the
  request's constraint holds to the function's parameters schema.
- required: tool_choice "required"; the text is a JSON array of {"name": ..., "parameters": {...}}
  objects, held to the tools' schemas by the constraint (`required_schema`, vLLM's shape).
- hermes: tool_choice "auto" with a model trained on Hermes-style calls (Qwen 2.5 and 3, Hermes,
  many others): <tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks among the text.
- llama3_json: tool_choice "auto" with Llama 3.1-3.3: a reply that starts with a JSON object
  (after an optional <|python_tag|>) is calls {"name": ..., "parameters": {...}} separated by ";".
"auto" text is not constrained: the model decides whether to call, and text outside calls is
the reply's content.

Invariant the stream relies on: `parse(prefix, final=False)` reports content and arguments that
are prefixes of what `parse(whole, final=True)` reports, and calls in the same order, so a
stream's deltas add up to exactly the whole reply. Text that might still turn into a call (a
partial "<tool_call>", whitespace that may precede one) is held back until it is decided.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

FORMATS = ("named", "required", "hermes", "llama3_json")
# The server-side choice for tool_choice "auto" (the model's own format).
AUTO_PARSERS = ("hermes", "llama3_json")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_WS = " \t\r\n"
# A function that takes no parameters: its arguments are an empty object.
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass
class Call:
    name: str
    arguments: str  # the arguments' JSON text as generated (partial while streaming)


@dataclass
class Parsed:
    content: str
    calls: list[Call] = field(default_factory=list)


def required_schema(functions: list[tuple[str, dict | None]], parallel: bool) -> dict:
    """The JSON Schema of a "required" reply: one or more calls of the given (name, parameters)."""
    items = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "parameters": params or NO_PARAMETERS},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for name, params in functions
    ]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


# ---- scanning JSON as it arrives (structure only; json.loads checks the pieces it keeps) --------


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _string_end(text: str, i: int) -> int | None:
    """text[i] is '"': the index after the closing quote, None when the text ends first."""
    i += 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
        elif text[i] == '"':
            return i + 1
        else:
            i += 1
    return None


def _value_end(text: str, i: int) -> int | None:
    """The index after the JSON value starting at text[i], None when the text ends first."""
    if text[i] == '"':
        return _string_end(text, i)
    if text[i] in "{[":
        depth = 0
        while i < len(text):
            c = text[i]
            if c == '"':
                end = _string_end(text, i)
                if end is None:
                    return None
                i = end
                continue
            depth += c in "{["
            depth -= c in "}]"
            i += 1
            if depth == 0:
                return i
        return None
    end = i  # a number, true, false or null: up to the next delimiter
    while end < len(text) and text[end] not in ",}] \t\r\n":
        end += 1
    return end if end < len(text) else None


@dataclass
class _Scan:
    name: str | None = None
    arguments: str = ""
    end: int | None = None  # the index after the object's "}"; None while it is open
    bad: bool = False  # the text is not a call object


def _scan_call(text: str, i: int, keys: tuple[str, ...]) -> _Scan:
    """A call object starting at text[i] (after whitespace): its name once its string has closed,
    its arguments (the value of the first of `keys` present) as far as they have arrived."""
    scan = _Scan()
    i = _skip_ws(text, i)
    if i < len(text) and text[i] != "{":
        scan.bad = True
    if i >= len(text) or scan.bad:
        return scan
    i += 1
    while True:
        i = _skip_ws(text, i)
        if i >= len(text):
            return scan
        if text[i] in ",}":
            if text[i] == "}":
                scan.end = i + 1
                return scan
            i += 1
            continue
        key_end = _string_end(text, i) if text[i] == '"' else -1
        if key_end is None:
            return scan
        colon = _skip_ws(text, key_end) if key_end > 0 else -1
        if key_end < 0 or (colon < len(text) and text[colon] != ":"):
            scan.bad = True
            return scan
        start = _skip_ws(text, colon + 1)
        if start >= len(text):
            return scan
        key, end = _loads(text[i:key_end]), _value_end(text, start)
        if key == "name":
            name = _loads(text[start:end]) if end is not None else ""
            if text[start] != '"' or not isinstance(name, str):
                scan.bad = True
                return scan
            scan.name = name if end is not None else None
        elif key in keys and not scan.arguments and (end is not None or text[start] in "{["):
            scan.arguments = text[start:end] if end is not None else text[start:]
        if end is None:
            return scan
        i = end


def _loads(text: str):
    """A JSON string's value; None when it is not valid JSON (a bad escape, say)."""
    try:
        return json.loads(text)
    except ValueError:
        return None


def _held_back(tail: str, marker: str, final: bool) -> str:
    """The part of trailing text that is surely content: without a suffix that may begin `marker`,
    or whitespace that may precede it (both kept once the text is final)."""
    if final:
        return tail
    for n in range(min(len(marker) - 1, len(tail)), 0, -1):
        if marker.startswith(tail[-n:]):
            tail = tail[:-n]
            break
    return tail.rstrip(_WS)


# ---- the formats ------------------------------------------------------------------------------


def parse_hermes(text: str, final: bool) -> Parsed:
    out, parts, i = Parsed(""), [], 0
    while True:
        start = text.find(HERMES_OPEN, i)
        if start < 0:
            tail = text[i:].lstrip(_WS) if out.calls else text[i:]
            parts.append(_held_back(tail, HERMES_OPEN, final))
            break
        before = text[i:start].lstrip(_WS) if out.calls else text[i:start]
        scan = _scan_call(text, start + len(HERMES_OPEN), ("arguments", "parameters"))
        not_call = scan.name is None and (scan.bad or scan.end is not None or final)
        parts.append(before if not_call else before.rstrip(_WS))  # whitespace around calls is not content
        if not_call:  # its block is content
            close = text.find(HERMES_CLOSE, start)
            if close < 0:
                parts.append(text[start:] if final else "")
                break
            parts.append(text[start : close + len(HERMES_CLOSE)])
            i = close + len(HERMES_CLOSE)
            continue
        if scan.name is not None:
            out.calls.append(Call(scan.name, scan.arguments))
        if scan.end is None and not scan.bad:
            break  # the call is still arriving (or max_tokens cut it)
        close = text.find(HERMES_CLOSE, scan.end or start)
        if close < 0:
            break  # the rest of this block is not yet (or never) closed
        i = close + len(HERMES_CLOSE)
    out.content = "".join(parts)
    return out


def parse_llama3_json(text: str, final: bool) -> Parsed:
    body = _skip_ws(text, 0)
    if text.startswith(PYTHON_TAG, body):
        body = _skip_ws(text, body + len(PYTHON_TAG))
    if body >= len(text) or (not final and PYTHON_TAG.startswith(text[body:])):
        return Parsed(text if final else "")  # undecided: text so far could still begin a call
    if text[body] != "{":
        return Parsed(text)
    out, i = Parsed(""), body
    while True:
        scan = _scan_call(text, i, ("parameters", "arguments"))
        if scan.name is None:
            if scan.bad or scan.end is not None:  # a JSON reply that is not a call: all content
                return Parsed(text) if not out.calls else out
            return Parsed(text if final else "") if not out.calls else out
        out.calls.append(Call(scan.name, scan.arguments))
        if scan.end is None:
            return out
        i = _skip_ws(text, scan.end)
        if i < len(text) and text[i] == ";":
            i += 1
            continue
        return out  # anything after the last call is not part of the reply's calls


def parse_required(text: str, final: bool) -> Parsed:
    out, i = Parsed(""), _skip_ws(text, 0)
    if i >= len(text) or text[i] != "[":
        return out
    i += 1
    while True:
        i = _skip_ws(text, i)
        if i >= len(text) or text[i] == "]":
            return out
        if text[i] == ",":
            i += 1
            continue
        scan = _scan_call(text, i, ("parameters",))
        if scan.name is not None:
            out.calls.append(Call(scan.name, scan.arguments))
        if scan.end is None or scan.bad:
            return out
        i = scan.end


class ToolCallReader:
    """One chat request's reading of its replies: whole (`message`) or streamed (`stream`)."""

    def __init__(self, fmt: str, function: str | None = None) -> None:
        assert fmt in FORMATS and (fmt == "named") == (function is not None)
        self.fmt, self.function = fmt, function

    def parse(self, text: str, final: bool) -> Parsed:
        if self.fmt == "named":
            return Parsed("", [Call(self.function, text)])
        return {"required": parse_required, "hermes": parse_hermes, "llama3_json": parse_llama3_json}[self.fmt](
            text, final
        )

    def message(self, text: str) -> dict:
        """The chat message of a whole reply: content (None beside calls when empty) and tool_calls."""
        parsed = self.parse(text, final=True)
        if not parsed.calls:
            return {"role": "assistant", "content": parsed.content}
        calls = [_call_dict(i, c.name, c.arguments, new_call_id()) for i, c in enumerate(parsed.calls)]
        return {"role": "assistant", "content": parsed.content or None, "tool_calls": [_whole(c) for c in calls]}

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        """OpenAI's: "tool_calls" when the model chose to call (auto, required) and stopped;
        "stop" for a named tool_choice, as OpenAI answers a forced call."""
        return "tool_calls" if reason == "stop" and called and self.fmt != "named" else reason

    def stream(self) -> "ToolCallStream":
        return ToolCallStream(self)


class ToolCallStream:
    """One streamed choice: text deltas in, OpenAI chat deltas out (content and tool_calls)."""

    def __init__(self, reader: ToolCallReader) -> None:
        self.reader, self.text, self.sent_content = reader, "", 0
        self.sent: list[int] = []  # per call: characters of its arguments sent

    @property
    def called(self) -> bool:
        return bool(self.sent)

    def feed(self, delta: str, final: bool) -> dict:
        """The delta to send for this much more text ({} when nothing is decided yet)."""
        self.text += delta
        parsed, out = self.reader.parse(self.text, final), {}
        if len(parsed.content) > self.sent_content:
            out["content"] = parsed.content[self.sent_content :]
            self.sent_content = len(parsed.content)
        calls = []
        for index, call in enumerate(parsed.calls):
            if index == len(self.sent):
                calls.append(_call_dict(index, call.name, call.arguments, new_call_id()))
                self.sent.append(len(call.arguments))
            elif len(call.arguments) > self.sent[index]:
                calls.append({"index": index, "function": {"arguments": call.arguments[self.sent[index] :]}})
                self.sent[index] = len(call.arguments)
        if calls:
            out["tool_calls"] = calls
        return out


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _call_dict(index: int, name: str, arguments: str, call_id: str) -> dict:
    return {"index": index, "id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _whole(call: dict) -> dict:
    """A message's tool call (a stream's deltas carry the index; a whole message does not)."""
    return {k: v for k, v in call.items() if k != "index"}
