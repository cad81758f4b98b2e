"""Prometheus metrics through Ray Serve's metrics API (ray.serve.metrics): each is exported by
Ray's metrics agent with the prefix `ray_` and the tags deployment, replica, application.

Names and meanings (the README's metrics reference lists the same):
    ssd_requests_total{status}             generations finished at the ingress (ok, error, cancelled)
    ssd_prompt_tokens_total                prompt tokens of finished generations
    ssd_generation_tokens_total            generated tokens
    ssd_time_to_first_token_seconds        request start to its first chunk (histogram)
    ssd_inter_token_latency_seconds        mean time between tokens of one generation (histogram)
    ssd_accepted_tokens_per_round          a generation's mean accepted draft tokens per round (histogram)
    ssd_cache_hits_total / _misses_total   SSD rounds served / not served by the speculation cache
    ssd_backup_rounds_total{kind}          SSD misses by backup: neural, fast
    ssd_rounds_total{mode}                 verification rounds per engine mode
    ssd_draft_workers_live                 draft workers a target replica holds leases on
    ssd_data_plane_wait_ms                 mean ms per round the target spent reaching its draft workers
                                           (send the outcome, wait for and read the reply)
    ssd_target_retries_total               generations the ingress sent again because the target
                                           replica it reached was down before its first chunk
    ssd_target_sequences                   sequences a target replica holds (running + waiting)
    ssd_draft_sequences                    sequences a draft worker holds draft state for
    ssd_draft_cache_rows                   rows of a draft worker's draft KV cache
                                           (the three gauges, set every health check, are 0 when idle:
                                           anything else after traffic stops is a leak)
"""

from __future__ import annotations

import threading
import time

from ray.serve import metrics

from serve_app.types import GenerateChunk

# Every metric this module defines, as Prometheus shows it (Ray adds the ray_ prefix).
PROMETHEUS_NAMES = (
    "ray_ssd_requests_total",
    "ray_ssd_prompt_tokens_total",
    "ray_ssd_generation_tokens_total",
    "ray_ssd_time_to_first_token_seconds",
    "ray_ssd_inter_token_latency_seconds",
    "ray_ssd_accepted_tokens_per_round",
    "ray_ssd_cache_hits_total",
    "ray_ssd_cache_misses_total",
    "ray_ssd_backup_rounds_total",
    "ray_ssd_rounds_total",
    "ray_ssd_auto_switches_total",
    "ray_ssd_mode_seconds_total",
    "ray_ssd_mode_tokens_total",
    "ray_ssd_draft_workers_live",
    "ray_ssd_data_plane_wait_ms",
    "ray_ssd_target_exchange_ms",
    "ray_ssd_replies_awaited",
    "ray_ssd_board_reads",
    "ray_ssd_target_retries_total",
    "ray_ssd_target_sequences",
    "ray_ssd_draft_sequences",
    "ray_ssd_draft_cache_rows",
)

_SECONDS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
_ITL = [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0]
_ACCEPTED = [0.5, 1, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 12, 16]


class RequestTimer:
    """Times one generation at the ingress."""

    def __init__(self, owner: "ServeMetrics") -> None:
        self.owner, self.start, self.first, self.last_chunk = owner, time.perf_counter(), None, None

    def chunk(self, chunk: GenerateChunk) -> None:
        now = time.perf_counter()
        if self.first is None and chunk.delta_token_ids:
            self.first = now
            self.owner.ttft.observe(now - self.start)
        self.last_chunk = chunk
        self.end = now

    def finish(self, done: bool) -> None:
        chunk = self.last_chunk
        status = "ok" if done else ("cancelled" if chunk is not None else "error")
        self.owner.requests.inc(1, tags={"status": status})
        if chunk is None:
            return
        self.owner.prompt_tokens.inc(chunk.prompt_tokens)
        if chunk.completion_tokens:
            self.owner.generation_tokens.inc(chunk.completion_tokens)
        if self.first is not None and chunk.completion_tokens > 1:
            self.owner.itl.observe((self.end - self.first) / (chunk.completion_tokens - 1))


