"""Thin Serve deployments over the plain classes: the draft pool's workers, the target replicas
and the ingress (HTTP routes and gRPC methods).

Per-round traffic never goes through Serve: a target replica's engine is given the Ray worker
provider (actors/leased_workers.py), leases draft workers from the lease registry and talks to
them over the data plane (torch or grpc). Serve places, starts, health-checks and replaces the
replicas.
"""

# No `from __future__ import annotations`: FastAPI reads the route methods' annotations
# (Request) at class creation, through Serve's ingress wrapper, and needs them evaluated.
import asyncio
import faulthandler
import logging
import sys
import time
from collections.abc import AsyncIterator
from functools import partial

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve_app.auth import HTTP_HINT, authorize
from serve_app.config import WORKER_MODES, ServeSettings
from serve_app.drain import DrainReporter
from serve_app.engine_loop import EngineLoop
from serve_app.errors import APIError, engine_failed, overloaded, retried_elsewhere
from serve_app.grpc_api import GrpcFrontend
from serve_app.http_body import drain, parse_body, read_body
from serve_app.metrics import ServeMetrics
from serve_app.openai_api import OpenAIFrontend
from serve_app.pool_scaling import WANTED, lessees
from serve_app.replica_logs import use_replica_log
from serve_app.types import GenerateChunk, GenerateRequest
from ssd.engine.factory import EngineFactory, build_engines

logger = logging.getLogger(__name__)

# /health and gRPC Health/Check answer "unavailable" when no target replica answers within this.
HEALTH_TIMEOUT_S = 5.0
# A generation refused by a target replica whose engine failed, before its first chunk, is sent
# again every RETRY_BACKOFF_S for up to ServeSettings.retry_window_s: Serve marks such a replica
# unhealthy after 3 failed health checks (health_check_period_s apart) and stops routing to it.
RETRY_BACKOFF_S = 0.2
# A target replica still closing after this many seconds writes every thread's stack to its
# stderr (the replica's worker-*.err log): Serve force-kills it at graceful_shutdown_timeout_s,
# and without the stacks nothing would say what its close waited on.
CLOSE_STACKS_AFTER_S = 20.0
# How often a replica being stopped looks whether its requests are done; Serve sleeps this long
# before its first look, so with Serve's 2 s every deletion, redeploy and scale-down took 2 s even
# for an idle replica.
SHUTDOWN_WAIT_LOOP_S = 0.5


