"""Tool calls through the official `openai` client against the served application: a named,
required or automatic tool_choice, streamed and not, in every served mode; the call's arguments
parse and validate against the tool's parameters, a conversation carrying the call and its result
goes on, and what cannot be served gets a 400 naming the field."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from test_tool_calls import PARAMETERS, TOOLS  # noqa: E402

MESSAGES = [{"role": "user", "content": "Weather?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def client(served, path: str = ""):
    return openai.OpenAI(base_url=served.http + path + "/v1", api_key=served.api_key, max_retries=0, timeout=120)


def validated(calls) -> list[tuple[str, dict]]:
    out = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, PARAMETERS[call.function.name])
        out.append((call.function.name, arguments))
    return out


def streamed(chunks) -> tuple[str, list[tuple[str, str]], str, dict]:
    """Content, calls (name, arguments) and finish_reason assembled from a stream's deltas."""
    content, calls, finish, stats = "", {}, None, {}
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            if delta.id is not None:
                calls[delta.index] = [delta.function.name, ""]
            calls[delta.index][1] += delta.function.arguments or ""
        if choice.finish_reason:
            finish, stats = choice.finish_reason, choice.model_extra["speculation"]
    return content, [tuple(calls[i]) for i in sorted(calls)], finish, stats


@pytest.mark.parametrize("mode", ["ssd", "sd", "ar"])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_a_forced_call_validates_streamed_and_not(served, mode, choice):
    chat = client(served).chat.completions
    kwargs = dict(
        model="tiny",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice=NAMED if choice == "named" else "required",
        parallel_tool_calls=False,
        max_tokens=96,
        temperature=0,
        extra_body={"speculation": {"mode": mode}},
    )
    whole = chat.create(**kwargs)
    message = whole.choices[0].message
    assert message.content is None and len(message.tool_calls) == 1
    [(name, _)] = validated(message.tool_calls)
    assert name == "get_weather" or choice == "required"
    # OpenAI's finish reasons: a call the model chose ends with tool_calls, a forced one with stop.
    assert whole.choices[0].finish_reason == ("stop" if choice == "named" else "tool_calls")
    if mode != "ar":  # speculation stays on under the call's constraint
        assert whole.model_extra["speculation"][0]["tokens_per_round"] > 1
    content, calls, finish, _ = streamed(chat.create(**kwargs, stream=True))
    assert (content, finish) == ("", whole.choices[0].finish_reason)
    assert calls == [(c.function.name, c.function.arguments) for c in message.tool_calls]


def test_sampled_required_calls_all_validate(served):
    chat = client(served).chat.completions
    for seed in range(6):
        resp = chat.create(
            model="tiny",
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=96,
            temperature=1.0,
            seed=seed,
        )
        assert resp.choices[0].finish_reason == "tool_calls"
        assert len(validated(resp.choices[0].message.tool_calls)) == 1


def test_auto_reads_the_models_own_calls_among_its_text(served):
    """The served app reads hermes calls; the tiny random model never writes one by itself, so a
    regex holds its reply to text followed by a call (a constraint beside tool_choice "auto" is
    the user's to give)."""
    form = (
        r'Sure\.\n<tool_call>\{"name": "get_weather", "arguments": '
        + r'\{"city": "[a-z]{1,4}", "days": [1-7]\}\}</tool_call>'
    )
    chat = client(served).chat.completions
    kwargs = dict(
        model="tiny",
        messages=MESSAGES,
        tools=TOOLS,
        max_tokens=120,
        temperature=0,
        extra_body={"structured_outputs": {"regex": form}},
    )
    whole = chat.create(**kwargs)
    message = whole.choices[0].message
    assert message.content == "Sure." and whole.choices[0].finish_reason == "tool_calls"
    [(name, arguments)] = validated(message.tool_calls)
    content, calls, finish, stats = streamed(chat.create(**kwargs, stream=True))
    assert (content, finish) == ("Sure.", "tool_calls")
    assert calls == [(name, message.tool_calls[0].function.arguments)]
    assert stats["tokens_per_round"] > 1
    plain = chat.create(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=8, temperature=0)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason == "length"

    # The conversation goes on with the call and its result.
    call = message.tool_calls[0]
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"forecast": "sun"})},
    ]
    after = chat.create(model="tiny", messages=history, tools=TOOLS, tool_choice="none", max_tokens=8)
    assert after.choices[0].message.content and after.choices[0].message.tool_calls is None


def test_what_cannot_be_served_is_named(served):
    # The "small" app has no tool_call_parser: "auto" (the default with tools) is refused, not ignored.
    small = client(served, "/small").chat.completions
    with pytest.raises(openai.BadRequestError) as err:
        small.create(model="tiny-small", messages=MESSAGES, tools=TOOLS, max_tokens=4)
    assert err.value.body["param"] == "tool_choice" and "tool_call_parser" in err.value.body["message"]
    forced = small.create(model="tiny-small", messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, max_tokens=64)
    assert forced.choices[0].message.tool_calls[0].function.name == "get_weather"
    chat = client(served).chat.completions
    cases = (
        (dict(tools=[{"type": "function", "function": {"description": "no name"}}]), "tools.0.function.name"),
        (dict(tool_choice="required"), "tool_choice"),
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
        (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "tool_choice"),
    )
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            chat.create(model="tiny", messages=MESSAGES, max_tokens=4, **kwargs)
        assert err.value.body["param"].startswith(param), err.value.body


def test_tokenize_counts_the_tools_as_chat_does(served):
    import requests

    auth = {"Authorization": f"Bearer {served.api_key}"}
    body = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS}
    counted = requests.post(served.http + "/tokenize", json=body, headers=auth, timeout=60).json()["count"]
    usage = client(served).chat.completions.create(**body, tool_choice="none", max_tokens=1).usage
    without = requests.post(served.http + "/tokenize", json={**body, "tools": None}, headers=auth, timeout=60)
    assert counted == usage.prompt_tokens > without.json()["count"]
