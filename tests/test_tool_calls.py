"""Tool calls without a server: reading calls out of a reply (every format, whole and streamed at
every split), the request fields and their 400s, the chat template, and replies generated under a
required or named tool_choice that parse and validate against the tools' parameters."""

from __future__ import annotations

import json
import random

import pytest
from pydantic import ValidationError

jsonschema = pytest.importorskip("jsonschema")

from serve_app.errors import from_validation  # noqa: E402
from serve_app.openai_api import DEFAULT_CHAT_TEMPLATE  # noqa: E402
from serve_app.openai_protocol import ChatCompletionRequest  # noqa: E402
from serve_app.tool_calls import ToolCallReader  # noqa: E402
from ssd import LLM  # noqa: E402

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 4}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "now"}},  # no parameters
]  # short: the test model's context is 512 bytes, and the tools are part of the prompt (served tests use them too)
CALL = {"id": "call_1", "type": "function", "function": {"name": "now", "arguments": "{}"}}
PARAMETERS = {"get_weather": WEATHER, "now": {"type": "object", "properties": {}, "additionalProperties": False}}

# (format, reply text, expected content, expected [(name, arguments)])
REPLIES = [
    (
        "hermes",
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "d": [1, {"x": "}"}]}}\n'
        '</tool_call>\n<tool_call>{"arguments": {}, "name": "now"}</tool_call>\n',
        "Let me check.",
        [("get_weather", '{"city": "Paris", "d": [1, {"x": "}"}]}'), ("now", "{}")],
    ),
    ("hermes", "plain text with <b> and a < sign\n", "plain text with <b> and a < sign\n", []),
    ("hermes", "x <tool_call>not json</tool_call> y", "x <tool_call>not json</tool_call> y", []),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Pa', "", [("get_weather", '{"city": "Pa')]),
    ("hermes", 'a <tool_call>{"na', 'a <tool_call>{"na', []),  # cut before the name: content
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Rome"}}; {"name": "now", "parameters": {}}',
        "",
        [("get_weather", '{"city": "Rome"}'), ("now", "{}")],
    ),
    ("llama3_json", '<|python_tag|>{"name": "now", "parameters": {"q": "\\"}"}}', "", [("now", '{"q": "\\"}"}')]),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),  # JSON that is not a call
    ("llama3_json", "<html> is a tag", "<html> is a tag", []),
    (
        "required",
        '[{"name": "get_weather", "parameters": {"city": "x, y", "days": 2}}, {"name": "now", "parameters": {}}]',
        "",
        [("get_weather", '{"city": "x, y", "days": 2}'), ("now", "{}")],
    ),
]


def read_stream(reader: ToolCallReader, pieces: list[str]) -> tuple[str, list[tuple[str, str]], bool]:
    """What a client assembles from the stream's deltas: content, calls, and whether it ended by a call."""
    stream, content, names, arguments = reader.stream(), "", {}, {}
    for i, piece in enumerate(pieces):
        delta = stream.feed(piece, final=i == len(pieces) - 1)
        content += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            if "id" in call:
                assert call["index"] not in names and call["id"].startswith("call_")
                names[call["index"]], arguments[call["index"]] = call["function"]["name"], ""
            arguments[call["index"]] += call["function"]["arguments"]
    return content, [(names[i], arguments[i]) for i in sorted(names)], stream.called


@pytest.mark.parametrize("fmt,text,content,calls", REPLIES)
def test_a_whole_reply_and_its_stream_at_every_split_agree(fmt, text, content, calls):
    reader = ToolCallReader(fmt)
    message = reader.message(text)
    got = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
    assert (message["content"] or "", got) == (content, calls)
    assert message["content"] == ((content or None) if calls else content)  # null beside calls, as OpenAI's
    for split in range(len(text) + 1):
        assert read_stream(reader, [text[:split], text[split:]]) == (content, calls, bool(calls)), split
    rng = random.Random(0)
    for _ in range(20):  # many small pieces, as a stream of one token per round delivers them
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert read_stream(reader, pieces) == (content, calls, bool(calls))