@serve.deployment(
    name="DraftPool",
    health_check_period_s=5,
    max_ongoing_requests=4,
    graceful_shutdown_wait_loop_s=SHUTDOWN_WAIT_LOOP_S,
)
class DraftPoolDeployment:
    """One draft worker of the shared pool: loads the draft, listens on a port the OS picks and
    registers with the lease registry; targets lease it from there. Replaced by Serve when its
    session thread dies; the replacement registers under its own replica id."""

    def __init__(self, settings: ServeSettings) -> None:
        use_replica_log()
        from actors.lease_registry import get_or_create_registry
        from actors.worker_actor import PoolMember
        from ssd.model.loader import load_config

        cfg = settings.engine_args("ssd").to_config()
        vocab = load_config(cfg.target, cfg).vocab_size  # Llama family: without transformers config classes
        context = serve.get_replica_context()
        self.member = PoolMember(cfg, vocab, get_or_create_registry(), f"serve-{context.replica_tag}")
        self.lessees = lessees(context.app_name)  # the targets this pool follows
        self.metrics = ServeMetrics("draft")

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metric of this deployment (serve_app/pool_scaling.py): how
        many workers of this pool's configuration this application's targets want."""
        wanted = await self.member.registry.demand.remote(self.member.fp, self.lessees)
        return {WANTED: float(wanted)}

    def check_health(self) -> None:
        if not self.member.alive():
            raise RuntimeError("the draft worker's session thread stopped")
        self.metrics.draft_held(self.member.held())

    def __del__(self) -> None:
        member = getattr(self, "member", None)
        if member is not None:
            member.shutdown()


@serve.deployment(
    name="Target",
    health_check_period_s=5,
    health_check_timeout_s=30,
    graceful_shutdown_timeout_s=30,
    graceful_shutdown_wait_loop_s=SHUTDOWN_WAIT_LOOP_S,
)
class TargetDeployment:
    """A target replica: one EngineLoop (continuous batching) over one engine per served mode,
    built by `engine_factory` (as Ray Serve LLM's deployment takes its engine_cls): called with
    the engine options, the served modes, this replica's worker provider and rank launcher."""

    def __init__(self, settings: ServeSettings, draft_pool=None, engine_factory: EngineFactory = build_engines) -> None:
        use_replica_log()
        from actors.leased_workers import leased_workers
        from actors.tp_ranks import RayRanks

        app = serve.get_replica_context().app_name
        # The draft deployment (draft_pool) is the pool: lease its workers, never start others.
        engine = settings.engine.model_copy(update={"draft_start_workers": False})
        # Ranks 1..t-1 as actors in this replica's placement group (serve_app/placement.py).
        ranks = RayRanks(settings.target_rank_resources) if engine.tensor_parallel_size > 1 else None
        self.loop = EngineLoop(
            engine_factory(engine, settings.engine_modes, partial(leased_workers, lessee_prefix=lessees(app)), ranks),
            settings.capacity,
            settings.overload_status,
            settings.retry_after_s,
            settings.stream_interval_ms / 1000,
        )
        self.metrics = ServeMetrics("target")
        self._exports: set[asyncio.Task] = set()  # engine figures being read after a request finished

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        async for chunk in self.loop.generate(request):
            yield chunk
            if chunk.finish_reason:
                self.metrics.finished(chunk)
                if chunk.mode in WORKER_MODES:
                    # Read at the loop's next round boundary, without holding up the stream's end.
                    task = asyncio.create_task(self._export_after_finish(chunk.mode))
                    self._exports.add(task)
                    task.add_done_callback(self._exports.discard)

    async def stats(self) -> dict:
        figures = await self.loop.read_figures()
        out = self.loop.stats(figures)
        for mode, metrics in figures.metrics.items():
            out[f"{mode}_metrics"] = metrics
        return out

    async def check_health(self) -> None:
        if not self.loop.healthy():
            raise RuntimeError(f"engine loop failed: {self.loop.failure}")
        figures = await self.loop.read_figures()
        self.metrics.target_sequences.set(sum(figures.running[m] + figures.waiting[m] for m in self.loop.engines))
        for mode in WORKER_MODES:  # also when idle: a lost worker shows without traffic
            if mode in self.loop.engines:
                self._export(figures.metrics[mode])

    async def _export_after_finish(self, mode: str) -> None:
        try:
            self._export((await self.loop.read_figures()).metrics[mode])
        except Exception:  # noqa: BLE001 - a task nobody awaits: say why the figures were not exported
            logger.exception("the %s engine's figures were not exported after a request finished", mode)

    def _export(self, figures: dict) -> None:
        """The gauges and counters of an engine that leases draft workers (ssd, auto), from its
        LLMEngine.engine_metrics() figures."""
        self.metrics.engine(figures)
        self.metrics.auto(figures)

    def __del__(self) -> None:
        loop = getattr(self, "loop", None)
        if loop is None:
            return
        started = time.monotonic()
        faulthandler.dump_traceback_later(CLOSE_STACKS_AFTER_S, file=sys.stderr)
        try:
            loop.close()
        finally:
            faulthandler.cancel_dump_traceback_later()
        logger.info("target replica closed in %.1f s", time.monotonic() - started)


def _http_app() -> FastAPI:
    api = FastAPI(title="ssd-serve", docs_url=None, redoc_url=None, openapi_url=None)

    @api.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError):
        headers = {"Retry-After": str(err.retry_after_s)} if err.retry_after_s is not None else None
        return JSONResponse(err.body(), status_code=err.status, headers=headers)

    @api.exception_handler(Exception)
    async def _unexpected(request: Request, err: Exception):
        logger.exception("%s %s failed", request.method, request.url.path, exc_info=err)
        return JSONResponse(
            APIError(500, "internal error; retry the request", None, "internal").body(), status_code=500
        )

    @api.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException):
        status = err.status_code if err.status_code in (404, 405) else 400
        await drain(request.stream())  # no route read the body (http_body.drain)
        return JSONResponse(
            APIError(status, "no such route" if status == 404 else "method not allowed", None, "not_found").body(),
            status_code=status,
        )

    return api


api = _http_app()


