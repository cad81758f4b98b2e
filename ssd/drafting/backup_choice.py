"""Saguaro's backup by batch size (Theorem 17), from live figures: which backup speculates for the
rows that miss, the neural one (the draft, just in time) or the fast one (n-gram lookup).

Glossary (each an exponential moving average over rounds):
    p_hit                  the share of a round's rows that hit
    e_hit, e_neural, e_fast  tokens per round of a row served by the cache, by each backup
    t_primary              a round's time when every row hit, relative to its verification
    t_neural, t_fast       what each backup adds to a round, relative to its verification
    build_ratio            the drafter's cache build time over the verification it overlaps
"""

from __future__ import annotations

from ssd.core.speculation import Source
from ssd.drafting.saguaro import backup_threshold, prefer_fast_backup


class Ema:
    """Exponential moving average; a prior value, or (prior None) the first observation."""

    def __init__(self, value: float | None, weight: float = 0.05) -> None:
        self.value, self.weight, self.seen = (value or 0.0), weight, value is not None
        self.observed = False  # True once a real observation arrived (not just the prior)

    def update(self, x: float, weight: float | None = None) -> None:
        """Move toward x by `weight` (default: the average's own)."""
        self.value = self.value + (weight or self.weight) * (x - self.value) if self.seen else x
        self.seen = self.observed = True

    def or_else(self, fallback: float) -> float:
        return self.value if self.observed else fallback


# While the fast backup is chosen the neural one's cost is not measured, so one slow stretch (on
# a shared VM, the worker's core taken for a while) could keep the choice on fast for good: after
# the fast backup served the misses of PROBE_EVERY rounds, the neural one serves the next round
# with misses, and that measurement moves its estimate PROBE_WEIGHT of the way. (Demo pair, batch
# 1, T=1: runs whose choice turned fast after such a stretch stayed there for hundreds of rounds,
# 12-20% slower.)
PROBE_EVERY = 32
PROBE_WEIGHT = 0.5


class BackupChoice:
    """The live figures of Theorem 17 and the choice they make. `mode` is the configured backup:
    "auto" chooses by batch size, "neural" and "fast" are fixed."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.last = mode if mode != "auto" else "neural"  # the backup of the round being resolved
        self.p_hit, self.e_hit, self.e_neural, self.e_fast = Ema(0.7), Ema(3.0), Ema(3.0), Ema(1.5)
        self.t_primary, self.t_neural, self.t_fast = Ema(1.0), Ema(0.5), Ema(0.01)
        self.build_ratio = Ema(None, weight=0.1)
        self._fast_served = 0  # rounds whose misses the fast backup served since neural last did
        self._probing = False  # the neural backup serves misses until its cost is measured again

    def choose(self, batch: int, fixed_build_share: float | None) -> str:
        """The backup for the misses of a round of `batch` rows (also kept as `last`)."""
        if self.mode == "auto":
            fast = prefer_fast_backup(batch, *self.live(fixed_build_share))
            self._probing = fast and (self._probing or self._fast_served >= PROBE_EVERY)
            self.last = "fast" if fast and not self._probing else "neural"
        return self.last

    def observe_tokens(self, source: Source, tokens: int) -> None:
        """A row's round emitted `tokens` (accepted + bonus) from a speculation of `source`."""
        ema = {Source.NEURAL: self.e_neural, Source.FAST: self.e_fast}.get(source, self.e_hit)
        ema.update(tokens)

    def observe_reply(self, hits: int, batch: int, build_ratio: float, wait_ratio: float) -> None:
        """A drafter's reply: `hits` of `batch` rows hit, its build took build_ratio
        verifications, and the target waited wait_ratio verifications for it."""
        self.build_ratio.update(build_ratio)
        self.p_hit.update(hits / max(batch, 1))
        if hits == batch:
            self.t_primary.update(1.0 + wait_ratio)
        elif self.last == "neural":
            self.t_neural.update(wait_ratio, PROBE_WEIGHT if self._probing else None)
            self._probing, self._fast_served = False, 0

    def observe_fast(self, ratio: float) -> None:
        """The fast backup filled a round's misses in `ratio` verifications."""
        self.t_fast.update(ratio)
        self._fast_served += 1

    def live(self, fixed_build_share: float | None) -> tuple[float, ...]:
        """(p_hit, e_hit, e_neural, t_neural, e_fast, t_fast, t_primary) for Theorem 17.

        A backup's figures only move while it is in use, so an unused neural backup keeps
        stand-ins from what the drafter shows every round: a just-in-time draft comes from the
        same model and state as a cached one (it earns about E_hit), and costs about one cache
        build at B = 1 (fixed_build_share: the budget sizer's fixed share, when it has one;
        else the measured build ratio)."""
        guess = fixed_build_share if fixed_build_share is not None else self.build_ratio.or_else(self.t_neural.value)
        return (
            self.p_hit.value,
            self.e_hit.value,
            self.e_neural.or_else(self.e_hit.value),
            self.t_neural.or_else(max(guess, 0.0)),
            self.e_fast.value,
            self.t_fast.value,
            self.t_primary.value,
        )

    def stats(self, fixed_build_share: float | None) -> dict:
        return {
            "b_star": backup_threshold(*self.live(fixed_build_share)),
            "tokens_per_round_on_hit": round(self.e_hit.value, 4),
            "backup": self.last,
            "p_hit": round(self.p_hit.value, 4),
            "T_primary": round(self.t_primary.value, 4),
            "T_neural": round(self.t_neural.value, 4),
        }
