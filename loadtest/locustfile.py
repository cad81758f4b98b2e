"""Locust load test of the OpenAI endpoints of `ssd serve`.

    locust -f loadtest/locustfile.py --host http://127.0.0.1:8000 --headless -u 4 -r 4 -t 60s \
        --csv bench_results/loadtest --html bench_results/loadtest.html [--spec-modes auto,ar]

Each user sends requests drawn from a prompt mix (loadtest/prompts.jsonl: one JSON object per
line with `kind` "completion" or "chat", `prompt`, `max_tokens`), streaming or not
(--stream-fraction), each with a speculation mode drawn from --spec-modes: by default every mode
the server serves (its model card on GET /v1/models lists them); a mode given there that the
server does not serve stops the run before its first request. Locust times a
streamed POST only up to its response headers, so the figures that matter are reported as
request events of their own, under the request type in the first column:
    TTFT      ms from sending the request to the first generated text
    ITL       mean ms between chunks after the first (per request)
    TOKPS     generated tokens per second of the request, as the value (not ms)
    E2E       ms from sending to `data: [DONE]` (or the whole JSON body)
    TOKENS    generated tokens of the request, as the value (so average x count = total)
Their name is the mode (one row per mode and figure; the POST rows are named "<kind> <mode>
<stream|whole>"). A request that fails (non-200, an error event, a
stream without [DONE]) is reported as a failure of its POST.
"""

from __future__ import annotations

import json
import logging
import os
import random
import sys
import time
from pathlib import Path

from locust import HttpUser, events, task
from served_modes import pick_modes, served_modes  # beside this file, which Locust puts on sys.path

DEFAULT_PROMPTS = Path(__file__).with_name("prompts.jsonl")
_modes: list[str] = []  # the modes drawn from, set once per process (_check_modes or the first user)


@events.init_command_line_parser.add_listener
def _arguments(parser) -> None:
    parser.add_argument("--prompts-file", default=str(DEFAULT_PROMPTS), help="JSONL prompt mix.")
    parser.add_argument(
        "--spec-modes",
        default="",
        help="Comma-separated speculation modes to draw from (auto, ssd, sd, ar; 'default' = none sent); "
        "default: every mode the server serves. A mode it does not serve stops the run at its start.",
    )
    parser.add_argument("--model", default="ssd-demo", help="The model id the server serves.")
    parser.add_argument("--stream-fraction", type=float, default=0.75, help="Share of requests sent with stream: true.")
    parser.add_argument(
        "--api-key", default=os.environ.get("SSD_API_KEY", ""), help="Bearer key (default: $SSD_API_KEY)."
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="Sampling temperature of every request.")
    parser.add_argument(
        "--think-ms",
        type=float,
        default=200.0,
        help="Each user waits uniformly 0 to this many ms between requests (0: back to back, a closed loop).",
    )


def _resolve_modes(host: str, options) -> list[str]:
    """The modes to draw from (ValueError when the server cannot say or does not serve one)."""
    if not _modes:
        served = served_modes(host, options.model, options.api_key)
        _modes.extend(pick_modes(options.spec_modes, served, host))
    return _modes


@events.init.add_listener
def _check_modes(environment, **_kwargs) -> None:
    """Before the first request: the modes asked for are served (a worker, or a web UI run given
    its host later, checks in its first user's on_start instead)."""
    options = environment.parsed_options
    if options is None or not environment.host or getattr(options, "worker", False):
        return
    try:
        modes = _resolve_modes(environment.host, options)
    except ValueError as err:
        sys.exit(f"loadtest/locustfile.py: {err}")
    logging.getLogger(__name__).info("speculation modes drawn from: %s", ", ".join(modes))


def _load(path: str) -> list[dict]:
    items = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if not items:
        raise ValueError(f"{path}: no prompts")
    return items


class OpenAIUser(HttpUser):
    def wait_time(self) -> float:
        return random.uniform(0.0, self.environment.parsed_options.think_ms / 1000)

    def on_start(self) -> None:
        options = self.environment.parsed_options
        self.prompts = _load(options.prompts_file)
        self.modes = _resolve_modes(self.host, options)
        self.headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else {}

    def _report(self, kind: str, name: str, value: float) -> None:
        mode = name.split(" ")[1]
        events.request.fire(
            request_type=kind, name=mode, response_time=value, response_length=0, exception=None, context={}
        )

    @task
    def generate(self) -> None:
        options = self.environment.parsed_options
        item = random.choice(self.prompts)
        mode = random.choice(self.modes)
        stream = random.random() < options.stream_fraction
        chat = item.get("kind") == "chat"
        body = {
            "model": options.model,
            "max_tokens": item.get("max_tokens", 64),
            "temperature": options.temperature,
            "stream": stream,
        }
        body.update({"messages": [{"role": "user", "content": item["prompt"]}]} if chat else {"prompt": item["prompt"]})
        if stream:
            body["stream_options"] = {"include_usage": True}
        if mode != "default":
            body["speculation"] = {"mode": mode}
        path = "/v1/chat/completions" if chat else "/v1/completions"
        name = f"{'chat' if chat else 'completion'} {mode} {'stream' if stream else 'whole'}"
        sent = time.perf_counter()
        with self.client.post(
            path, json=body, headers=self.headers, stream=stream, catch_response=True, name=name
        ) as response:
            if response.status_code != 200:
                response.failure(f"HTTP {response.status_code}: {response.text[:200]}")
                return
            if stream:
                self._streamed(response, name, sent, chat)
            else:
                tokens = response.json()["usage"]["completion_tokens"]
                elapsed = time.perf_counter() - sent
                self._report("E2E", name, 1000 * elapsed)
                self._report("TOKPS", name, tokens / elapsed if elapsed > 0 else 0.0)
                self._report("TOKENS", name, tokens)
                response.success()

    def _streamed(self, response, name: str, sent: float, chat: bool) -> None:
        first = last = None
        gaps, tokens, done = [], 0, False
        for line in response.iter_lines():
            if not line.startswith(b"data: "):
                continue
            if line == b"data: [DONE]":
                done = True
                break
            event = json.loads(line[6:])
            if "error" in event:
                response.failure(f"error event: {event['error'].get('message', '')[:200]}")
                return
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            choice = event["choices"][0] if event["choices"] else {}
            text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
            if text:
                now = time.perf_counter()
                if first is None:
                    first = now
                    self._report("TTFT", name, 1000 * (now - sent))
                else:
                    gaps.append(now - last)
                last = now
        if not done:
            response.failure("the stream ended without data: [DONE]")
            return
        elapsed = time.perf_counter() - sent
        self._report("E2E", name, 1000 * elapsed)
        if gaps:
            self._report("ITL", name, 1000 * sum(gaps) / len(gaps))
        self._report("TOKPS", name, tokens / elapsed if elapsed > 0 else 0.0)
        self._report("TOKENS", name, tokens)
        response.success()
