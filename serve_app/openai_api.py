"""The OpenAI-compatible front end as a plain class: validate a parsed body (its bytes are read and
parsed by serve_app/http_body.py), fan a request out into one generation per choice, and build
the response or the server-sent events. Its `generate` is a fan_out.Generate: a Serve handle to
the target deployment in production, an EngineLoop in-process in tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator

from pydantic import ValidationError

from serve_app.config import ServeSettings
from serve_app.errors import APIError, from_validation
from serve_app.fan_out import Generate, check_model_and_n, fan_out, interleave
from serve_app.logprobs_format import chat_logprobs, completion_logprobs
from serve_app.openai_protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from serve_app.tool_calls import ToolCallReader
from serve_app.types import GenerateChunk, GenerateRequest

# Used when the tokenizer has no chat template of its own (documented in the README): one
# "role: content" line per message, the tools as one JSON line before them and an assistant's calls
# in the hermes format (serve_app/tool_calls.py).
DEFAULT_CHAT_TEMPLATE = (
    "{% if tools %}tools: {{ tools | tojson }}\n{% endif %}"
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}"
    "{% for call in message.get('tool_calls') or [] %}<tool_call>{{ call['function'] | tojson }}</tool_call>"
    "{% endfor %}{{ '\\n' }}{% endfor %}"  # a literal newline here would be trimmed (trim_blocks)
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def sse(data: dict | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n".encode()


class OpenAIFrontend:
    def __init__(self, settings: ServeSettings, tokenizer, generate: Generate) -> None:
        self.settings, self.tokenizer, self.generate = settings, tokenizer, generate
        self.model_name = settings.model_name
        self.chat_template = (
            settings.chat_template or getattr(tokenizer, "chat_template", None) or DEFAULT_CHAT_TEMPLATE
        )

    def models(self) -> dict:
        return {"object": "list", "data": [self.model(self.model_name)]}

    def model(self, model_id: str) -> dict:
        if model_id != self.model_name:
            raise APIError(
                404,
                f"model {model_id[:100]!r} is not served here; served: {self.model_name!r}",
                "model",
                "model_not_found",
            )
        return {
            "id": self.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "ssd-serve",
            # The `speculation.mode` values served here (loadtest/locustfile.py draws from them).
            "speculation_modes": list(self.settings.request_modes),
        }

    # ---- requests -------------------------------------------------------------------------------

    def _validate(self, cls, body: dict):
        try:
            request = cls.model_validate(body)
        except ValidationError as err:
            raise from_validation(err) from None
        check_model_and_n(request.model, self.model_name, request.n, self.settings.max_n)
        if request.stream_options is not None and not request.stream:
            raise APIError(400, "stream_options is only allowed with stream: true", "stream_options", "invalid_value")
        try:
            params = request.sampling_params(self.settings.default_max_tokens)
        except ValidationError as err:
            raise from_validation(err) from None
        return request, params

    @staticmethod
    def _requests(request, params, prompts: list) -> list[GenerateRequest]:
        spec = request.speculation
        return fan_out(prompts, request.n, params, spec.mode if spec else None, spec.k if spec else None)

    def chat_prompt(self, request: ChatCompletionRequest | TokenizeRequest) -> str:
        messages = [m.for_template() for m in request.messages]
        tools = request.tools_for_template()
        try:
            return self.tokenizer.apply_chat_template(
                messages,
                tools=tools,
                chat_template=self.chat_template,
                tokenize=False,
                add_generation_prompt=request.add_generation_prompt,
            )
        except Exception as err:  # noqa: BLE001 - a template error is the request's (or config's), never a 500
            raise APIError(
                400,
                f"messages could not be rendered with the chat template: {type(err).__name__}",
                "messages",
                "invalid_value",
            ) from None

    def _parse(self, cls, body: dict):
        try:
            request = cls.model_validate(body)
        except ValidationError as err:
            raise from_validation(err) from None
        check_model_and_n(request.model, self.model_name, 1, 1)
        return request

    def tokenize(self, body: dict) -> dict:
        request = self._parse(TokenizeRequest, body)
        if (request.prompt is None) == (request.messages is None):
            raise APIError(400, "give prompt or messages (one of them)", "prompt", "invalid_value")
        text = request.prompt if request.prompt is not None else self.chat_prompt(request)
        tokens = self.tokenizer.encode(text, add_special_tokens=False)
        return {"count": len(tokens), "tokens": tokens}

    def detokenize(self, body: dict) -> dict:
        request = self._parse(DetokenizeRequest, body)
        bad = [t for t in request.tokens if not 0 <= t < len(self.tokenizer)]
        if bad:
            raise APIError(
                400,
                f"token id {bad[0]} is outside the vocabulary [0, {len(self.tokenizer)})",
                "tokens",
                "invalid_value",
            )
        return {"prompt": self.tokenizer.decode(request.tokens)}

    async def completions(self, body: dict) -> dict | AsyncIterator[bytes]:
        request, params = self._validate(CompletionRequest, body)
        return await self._serve(request, self._requests(request, params, request.prompts()), chat=False)

    async def chat(self, body: dict) -> dict | AsyncIterator[bytes]:
        request, params = self._validate(ChatCompletionRequest, body)
        tools = self._tool_reader(request)
        gens = self._requests(request, params, [self.chat_prompt(request)])
        return await self._serve(request, gens, chat=True, tools=tools)

    def _tool_reader(self, request: ChatCompletionRequest) -> ToolCallReader | None:
        fmt = request.tool_format()
        if fmt == "auto":
            if self.settings.tool_call_parser is None:
                raise APIError(
                    400,
                    'tool_choice "auto" needs the server\'s tool_call_parser (`ssd serve --tool-call-parser hermes` '
                    'or llama3_json, the format the model calls tools in); or send tool_choice "required", "none" '
                    "or a named function",
                    "tool_choice",
                    "invalid_value",
                )
            fmt = self.settings.tool_call_parser
        return ToolCallReader(fmt, request.tool_function()) if fmt is not None else None

    # ---- generation -----------------------------------------------------------------------------

    async def _serve(self, request, gens: list[GenerateRequest], chat: bool, tools: ToolCallReader | None = None):
        streams = [self.generate(g) for g in gens]
        # The first chunk of each choice is awaited before answering: a request refused by the
        # target (bad prompt, overload) gets its status code, not a 200 with an error event.
        try:
            firsts = await asyncio.gather(*(anext(s, None) for s in streams))
        except BaseException:
            await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)
            raise
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        echoes = [self._echo(g) if getattr(request, "echo", False) else None for g in gens]
        if request.stream:
            return self._stream(rid, request, streams, firsts, chat, echoes, tools)
        return await self._collect(rid, request, streams, firsts, chat, echoes, tools)

    def _echo(self, gen: GenerateRequest) -> tuple[str, str]:
        """Echo: (the prompt's text, its first token's text, which no logprob entry carries)."""
        prompt = gen.prompt
        ids = prompt if isinstance(prompt, list) else self.tokenizer.encode(prompt, add_special_tokens=False)
        text = prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)
        return text, self.tokenizer.decode(ids[:1])

    @staticmethod
    def _logprobs(request, chat: bool, entries: list, offset: int = 0, first: str = "") -> tuple[dict | None, int]:
        """The logprobs object of these entries (None when the request did not ask) and the text
        offset after them (completions)."""
        if request.logprobs is None or request.logprobs is False:  # completions: int or None; chat: bool
            return None, offset
        if chat:
            return chat_logprobs(entries), offset
        return completion_logprobs(entries, offset, first)

    async def _collect(self, rid: str, request, streams, firsts, chat: bool, echoes: list, tools) -> dict:
        async def drain(index: int):
            chunks = [firsts[index]] if firsts[index] is not None else []
            async for chunk in streams[index]:
                chunks.append(chunk)
            return chunks

        tasks = [asyncio.create_task(drain(i)) for i in range(len(streams))]
        try:
            results = await asyncio.gather(*tasks)
        finally:  # the client went away (cancelled) or a choice failed: stop the others' generations
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        choices, prompt_tokens, completion_tokens, spec = [], 0, 0, []
        n, token_ids = request.n, request.return_token_ids
        for index, chunks in enumerate(results):
            text = "".join(c.delta_text for c in chunks)
            last = chunks[-1]
            prompt_tokens += last.prompt_tokens if index % n == 0 else 0  # each prompt once, whatever n
            completion_tokens += last.completion_tokens
            spec.append({"mode": last.mode, **last.speculation})
            entries = [e for c in chunks for e in c.delta_logprobs or []]
            prompt_text, first = echoes[index] or ("", "")
            if echoes[index] is not None:
                entries = (chunks[0].prompt_logprobs or []) + entries
            logprobs, _ = self._logprobs(request, chat, entries, 0, first)
            finish = last.finish_reason
            if chat:
                message = tools.message(text) if tools else {"role": "assistant", "content": text}
                finish = tools.finish_reason(finish, "tool_calls" in message) if tools else finish
                body = {"message": message, "logprobs": logprobs}
            else:
                body = {"text": prompt_text + text, "logprobs": logprobs}
            if token_ids:
                body["token_ids"] = [t for c in chunks for t in c.delta_token_ids]
            choices.append({"index": index, **body, "finish_reason": finish})
        return {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
            "speculation": spec,
        }

    def _stream(self, rid: str, request, streams, firsts, chat: bool, echoes: list, tools) -> AsyncIterator[bytes]:
        created, kind = int(time.time()), "chat.completion.chunk" if chat else "text_completion"
        offsets = [0] * len(streams)  # completions' text_offset, per choice
        calls = [tools.stream() for _ in streams] if tools else None  # per choice: its calls so far

        def delta_of(index: int, item: GenerateChunk) -> dict | str:
            if not chat:
                return item.delta_text
            if calls is None:
                return {"content": item.delta_text}
            return calls[index].feed(item.delta_text, final=item.finish_reason is not None)

        def finish_of(index: int, reason: str | None) -> str | None:
            return tools.finish_reason(reason, calls[index].called) if calls is not None else reason

        def event(index: int, delta, finish: str | None, extra: dict | None = None, logprobs=None) -> bytes:
            choice = {"index": index, "delta": delta} if chat else {"index": index, "text": delta}
            choice["logprobs"] = logprobs
            return sse(
                {
                    "id": rid,
                    "object": kind,
                    "created": created,
                    "model": self.model_name,
                    "choices": [{**choice, "finish_reason": finish, **(extra or {})}],
                }
            )

        async def events() -> AsyncIterator[bytes]:
            usage = {"prompt_tokens": 0, "completion_tokens": 0}
            if chat:
                for i in range(len(streams)):
                    yield event(i, {"role": "assistant", "content": ""}, None)
            try:
                async with contextlib.aclosing(interleave(streams, firsts)) as merged:
                    async for index, item in merged:
                        if echoes[index] is not None:  # the choice's first chunk: the prompt before it
                            prompt_text, first = echoes[index]
                            echoes[index] = None
                            prompt = item.prompt_logprobs or []
                            logprobs, offsets[index] = self._logprobs(request, chat, prompt, 0, first)
                            yield event(index, prompt_text, None, None, logprobs)
                        logprobs, offsets[index] = self._logprobs(
                            request, chat, item.delta_logprobs or [], offsets[index]
                        )
                        text = delta_of(index, item)
                        extra = {"speculation": {"mode": item.mode, **item.speculation}} if item.finish_reason else {}
                        if request.return_token_ids:
                            extra["token_ids"] = item.delta_token_ids
                        if (
                            (text if calls is not None else item.delta_text)
                            or item.finish_reason
                            or (request.return_token_ids and item.delta_token_ids)
                            or (logprobs is not None and item.delta_token_ids)
                        ):
                            yield event(index, text, finish_of(index, item.finish_reason), extra, logprobs)
                        if item.finish_reason:
                            usage["completion_tokens"] += item.completion_tokens
                            usage["prompt_tokens"] += item.prompt_tokens if index % request.n == 0 else 0
            except APIError as err:  # after the stream started: an error event, then [DONE]
                yield sse(err.body())
                yield sse("[DONE]")
                return
            if request.stream_options is not None and request.stream_options.include_usage:
                usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
                yield sse(
                    {
                        "id": rid,
                        "object": kind,
                        "created": created,
                        "model": self.model_name,
                        "choices": [],
                        "usage": usage,
                    }
                )
            yield sse("[DONE]")

        return events()