@serve.deployment(
    name="Ingress",
    health_check_period_s=5,
    max_ongoing_requests=1024,
    graceful_shutdown_wait_loop_s=SHUTDOWN_WAIT_LOOP_S,
)
@serve.ingress(api)
class IngressDeployment:
    """Validation, auth, chat templates and streaming; forwards generations to the target."""

    def __init__(self, settings: ServeSettings, target) -> None:
        use_replica_log()
        from ssd.model.loader import load_tokenizer

        cfg = settings.engine.to_config()
        self.settings, self.target = settings, target
        self.api_key = settings.api_key_here()  # in this process: a key set in this pod's environment counts
        self.metrics = ServeMetrics("ingress")
        tokenizer = load_tokenizer(cfg.target, cfg.trust_remote_code)
        self.openai = OpenAIFrontend(settings, tokenizer, self._generate)
        self.grpc = GrpcFrontend(settings, self._generate, self.api_key, self._health)
        context = serve.get_replica_context()
        self.drain = DrainReporter(context.app_name, context.replica_tag)

    async def _generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """The target's stream of one generation; closing it cancels the generation there."""
        from ray.serve.exceptions import BackPressureError

        await self.drain.ensure_started()
        if self.drain.draining:
            raise APIError(
                503,
                "the server is shutting down; retry on another instance",
                None,
                "shutting_down",
                self.settings.retry_after_s,
            )
        done, response, timer = False, None, None
        self.drain.inflight += 1  # no await since the check: a drain that starts now waits for it
        try:
            timer = self.metrics.request_started()
            response, first = await self._first_chunk(request)
            timer.chunk(first)
            yield first
            if not first.finish_reason:
                async for chunk in response:
                    timer.chunk(chunk)
                    yield chunk
            done = True
        except BackPressureError:
            raise overloaded(self.settings.overload_status, self.settings.retry_after_s) from None
        finally:
            self.drain.inflight -= 1
            if timer is not None:
                timer.finish(done)
            if not done and response is not None:
                response.cancel()

    async def _first_chunk(self, request: GenerateRequest):
        """Open the target's stream -> (stream, its first chunk). A replica whose engine failed
        refuses before admitting anything (503 engine_failed): the request is sent again, to
        whichever replica the router picks, every RETRY_BACKOFF_S for settings.retry_window_s. A
        replica whose process died is tried again once only: the request itself may have killed
        it (in its prefill), and must not take the other replicas down one after another. A
        request whose own round failed (500) is never retried, for the same reason. Nothing was
        generated before a retry, so no output changes."""
        deadline = asyncio.get_running_loop().time() + self.settings.retry_window_s
        died_once = False
        while True:
            response = self.target.options(stream=True).generate.remote(request)
            try:
                return response, await response.__anext__()
            except APIError as err:
                if not retried_elsewhere(err) or asyncio.get_running_loop().time() > deadline:
                    raise
                reason = "its engine failed"
            except ray.exceptions.RayActorError as err:
                if died_once or asyncio.get_running_loop().time() > deadline:
                    raise engine_failed(
                        "no target replica is serving; retry later", self.settings.retry_after_s
                    ) from err
                died_once, reason = True, "its process died"
            except BaseException:  # the caller left (cancelled) or anything unexpected: stop the generation
                response.cancel()
                raise
            self.metrics.retried()
            logger.warning("request %s: a target replica is down (%s); trying again", request.request_id, reason)
            await asyncio.sleep(RETRY_BACKOFF_S)

    def _authorize(self, request: Request) -> None:
        """401 unless the request's Authorization header carries the API key (every route but /health)."""
        authorize(request.headers.get("authorization"), self.api_key, HTTP_HINT)

    async def _health(self) -> bool:
        await self.drain.ensure_started()
        if self.drain.draining:
            return False
        try:  # bounded: with no target replica running, a handle call waits for one
            stats = await asyncio.wait_for(self.target.stats.remote(), HEALTH_TIMEOUT_S)
        except Exception as err:  # noqa: BLE001 - any failure to reach a target means unhealthy
            logger.warning("health: no target replica answered: %s", type(err).__name__)
            return False
        return bool(stats.get("healthy"))

    async def _body(self, request: Request) -> dict:
        try:
            self._authorize(request)
        except APIError:
            await drain(request.stream())  # a 401 answered with the body unread (http_body.drain)
            raise
        length = request.headers.get("content-length")
        return parse_body(await read_body(request.stream(), length, self.settings.max_body_bytes))

    @staticmethod
    def _reply(result) -> Response:
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(result, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return self._reply(await self.openai.completions(await self._body(request)))

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return self._reply(await self.openai.chat(await self._body(request)))

    @api.get("/v1/models")
    async def models(self, request: Request) -> Response:
        self._authorize(request)
        return JSONResponse(self.openai.models())

    @api.post("/tokenize")
    async def tokenize(self, request: Request) -> Response:
        return JSONResponse(self.openai.tokenize(await self._body(request)))

    @api.post("/detokenize")
    async def detokenize(self, request: Request) -> Response:
        return JSONResponse(self.openai.detokenize(await self._body(request)))

    @api.get("/v1/models/{model_id:path}")  # a path: served names may hold slashes (org/model)
    async def model(self, model_id: str, request: Request) -> Response:
        self._authorize(request)
        return JSONResponse(self.openai.model(model_id))

    @api.get("/health")
    async def health(self) -> Response:
        if await self._health():
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable"}, status_code=503)

    # ---- gRPC (Serve's gRPC proxy calls these by method name) ------------------------------------

    async def Generate(self, request, grpc_context):  # noqa: N802 - the proto's method name
        return await self.grpc.generate(request, grpc_context)

    async def GenerateStream(self, request, grpc_context):  # noqa: N802
        async for reply in self.grpc.generate_stream(request, grpc_context):
            yield reply

    async def ListModels(self, request, grpc_context):  # noqa: N802
        return await self.grpc.list_models(request, grpc_context)

    async def Check(self, request, grpc_context):  # noqa: N802 - grpc.health.v1.Health
        return await self.grpc.health_check(request, grpc_context)
