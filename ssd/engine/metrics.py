"""The engine's totals, and the clock that splits a round's time between drafting and verifying."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

from ssd.core.speculation import Source, SpecMetrics, Speculation


@dataclass
class EngineMetrics:
    """Totals over the engine's life (finished and running sequences)."""

    spec: SpecMetrics = field(default_factory=SpecMetrics)
    draft_seconds: float = 0.0  # proposing, sending the outcome to the drafter, taking its reply
    verify_seconds: float = 0.0  # the target's forward, the verification rule, the cache rollback
    generated_tokens: int = 0
    finished_requests: int = 0
    # Wall time of whole steps (speculate, verify, observe; admission and prefill excluded), and
    # the same for the steps in which every row's speculation came from the SSD cache: their
    # tokens per second are Theorem 7's bound with p_hit = 1 at the measured E_hit and T_p.
    step_seconds: float = 0.0
    hit_steps: int = 0
    hit_step_seconds: float = 0.0
    hit_step_tokens: int = 0
    # Proposer-specific figures by mode (Proposer.stats: SSD's fan-out, backup, ...; the others have none)
    extra: dict = field(default_factory=dict)

    @contextmanager
    def timed(self, what: str):
        """Add the time spent inside the block to draft_seconds or verify_seconds (what)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            name = f"{what}_seconds"
            setattr(self, name, getattr(self, name) + time.perf_counter() - start)

    def record_step(self, seconds: float, spec: Speculation, tokens: int) -> None:
        """A step's wall time and the tokens it committed; a step in which every row's
        speculation came from the SSD cache counts towards Theorem 7's bound too."""
        self.step_seconds += seconds
        if spec.k > 0 and spec.source is not None and bool((spec.source == int(Source.CACHE)).all()):
            self.hit_steps += 1
            self.hit_step_seconds += seconds
            self.hit_step_tokens += tokens

    def as_dict(self) -> dict:
        rounds = max(self.spec.rounds, 1)
        return {
            **self.extra,
            **self.spec.as_dict(),
            "generated_tokens": self.generated_tokens,
            "finished_requests": self.finished_requests,
            "draft_ms_per_round": round(1000 * self.draft_seconds / rounds, 3),
            "verify_ms_per_round": round(1000 * self.verify_seconds / rounds, 3),
            "step_seconds_total": self.step_seconds,
            "hit_steps": self.hit_steps,
            "hit_step_tokens": self.hit_step_tokens,
            "hit_step_seconds_total": self.hit_step_seconds,
        }


def graph_metrics(runners: dict) -> dict:
    """{"cuda_graphs": name -> what that runner's CUDA graphs did (replays, eager_forwards,
    captures, capture_s)} for the runners that replay graphs (on a CUDA device, without
    enforce_eager), or {} where none does; None runners are left out. A draft worker's graphs are
    counted in its own process."""
    out = {}
    for name, runner in runners.items():
        stats = runner.graph_stats() if runner is not None else None
        if stats is not None:
            out[name] = {**asdict(stats), "capture_s": round(stats.capture_s, 3)}
    return {"cuda_graphs": out} if out else {}
