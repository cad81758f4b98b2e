"""Continuous batching for async callers: one thread steps the engines, requests join and leave
at round boundaries.

A target replica holds one LLMEngine per served mode (ssd, sd, ar), all on one loaded copy of the
models, built by the engine factory the Target deployment is given (ssd/engine/factory.py by
default). Callers (the replica's asyncio loop) hand requests to the loop thread through an
inbox; the thread admits them between rounds, runs a round of each engine that has work, and hands
each round's outputs back to the callers' queues. A caller that stops listening (the client
disconnected) aborts its request: the engine drops the row and the draft pool its state at the
next round boundary.

Invariants: only the loop thread touches the engines after construction; a request counts
against `capacity` from the moment generate() is called until its last chunk or its abort; a
round that raises fails the requests of that engine (each gets the error) and marks the loop
unhealthy, so Serve replaces the replica instead of serving from a broken engine.

Figures (rows running and waiting, LLMEngine.engine_metrics()) are read the same way: a caller
asks (read_figures()), and the loop thread builds them between two rounds, at once when idle,
and hands them back; the latest built is kept in `figures`, replaced whole, never changed in
place. So no figure is read while a round changes it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from serve_app.config import REQUEST_MODES, SPECULATION_MODES
from serve_app.errors import APIError, engine_failed, overloaded
from serve_app.types import GenerateChunk, GenerateRequest
from ssd.core.sequence import CompletionOutput
from ssd.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

# Sent through a request's queue after its last chunk (or instead of it, with an error).
_END = object()
# How long read_figures() waits for the loop thread to reach a round boundary before it answers
# with the latest figures built (a long round, a long prefill): below the ingress's /health wait.
FIGURES_WAIT_S = 2.0


@dataclass
class _Caller:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    mode: str


@dataclass(frozen=True)
class Figures:
    """What the replica reads of its engines, built by the loop thread at one round boundary."""

    rounds: int  # rounds run so far, all engines together
    running: dict[str, int]  # engine mode -> its running rows
    waiting: dict[str, int]  # engine mode -> its waiting rows
    metrics: dict[str, dict]  # engine mode -> LLMEngine.engine_metrics()


def _settle(future: asyncio.Future, figures: Figures | None, err: BaseException | None) -> None:
    """On the asker's event loop: hand it the figures (or the error building them raised)."""
    if future.done():  # it stopped waiting (FIGURES_WAIT_S passed, or it was cancelled)
        return
    if err is not None:
        future.set_exception(err)
    else:
        future.set_result(figures)


def merge(first: GenerateChunk, then: GenerateChunk) -> GenerateChunk:
    """Two consecutive chunks of one request as one."""
    return dataclasses.replace(
        then,
        delta_text=first.delta_text + then.delta_text,
        delta_token_ids=first.delta_token_ids + then.delta_token_ids,
        delta_logprobs=None if first.delta_logprobs is None else first.delta_logprobs + then.delta_logprobs,
        prompt_logprobs=first.prompt_logprobs if first.prompt_logprobs is not None else then.prompt_logprobs,
    )


# How an engine's refusal starts -> the request parameter it names (the engine's per-request k is
# the request's speculation.k).
REFUSED_PARAMS = {
    **{p: p for p in ("stop_token_ids", "logit_bias", "allowed_token_ids", "structured_outputs", "prompt")},
    "k must": "speculation.k",
}


def request_error(err: ValueError) -> APIError:
    """An engine's refusal of a request -> 400 naming the parameter its message starts with."""
    text = str(err)
    if "context length" in text:
        return APIError(400, text, "max_tokens", "context_length_exceeded")
    param = next((name for start, name in REFUSED_PARAMS.items() if text.startswith(start)), None)
    return APIError(400, text, param, "invalid_value")