def test_a_named_call_streams_its_arguments_as_they_come():
    reader = ToolCallReader("named", "get_weather")
    first = reader.stream().feed('{"ci', final=False)
    assert first["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"ci'}
    assert read_stream(reader, ['{"ci', 'ty": "R"}']) == ("", [("get_weather", '{"city": "R"}')], True)
    assert reader.finish_reason("stop", True) == "stop"  # a forced call stops, as OpenAI's does
    assert ToolCallReader("required").finish_reason("stop", True) == "tool_calls"
    assert ToolCallReader("hermes").finish_reason("stop", False) == "stop"
    assert ToolCallReader("hermes").finish_reason("length", True) == "length"


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "weather in Rome?"}], **fields}
    )


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools.0.function.name"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools.0.function.name"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"x": [[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]}},
                    }
                ]
            },
            "tools.0.function.parameters",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"messages": [{"role": "user"}]}, "messages.0"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": [CALL]}]}, "messages.0"),
    ],
)
def test_bad_tool_fields_are_named(fields, param):
    with pytest.raises(ValidationError) as err:
        request(**fields)
    assert from_validation(err.value).param.startswith(param)


def test_tool_choice_becomes_the_reply_constraint():
    assert request().tool_format() is None and request(tools=TOOLS).tool_format() == "auto"
    assert request(tools=TOOLS, tool_choice="none").sampling_params(8).structured_outputs is None
    named = request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "now"}})
    assert named.sampling_params(8).structured_outputs.json_schema == PARAMETERS["now"]
    one = request(tools=TOOLS, tool_choice="required", parallel_tool_calls=False).sampling_params(8)
    schema = one.structured_outputs.json_schema
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Rome", "days": 2}}], schema)
    for bad in ([], [{"name": "now", "parameters": {}}] * 2, [{"name": "other", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_the_default_template_shows_the_tools_and_earlier_calls(tiny_pair):
    from transformers import AutoTokenizer

    chat = request(
        tools=TOOLS,
        messages=[
            {"role": "user", "content": "time?"},
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "content": "noon", "tool_call_id": "call_1"},
        ],
    )
    tokenizer = AutoTokenizer.from_pretrained(tiny_pair[0])
    text = tokenizer.apply_chat_template(
        [m.for_template() for m in chat.messages],
        tools=chat.tools_for_template(),
        chat_template=DEFAULT_CHAT_TEMPLATE,
        tokenize=False,
        add_generation_prompt=True,
    )
    lines = text.split("\n")
    assert json.loads(lines[0].removeprefix("tools: "))[0]["function"]["name"] == "get_weather"
    assert lines[1:] == [
        "user: time?",
        'assistant: <tool_call>{"name": "now", "arguments": {}}</tool_call>',
        "tool: noon",
        "assistant:",
    ]


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_forced_calls_parse_and_validate_against_the_parameters(tiny_pair, mode):
    engine = {"sd": dict(mode="sd", k=4), "ssd": dict(mode="ssd", k=4, draft_transport="inprocess")}[mode]
    choices = ["required", {"type": "function", "function": {"name": "get_weather"}}]
    with LLM(*tiny_pair, max_num_seqs=8, **engine) as llm:
        for choice in choices:
            chat = request(tools=TOOLS, tool_choice=choice, parallel_tool_calls=False, temperature=1.0)
            reader = ToolCallReader(chat.tool_format(), chat.tool_function())
            params = [chat.sampling_params(96).model_copy(update={"seed": seed}) for seed in range(16)]
            for out in llm.generate(["weather?"] * len(params), params):
                assert out.finish_reason == "stop", out.text
                message = reader.message(out.text)
                assert message["content"] is None and len(message["tool_calls"]) == 1, out.text
                call = message["tool_calls"][0]["function"]
                jsonschema.validate(json.loads(call["arguments"]), PARAMETERS[call["name"]])