class ServeMetrics:
    """The metrics one deployment records (created in its replica, never at import)."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.requests = metrics.Counter(
            "ssd_requests_total", "Generations finished at the ingress, by status.", tag_keys=("status",)
        )
        self.prompt_tokens = metrics.Counter("ssd_prompt_tokens_total", "Prompt tokens of finished generations.")
        self.generation_tokens = metrics.Counter("ssd_generation_tokens_total", "Generated tokens.")
        self.ttft = metrics.Histogram(
            "ssd_time_to_first_token_seconds", "Seconds from request to first generated token.", boundaries=_SECONDS
        )
        self.itl = metrics.Histogram(
            "ssd_inter_token_latency_seconds", "Mean seconds between generated tokens of a generation.", boundaries=_ITL
        )
        self.accepted = metrics.Histogram(
            "ssd_accepted_tokens_per_round",
            "Mean accepted draft tokens per round of a generation.",
            boundaries=_ACCEPTED,
        )
        self.hits = metrics.Counter("ssd_cache_hits_total", "SSD rounds served from the speculation cache.")
        self.misses = metrics.Counter("ssd_cache_misses_total", "SSD rounds not served from the speculation cache.")
        self.backups = metrics.Counter(
            "ssd_backup_rounds_total", "SSD miss rounds by backup speculator.", tag_keys=("kind",)
        )
        self.rounds = metrics.Counter(
            "ssd_rounds_total", "Verification rounds of generations, by engine mode.", tag_keys=("mode",)
        )
        self.switches = metrics.Counter("ssd_auto_switches_total", "Mode switches of mode-auto engines.")
        self.mode_seconds = metrics.Counter(
            "ssd_mode_seconds_total",
            "Seconds of mode-auto engines' rounds, by the mode they ran in.",
            tag_keys=("mode",),
        )
        self.mode_tokens = metrics.Counter(
            "ssd_mode_tokens_total", "Tokens committed by mode-auto engines' rounds, by mode.", tag_keys=("mode",)
        )
        self._auto_seen: dict[tuple, float] = {}  # the totals of auto engines already exported
        self._auto_lock = threading.Lock()  # generate() and check_health() both export them
        self.live = metrics.Gauge("ssd_draft_workers_live", "Draft workers a target replica holds leases on.")
        self.wait_ms = metrics.Gauge(
            "ssd_data_plane_wait_ms", "Mean ms per round a target waited for its draft workers."
        )
        self.exchange_ms = metrics.Gauge(
            "ssd_target_exchange_ms",
            "Median ms per round of a target's own time with its draft pool (sending the round and its "
            "outcome, awaiting and merging the replies it needs; its forwards excluded).",
        )
        self.replies_awaited = metrics.Gauge(
            "ssd_replies_awaited", "Draft worker replies a target waited for per round (mean since it started)."
        )
        self.board_reads = metrics.Gauge(
            "ssd_board_reads",
            "Rows per round whose hit a target read off its draft worker's board, no reply awaited (mean since it "
            "started; shm pools).",
        )
        self.retries = metrics.Counter(
            "ssd_target_retries_total", "Generations sent again because their target replica was down."
        )
        self.target_sequences = metrics.Gauge(
            "ssd_target_sequences", "Sequences a target replica holds (running + waiting)."
        )
        self.draft_sequences = metrics.Gauge("ssd_draft_sequences", "Sequences a draft worker holds draft state for.")
        self.draft_cache_rows = metrics.Gauge("ssd_draft_cache_rows", "Rows of a draft worker's draft KV cache.")

    def draft_held(self, held: dict) -> None:
        """A draft worker's PoolMember.held()."""
        self.draft_sequences.set(held["sequences"])
        self.draft_cache_rows.set(held["cache_rows"])

    def retried(self) -> None:
        self.retries.inc(1)

    def request_started(self) -> RequestTimer:
        return RequestTimer(self)

    def finished(self, chunk: GenerateChunk) -> None:
        """A generation's last chunk at the target: its speculation statistics."""
        s = chunk.speculation
        rounds = s.get("rounds", 0)
        if not rounds:  # Ray's counters refuse inc(0)
            return
        for mode, n in s.get("rounds_by_mode", {}).items():  # auto: the mode each round ran in
            self.rounds.inc(n, tags={"mode": mode})
        if s.get("rounds_by_mode", {}).get("ar", 0) < rounds:  # some round speculated
            self.accepted.observe(s.get("mean_accepted_per_round", 0.0))
        counts = [
            (self.hits, s.get("cache_hits", 0), None),
            (self.backups, s.get("backup_neural_rounds", 0), {"kind": "neural"}),
            (self.backups, s.get("backup_fast_rounds", 0), {"kind": "fast"}),
            (self.misses, s.get("backup_neural_rounds", 0) + s.get("backup_fast_rounds", 0), None),
        ]
        for metric, value, tags in counts:
            if value:
                metric.inc(value, tags=tags)

    def auto(self, engine_metrics: dict) -> None:
        """Counters from a mode-auto engine's figures (LLMEngine.engine_metrics()["auto"]): what
        grew since the last call."""
        auto = engine_metrics.get("auto")
        if auto is None:
            return
        # (counter, its tags) -> the engine's total now
        totals = {(self.switches, None): auto["switches"]}
        for mode, figures in auto["modes"].items():
            totals[(self.mode_seconds, mode)] = figures["seconds"]
            totals[(self.mode_tokens, mode)] = figures["tokens"]
        with self._auto_lock:
            # Only forward: figures older than some already counted (read before them, handed
            # over after them) add nothing and leave the totals seen as they are.
            grown_by = {key: value - self._auto_seen.get(key, 0) for key, value in totals.items()}
            grown_by = {key: grown for key, grown in grown_by.items() if grown > 0}  # Ray's counters refuse inc(0)
            self._auto_seen.update({key: totals[key] for key in grown_by})
        for (counter, mode), grown in grown_by.items():
            counter.inc(grown, tags=None if mode is None else {"mode": mode})

    def engine(self, engine_metrics: dict) -> None:
        """Gauges from an SSD engine's figures (LLMEngine.engine_metrics())."""
        ssd = engine_metrics.get("ssd", {})
        if "draft_workers_live" in ssd:
            self.live.set(ssd["draft_workers_live"])
        gauges = (
            (self.exchange_ms, "target_exchange_ms"),
            (self.replies_awaited, "replies_awaited"),
            (self.board_reads, "board_reads"),
        )
        for gauge, name in gauges:
            if ssd.get(name) is not None:  # None until the pool's first round
                gauge.set(ssd[name])
        self.wait_ms.set(engine_metrics.get("draft_ms_per_round", 0.0))