class EngineLoop:
    """engines: mode -> LLMEngine (the first is the default); capacity: requests held at once."""

    def __init__(
        self,
        engines: dict[str, LLMEngine],
        capacity: int,
        overload_status: int = 503,
        retry_after_s: int = 1,
        stream_interval_s: float = 0.0,
    ) -> None:
        self.engines = engines
        self.default_mode = next(iter(engines))
        self.capacity, self.overload_status, self.retry_after_s = capacity, overload_status, retry_after_s
        self.stream_interval_s = stream_interval_s
        self.tokenizer = self.engines[self.default_mode].tokenizer
        self.max_model_len = self.engines[self.default_mode].max_model_len
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._inbox: list[tuple[GenerateRequest, str, list[int]]] = []  # request, engine mode, prompt ids
        self._aborts: set[str] = set()
        self._callers: dict[str, _Caller] = {}  # every request counted against capacity
        self.failure: str | None = None  # why the loop stopped serving; None while healthy
        self.rounds = 0
        self.round_seconds = 0.0
        # Figures asked for and not built yet, and whether the loop thread still builds them
        # (False once it has ended): both under _lock.
        self._asks: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._answering = True
        self.figures = self._build_figures()  # before the thread starts: no round can be running
        self._thread = threading.Thread(target=self._run, name="ssd-engine-loop", daemon=True)
        self._thread.start()

    # ---- caller side (the replica's event loop) -----------------------------------------------

    @property
    def num_requests(self) -> int:
        return len(self._callers)

    def healthy(self) -> bool:
        if self.failure is None:
            # A split target that lost a rank while idle fails its next round: say so now, so
            # Serve replaces the replica before a request meets it.
            broken = next(filter(None, (engine.broken() for engine in self.engines.values())), None)
            if broken is not None:
                self.failure = broken
        return self.failure is None and self._thread.is_alive()

    def engine_for(self, mode: str | None) -> str:
        """The engine serving a request's speculation mode (None = the default; a deprecated
        spelling, MODE_ALIASES, is read as its mode)."""
        if mode is None:
            return self.default_mode
        engine_mode = REQUEST_MODES.get(mode)
        if engine_mode not in self.engines:
            served = sorted(m for m in SPECULATION_MODES if m in self.engines)
            raise APIError(
                400,
                f"speculation.mode {mode!r} is not served here; served: {served}",
                "speculation.mode",
                "invalid_value",
            )
        return engine_mode

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """Chunks of one request as rounds produce them. Raises APIError before the first chunk
        for a request the engine refuses or the replica cannot take."""
        mode, ids = self._admit(request)
        caller = _Caller(asyncio.get_running_loop(), asyncio.Queue(), mode)
        self._callers[request.request_id] = caller
        finished = False
        try:
            with self._lock:
                self._inbox.append((request, mode, ids))
            self._wake.set()
            if self.failure is not None:  # failed after the check above: the loop takes no more
                raise engine_failed()
            last_yield = 0.0
            while True:
                item = await self._next(caller.queue, last_yield)
                finished = item is _END or isinstance(item, BaseException)
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                last_yield = time.monotonic()
                yield item
        finally:
            self._callers.pop(request.request_id, None)
            if not finished:  # the caller stopped listening: free the row and its draft state
                with self._lock:
                    self._aborts.add(request.request_id)
                self._wake.set()

    def _admit(self, request: GenerateRequest) -> tuple[str, list[int]]:
        """Whether this replica takes the request: -> (its engine mode, its prompt's token ids,
        tokenized here once), else APIError."""
        if not self.healthy():
            raise engine_failed()
        mode = self.engine_for(request.mode)
        if request.request_id in self._callers:
            raise APIError(400, "duplicate request id", None, "invalid_value")
        if len(self._callers) >= self.capacity:
            raise overloaded(self.overload_status, self.retry_after_s)
        try:
            return mode, self.engines[mode].check_request(request.prompt, request.params)
        except ValueError as err:
            raise request_error(err) from None

    async def _next(self, queue: asyncio.Queue, last_yield: float):
        """The next item for a caller: a chunk, _END or an error. Rounds that arrive within
        stream_interval_s of the last chunk, or while the caller was busy, go out as one chunk:
        fewer messages through Serve when the consumer is the bottleneck, none held back."""
        item = await queue.get()
        wait = last_yield + self.stream_interval_s - time.monotonic()
        if wait > 0 and isinstance(item, GenerateChunk) and not item.finish_reason:
            await asyncio.sleep(wait)  # let more rounds arrive: they go out together
        while isinstance(item, GenerateChunk) and not item.finish_reason and not queue.empty():
            following = queue.get_nowait()
            if not isinstance(following, GenerateChunk):
                queue.put_nowait(following)  # _END or an error: after this chunk
                break
            item = merge(item, following)
        return item

    async def read_figures(self) -> Figures:
        """The engines' figures as of the next round boundary, built by the loop thread (at once
        when it is idle). A round still running after FIGURES_WAIT_S: the latest figures built,
        of an earlier boundary. Once the loop thread has ended (failed or closed), built here:
        nothing else touches the engines then."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            answering = self._answering
            if answering:
                self._asks.append((loop, future))
        if not answering:
            return self._build_figures()
        self._wake.set()
        try:
            return await asyncio.wait_for(future, FIGURES_WAIT_S)
        except TimeoutError:
            return self.figures

    def stats(self, figures: Figures) -> dict:
        """Requests held, rounds run, health, and each engine's running and waiting rows."""
        out = {"requests": len(self._callers), "rounds": figures.rounds, "healthy": self.healthy()}
        for mode in self.engines:
            out[mode] = {"running": figures.running[mode], "waiting": figures.waiting[mode]}
        return out

    def close(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)
        for engine in self.engines.values():
            engine.close()

    # ---- loop thread ----------------------------------------------------------------------------

    def _deliver(self, request_id: str, item) -> None:
        caller = self._callers.get(request_id)
        if caller is not None:
            caller.loop.call_soon_threadsafe(caller.queue.put_nowait, item)

    def _take_inbox(self) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, set()
        for request, mode, ids in inbox:
            if request.request_id in aborts:
                continue
            try:
                self.engines[mode].add_request(ids, request.params, request.request_id, request.k)
            except ValueError as err:  # checked already; the engine has the last word
                self._deliver(request.request_id, request_error(err))
        if aborts:
            for engine in self.engines.values():
                engine.abort(list(aborts))

    def _build_figures(self) -> Figures:
        engines = self.engines.items()
        return Figures(
            rounds=self.rounds,
            running={mode: len(engine.running) for mode, engine in engines},
            waiting={mode: len(engine.waiting) for mode, engine in engines},
            metrics={mode: engine.engine_metrics() for mode, engine in engines},
        )

    def _answer_asks(self) -> None:
        """Build the figures asked for since the last boundary, once for every asker."""
        with self._lock:
            asks, self._asks = self._asks, []
        if not asks:
            return
        figures, error = None, None
        try:
            figures = self.figures = self._build_figures()
        except Exception as err:  # noqa: BLE001 - the askers' failure, not the loop's: each gets it
            error = err
        for loop, future in asks:
            try:
                loop.call_soon_threadsafe(_settle, future, figures, error)
            except RuntimeError:  # the asker's event loop is closed: nobody waits
                pass

    def _run(self) -> None:
        mode = self.default_mode
        try:
            while not self._stop.is_set():
                mode = self.default_mode
                self._take_inbox()
                self._answer_asks()
                busy = [(m, e) for m, e in self.engines.items() if e.has_unfinished()]
                if not busy:
                    self._wake.wait(1.0)
                    self._wake.clear()
                    continue
                for mode, engine in busy:
                    started = time.perf_counter()
                    outputs = engine.step()
                    self.rounds += 1
                    self.round_seconds += time.perf_counter() - started
                    for out in outputs:
                        self._deliver(out.request_id, self._chunk(out, mode))
                        if out.finished:
                            self._deliver(out.request_id, _END)
        except Exception as err:  # noqa: BLE001 - whatever stops the thread must fail its callers, not strand them
            self._fail(mode, err)
        finally:
            with self._lock:
                self._answering = False  # from now on read_figures() builds them itself
            self._answer_asks()  # the askers still waiting

    def _fail(self, mode: str, err: Exception) -> None:
        logger.exception(
            "the %s engine failed; failing its requests and reporting the replica unhealthy", mode, exc_info=err
        )
        error = APIError(500, "the target replica failed while generating; retry the request", None, "engine_failed")
        # Every caller, not only the engines' running and waiting rows: a round can fail with a
        # row in neither (admission takes rows out of `waiting` before their prefill runs).
        # Set before the snapshot: a caller that registers after it sees the failure itself.
        self.failure = f"{mode} engine: {type(err).__name__}"
        with self._lock:
            self._inbox = []
        for request_id in list(self._callers):  # one C-level copy under the GIL: no torn iteration
            self._deliver(request_id, error)

    @staticmethod
    def _chunk(out: CompletionOutput, mode: str) -> GenerateChunk:
        return GenerateChunk(
            request_id=out.request_id,
            delta_text=out.delta_text,
            delta_token_ids=list(out.delta_token_ids),
            finish_reason=out.finish_reason,
            prompt_tokens=len(out.prompt_token_ids),
            completion_tokens=len(out.token_ids),
            mode=mode,
            speculation=out.metrics if out.finished else {},
            delta_logprobs=out.delta_logprobs,
            # The prompt's once, with the request's first chunk (its first output holds every token).
            prompt_logprobs=out.prompt_logprobs if len(out.delta_token_ids) == len(out.token_ids) else None,
        )
