"""The Serve application's configuration: pydantic at the user boundary (the `args` of a Serve
config file, `ssd serve` flags), a frozen dataclass of derived values inside.

Engine options are EngineArgs' own (ssd/config.py), nested under `engine`; this model adds what
only a server has: replicas, the draft pool, limits, the API key, the gRPC message bound.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ssd.core.config import EngineArgs

# The environment variable an API key may come from when the config names none (so a key never
# has to be written into a Serve config file or a KubeRay manifest).
API_KEY_ENV = "SSD_API_KEY"

# The speculation modes a request may ask for: the engine's own (EngineArgs.mode; ar = plain
# decoding of the target), reported by these names everywhere.
SPECULATION_MODES = ("auto", "ssd", "sd", "ar")
# Deprecated spellings of a mode, still accepted wherever a client or a config names one (a
# request's speculation.mode, extra_modes, --extra-modes) and read as that mode.
MODE_ALIASES = {"off": "ar"}
# Every spelling a request may use -> the mode it asks for.
REQUEST_MODES = {**{mode: mode for mode in SPECULATION_MODES}, **MODE_ALIASES}
# Engine modes whose engine leases draft workers of its own from the pool.
WORKER_MODES = ("ssd", "auto")


# Where a served engine differs from EngineArgs' defaults (offline: sd over shared memory); why:
# docs/operations.md, "Defaults that differ".
SERVE_ENGINE_DEFAULTS = {"mode": "auto", "draft_transport": "torch"}

# Extra in-flight requests Serve may route to a full target replica: they are refused there at
# once with the configured status (the replica's own bound is exact), instead of waiting in
# Serve's router queue.
ROUTER_SLACK = 16
# The ingress sends a generation refused by a failed target replica to another for at least this
# long (ServeSettings.retry_window_s: 4 health-check periods where that is longer).
MIN_RETRY_WINDOW_S = 20.0
# The model id served when model_name is unset and the target is the bundled demo pair.
DEMO_MODEL_NAME = "ssd-demo"


def api_key_from(configured: str | None) -> str | None:
    """The API key in force in this process: `configured`, else this process's SSD_API_KEY, else
    None (no authentication).

    Called in two processes on purpose, with the same rule: by AppConfig.to_settings where the
    application is built (`ssd serve`, `serve run`, or the task Serve runs to build it under a
    RayService), and by ServeSettings.api_key_here() in the ingress replica, which may run on another node.
    Under KubeRay the key is a Secret set as SSD_API_KEY in the pods' environment, never in the
    Serve config (k8s/README.md, Security); the ingress's own process is where it must be found.
    """
    return configured or os.environ.get(API_KEY_ENV) or None


class TargetAutoscaling(BaseModel):
    """Target replicas that follow the load (Ray Serve's autoscaling on ongoing requests). The draft
    pool follows the targets (serve_app/pool_scaling.py), so it has no settings of its own here."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_replicas: int = Field(1, ge=1, le=1024, description="Target replicas kept when idle (and started with).")
    max_replicas: int = Field(
        ..., ge=1, le=1024, description="Most target replicas; the cluster must have room for this many and their pool."
    )
    target_ongoing_requests: float = Field(
        ...,
        gt=0,
        description="Requests in flight (running and queued) per replica that Serve scales toward; about half of "
        "engine.max_num_seqs keeps a replica's batch full without a queue.",
    )
    upscale_delay_s: float = Field(
        30.0, ge=0, description="How long the load must stay above before a replica is added."
    )
    downscale_delay_s: float = Field(
        600.0,
        ge=0,
        description="How long the load must stay below before a replica is removed (it finishes its requests first); "
        "the draft pool shrinks after the same delay.",
    )

    look_back_period_s: float = Field(
        30.0,
        gt=0,
        description="The window over which ongoing requests are averaged (replicas and handles report a third of "
        "it apart, at most every 10 s).",
    )

    def serve_config(self) -> dict:
        """Ray Serve's autoscaling_config of the Target deployment."""
        # metrics_interval_s: Ray's own default (10 s) with its default window; a shorter window
        # needs reports as much more often, or it averages one report.
        return {**self.model_dump(), "metrics_interval_s": min(10.0, self.look_back_period_s / 3)}

    @model_validator(mode="after")
    def _check(self) -> "TargetAutoscaling":
        if self.max_replicas < self.min_replicas:
            raise ValueError(
                f"target_autoscaling.max_replicas ({self.max_replicas}) is below min_replicas ({self.min_replicas})"
            )
        return self


class AppConfig(BaseModel):
    """Everything `serve run` / `ssd serve` takes. Unknown keys are rejected, with their name."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    engine: EngineArgs = Field(
        default_factory=lambda: EngineArgs(**SERVE_ENGINE_DEFAULTS),
        description="Engine options (see EngineArgs; here mode defaults to auto and draft_transport "
        "to torch): target, draft, "
        "mode, k, ssd_budget, saguaro_c, draft_transport, "
        "draft_workers (D leased per target replica), draft_worker_resources, max_num_seqs (the maximum batch), ...",
    )
    model_name: str | None = Field(
        None,
        description="The model id clients send and /v1/models lists; None = the target's directory "
        "name (or 'ssd-demo' for "
        "the demo pair).",
    )
    extra_modes: list[Literal["auto", "ssd", "sd", "ar", "off"]] = Field(
        default_factory=lambda: ["ar"],
        description="Per-request speculation modes served besides engine.mode (each is one more "
        "engine on the same loaded "
        "weights in every target replica; 'ar' = plain decoding of the target, 'off' its deprecated spelling, "
        "read as 'ar'). A request asking for a mode not served gets 400.",
    )
    target_replicas: int = Field(
        1, ge=1, le=1024, description="Target deployment replicas (each runs continuous batching over its requests)."
    )
    target_autoscaling: TargetAutoscaling | None = Field(
        None,
        description="Scale the target replicas with the load instead of fixing target_replicas (which must then be "
        "left out, as must draft_pool_size: the pool follows the targets' leases).",
    )
    target_num_cpus: float = Field(
        1.0, ge=0, description="CPUs reserved for each target replica, per tensor-parallel rank."
    )
    target_num_gpus: float = Field(
        0.0,
        ge=0,
        description="GPUs reserved for each target replica, per tensor-parallel rank (set engine.device='cuda' too).",
    )
    tensor_parallel_strategy: Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"] = Field(
        "STRICT_PACK",
        description="Ray placement-group strategy for a replica's engine.tensor_parallel_size ranks (one bundle "
        "of target_num_cpus and target_num_gpus each): STRICT_PACK keeps them on one node (each layer's two "
        "all-reduces cross the node's own links), PACK prefers one node, SPREAD and STRICT_SPREAD spread them "
        "over nodes.",
    )
    draft_pool_size: int | None = Field(
        None,
        ge=0,
        le=4096,
        description="Draft deployment replicas: the shared pool of draft workers that target replicas lease from "
        "(modes ssd and auto). Each target replica's ssd or auto engine leases engine.draft_workers of them, so "
        "the pool needs at least target_replicas x engine.draft_workers x those engines; None = exactly that many.",
    )
    max_queue: int = Field(
        64,
        ge=0,
        description="Requests a target replica holds waiting beyond its running batch "
        "(engine.max_num_seqs); one more is "
        "refused at once.",
    )
    overload_status: Literal[503, 429] = Field(
        503,
        description="HTTP status for a request refused because every target replica is full: 503, or "
        "429 with a Retry-After "
        "header.",
    )
    retry_after_s: int = Field(1, ge=0, description="Retry-After seconds sent with 429.")
    stream_interval_ms: float = Field(
        20.0,
        ge=0,
        le=1000,
        description="Least time between two streamed chunks of one request (the first goes out at "
        "once): rounds that finish "
        "within it go out as one chunk. Each chunk costs the target replica CPU time that its rounds then lack "
        "(the README's serving-overhead figures show how much), so 20 ms (50 updates a second) is the default. 0 "
        "= a chunk per round, or per whatever arrived while the previous one was in flight.",
    )
    drain_timeout_s: float = Field(
        30.0,
        ge=0,
        description="`ssd serve` on SIGTERM or Ctrl-C: how long generations in flight may take to "
        "finish while new ones get "
        "503, before Serve shuts down (a RayService does not run `ssd serve`: there the Target deployment's "
        "graceful shutdown applies).",
    )
    health_check_period_s: float = Field(
        5.0,
        ge=0.5,
        le=600,
        description="Seconds between Serve's health checks of each replica, every deployment of the "
        "application. Serve replaces a replica after 3 failed checks in a row, so a target whose engine "
        "failed is replaced within about 3 periods; meanwhile the ingress sends a generation that replica "
        "refused to another for up to 4 periods (at least 20 s).",
    )
    max_n: int = Field(4, ge=1, le=64, description="Largest `n` (completions per request) accepted.")
    max_body_bytes: int = Field(1 << 20, ge=1024, description="Largest HTTP request body accepted; larger gets 413.")
    max_grpc_message_bytes: int = Field(
        4 << 20,
        ge=1024,
        description="gRPC proxy's maximum message size in bytes (Ray's default is 2 GiB). Applied by "
        "`ssd serve` to the "
        "cluster it starts; elsewhere Serve's proxy reads the environment variable "
        "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE of its node (set it in the node's environment, as the KubeRay manifests "
        "do).",
    )
    api_key: str | None = Field(
        None,
        description=f"Bearer token every route but /health requires; None = read from the {API_KEY_ENV} environment "
        "variable, unset = no authentication.",
    )
    default_max_tokens: int = Field(256, ge=1, description="max_tokens of a request that sets none.")
    chat_template: str | None = Field(
        None,
        description="Jinja chat template for /v1/chat/completions; None = the tokenizer's, or a plain 'role: content' "
        "template when it has none.",
    )

    tool_call_parser: Literal["hermes", "llama3_json"] | None = Field(
        None,
        description='How the model writes a tool call, for tool_choice "auto": hermes (<tool_call>{...}</tool_call>: '
        'Qwen 2.5 and 3, Hermes) or llama3_json (Llama 3.1-3.3); None = "auto" is refused (required, none and '
        "a named function need no parser).",
    )

    @field_validator("engine", mode="before")
    @classmethod
    def _engine_defaults(cls, v):
        return {**SERVE_ENGINE_DEFAULTS, **v} if isinstance(v, dict) else v

    @field_validator("extra_modes")
    @classmethod
    def _mode_names(cls, v):
        return [REQUEST_MODES[m] for m in v]  # a deprecated spelling as the mode's name

    @model_validator(mode="after")
    def _check(self) -> "AppConfig":
        self.engine.to_config()  # the engine's own checks, with its messages
        if self.target_autoscaling is not None:
            for name in ("target_replicas", "draft_pool_size"):
                if name in self.model_fields_set:
                    raise ValueError(
                        f"{name} is set together with target_autoscaling: leave {name} out (the targets' replicas "
                        "follow the load between min_replicas and max_replicas, and the draft pool follows the targets)"
                    )
        leasing = self._leasing_engines()
        ssd = leasing > 0
        needed = self.target_replicas * self.engine.draft_workers * leasing
        if ssd and self.draft_pool_size is not None and self.draft_pool_size < needed:
            # A replica that finds no free worker waits for one and then fails to start.
            engines = f" x {leasing} engines (ssd and auto)" if leasing > 1 else ""
            raise ValueError(
                f"draft_pool_size ({self.draft_pool_size}) is below target_replicas x engine.draft_workers{engines} "
                f"({self.target_replicas} x {self.engine.draft_workers}{f' x {leasing}' if leasing > 1 else ''} = "
                f"{needed}): each target replica's ssd or auto engine leases engine.draft_workers workers of its "
                "own; raise draft_pool_size"
            )
        if self.engine.tensor_parallel_size > 1 and not (self.target_num_cpus or self.target_num_gpus):
            raise ValueError(
                f"engine.tensor_parallel_size={self.engine.tensor_parallel_size} reserves one placement-group bundle "
                "per rank, and a bundle cannot be empty: set target_num_cpus or target_num_gpus above 0"
            )
        if ssd and self.engine.draft_transport not in ("torch", "grpc"):
            raise ValueError(
                f"engine.draft_transport={self.engine.draft_transport!r}: served draft workers are other Ray actors, "
                "reached over 'torch' or 'grpc'"
            )
        return self

    def _leasing_engines(self) -> int:
        """Engines per target replica that lease draft workers (ssd and auto each do)."""
        modes = {self.engine.mode, *self.extra_modes}
        return sum(m in WORKER_MODES for m in modes)

    def to_settings(self) -> "ServeSettings":
        """Every derived value, computed here once."""
        engine_modes = tuple(dict.fromkeys([self.engine.mode, *self.extra_modes]))  # first one is the default
        served = tuple(mode for mode in SPECULATION_MODES if mode in engine_modes)
        scaling = self.target_autoscaling
        fewest, most = (scaling.min_replicas, scaling.max_replicas) if scaling else (self.target_replicas,) * 2
        per_target = self.engine.draft_workers * self._leasing_engines()  # workers one target replica leases
        pool = self.draft_pool_size if self.draft_pool_size is not None else fewest * per_target
        target = self.engine.target
        capacity = self.engine.max_num_seqs + self.max_queue
        return ServeSettings(
            engine=self.engine,
            engine_modes=engine_modes,
            request_modes=served,
            model_name=self.model_name or (DEMO_MODEL_NAME if target is None else Path(target.rstrip("/")).name),
            capacity=capacity,
            target_max_ongoing=capacity + ROUTER_SLACK,
            target_max_queued=max(1, capacity * most),
            max_batch=self.engine.max_num_seqs,
            overload_status=self.overload_status,
            retry_after_s=self.retry_after_s,
            max_n=self.max_n,
            stream_interval_ms=self.stream_interval_ms,
            max_body_bytes=self.max_body_bytes,
            api_key=api_key_from(self.api_key),
            default_max_tokens=self.default_max_tokens,
            chat_template=self.chat_template,
            tool_call_parser=self.tool_call_parser,
            max_grpc_message_bytes=self.max_grpc_message_bytes,
            draft_pool_size=pool if per_target else 0,
            target_replicas=fewest,
            target_replicas_max=most,
            target_autoscaling=scaling.serve_config() if scaling else None,
            draft_pool_autoscaling=_pool_autoscaling(scaling, per_target) if scaling and per_target else None,
            target_rank_resources={"num_cpus": self.target_num_cpus, "num_gpus": self.target_num_gpus},
            health_check_period_s=self.health_check_period_s,
            retry_window_s=max(MIN_RETRY_WINDOW_S, 4 * self.health_check_period_s),
        )


@dataclass(frozen=True)
class ServeSettings:
    """Derived once from AppConfig; what the deployments read."""

    engine: EngineArgs
    engine_modes: tuple[str, ...]  # engine modes each target replica runs; [0] serves requests that ask for none
    request_modes: tuple[str, ...]  # the speculation.mode values served ("auto", "ssd", "sd", "ar")
    model_name: str  # the model id clients send: model_name, else the target's directory name
    capacity: int  # requests one target replica holds: running batch + queue
    target_max_ongoing: int  # the Target deployment's max_ongoing_requests: capacity + ROUTER_SLACK
    target_max_queued: int  # its max_queued_requests: every replica's capacity, at the most replicas
    max_batch: int
    overload_status: int
    retry_after_s: int
    stream_interval_ms: float
    max_n: int
    max_body_bytes: int
    api_key: str | None  # as resolved where the application was built; the ingress checks api_key_here()
    default_max_tokens: int
    chat_template: str | None
    tool_call_parser: str | None  # "auto" tool_choice's format; None = refused
    max_grpc_message_bytes: int
    draft_pool_size: int  # draft deployment replicas at start (0 when no served mode is ssd)
    target_replicas: int  # target deployment replicas at start
    target_replicas_max: int  # the most target replicas there can be (target_replicas when fixed)
    target_autoscaling: dict | None  # the Target deployment's Ray Serve autoscaling_config; None = fixed
    draft_pool_autoscaling: dict | None  # the DraftPool deployment's: follows the leases (pool_scaling.py)
    target_rank_resources: dict[str, float]  # Ray actor options of each tensor-parallel rank (rank 0: the replica)
    health_check_period_s: float  # every deployment's
    # How long the ingress keeps sending a generation that target replicas refuse (their engine
    # failed) to another: past the 3 failed health checks after which Serve stops routing to one.
    retry_window_s: float

    def engine_args(self, mode: str) -> EngineArgs:
        """The engine options of one mode's engine (ar needs no draft settings checked)."""
        return self.engine.model_copy(update={"mode": mode})

    def api_key_here(self) -> str | None:
        """The API key requests must carry, resolved in the calling process (api_key_from): the
        ingress replica calls it in its own process, so a key set only in its pod's environment
        is the one it checks."""
        return api_key_from(self.api_key)


def _pool_autoscaling(scaling: TargetAutoscaling, per_target: int) -> dict:
    """The pool holds per_target workers for each target replica there is, and follows them: up at
    once (a target waits for its workers), down after the targets' own downscale delay."""
    from serve_app.pool_scaling import follow_leases

    targets = scaling.serve_config()
    return {
        "min_replicas": scaling.min_replicas * per_target,
        "max_replicas": scaling.max_replicas * per_target,
        "upscale_delay_s": 0.0,
        **{key: targets[key] for key in ("downscale_delay_s", "look_back_period_s", "metrics_interval_s")},
        "policy": {"policy_function": follow_leases},
    }
