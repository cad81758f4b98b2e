"""Saguaro's backup by batch size (Theorem 17), from live figures: which backup speculates for the
rows that miss, the neural one (the draft, just in time) or the fast one (n-gram lookup).

Glossary (each an exponential moving average over rounds):
    p_hit                  the share of rows that hit
    e_hit                  tokens per round of a row served by the cache
    r_neural, r_fast       tokens per round of a row served by each backup, over e_hit at the time
    t_primary              a round's time when every row hit, relative to its verification
    t_neural, t_fast       what each backup adds to a round, relative to its verification
    build_ratio            the drafter's cache build time over the verification it overlaps

What a speculation yields depends on the row: greedy rows hit and accept far more than sampled
ones (demo pair, batch 1: p_hit 0.9 against 0.5, e_hit 6.0 against 4.8), and a server's batches
mix them in changing proportions. So p_hit, e_hit and the yields are kept per class of row
(`Yields`: greedy, sampled) and a round's figures combine its rows' (all of them hit with the
product of their p_hit). A backup's yields move only while it serves, so they are kept relative
to e_hit, which every hit moves. (Kept for all rows alike and absolute, the figures of the greedy
requests a bench runs first held the choice on the fast backup through the sampled ones after.)
The costs (t_*) are the drafter's and the target's, whatever the rows sample: one of each.
"""

from __future__ import annotations

import math

from ssd.core.speculation import Source
from ssd.drafting.saguaro import backup_speedups, backup_threshold

PRIOR_COUNT = 4  # the observations a prior is worth


class Ema:
    """Exponential moving average of observations. A prior stands in for PRIOR_COUNT of them
    (none without a prior): the value is the plain mean of prior and observations until their
    count reaches 1/weight, then each observation moves it by `weight`. So neither one early
    observation (a first round's cold kernels, a first row's luck) nor a prior outweighs what
    follows."""

    def __init__(self, prior: float | None, weight: float = 0.05) -> None:
        self.value, self.weight, self.count = (prior or 0.0), weight, 0
        self._prior_count = 0 if prior is None else PRIOR_COUNT

    @property
    def observed(self) -> bool:
        return self.count > 0

    def update(self, x: float, weight: float | None = None) -> None:
        """Move toward x by `weight` (default: the average's own), or more while few were seen."""
        self.count += 1
        self.value += max(weight or self.weight, 1.0 / (self.count + self._prior_count)) * (x - self.value)

    def or_else(self, fallback: float) -> float:
        return self.value if self.observed else fallback


# While the fast backup is chosen the neural one's cost is not measured, so one slow stretch (on
# a shared VM, the worker's core taken for a while) could keep the choice on fast for good: after
# the fast backup served the misses of PROBE_EVERY rounds, the neural one serves the next round
# with misses, and that measurement moves its estimate PROBE_WEIGHT of the way. (Demo pair, batch
# 1, T=1: runs whose choice turned fast after such a stretch stayed there for hundreds of rounds,
# 12-20% slower.) Before that, the neural backup serves the misses of the first FIRST_MEASURES
# rounds that have any: its cost is measured, not guessed, before the choice relies on it.
PROBE_EVERY = 32
PROBE_WEIGHT = 0.5
FIRST_MEASURES = 3

# The backups' relative yields average over 1 / YIELD_WEIGHT = 50 of their rounds. A round yields
# 1 to K + 1 tokens, so over 20 (weight 0.05) the neural backup's estimate wandered ~8% from its
# mean; and while one backup serves, the other's yield is not measured, so a low draw of it lasts
# until that backup serves again. The choice then moves to the other backup only when its model
# is ahead by SWITCH_MARGIN, about what the remaining noise moves it. In a simulation of the demo
# pair's T=1 figures at batch 1 (the neural backup's model 8% ahead; ten seeds), weight 0.05 and
# no margin sent 4-71% of the misses to the fast backup, this weight 1-14%, with the margin 0.5-4%.
YIELD_WEIGHT = 0.02
SWITCH_MARGIN = 0.03


class Yields:
    """p_hit, e_hit and the backups' relative yields of one class of rows (greedy or sampled)."""

    def __init__(self) -> None:
        self.p_hit, self.e_hit = Ema(0.7), Ema(3.0)
        self.r_neural, self.r_fast = Ema(0.9, YIELD_WEIGHT), Ema(0.3, YIELD_WEIGHT)


class BackupChoice:
    """The live figures of Theorem 17 and the choice they make. `mode` is the configured backup:
    "auto" chooses by batch size, "neural" and "fast" are fixed. Rows are named by whether they
    are greedy (greedy [b] bool, in the batch's order)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.last = mode if mode != "auto" else "neural"  # the backup of the round being resolved
        self.yields = {True: Yields(), False: Yields()}  # by greedy
        self.t_primary, self.t_neural, self.t_fast = Ema(1.0), Ema(0.5), Ema(0.01)
        self.build_ratio = Ema(None, weight=0.1)
        self._greedy: list[bool] = [False]  # the rows of the latest round (what stats describe)
        self._fast_served = 0  # rounds whose misses the fast backup served since neural last did
        self._fast_ahead = False  # whether the model put the fast backup ahead (by the margin, to change)
        self._probing = False  # the neural backup serves misses until its cost is measured again

    def choose(self, greedy: list[bool], fixed_build_share: float | None) -> str:
        """The backup for the misses of a round of these rows (also kept as `last`): the one the
        model puts ahead, changed only by SWITCH_MARGIN, or the neural one while it is probed."""
        self._greedy = list(greedy)
        if self.mode == "auto":
            neural, fast_speedup = backup_speedups(len(greedy), *self.live(greedy, fixed_build_share))
            other, current = (neural, fast_speedup) if self._fast_ahead else (fast_speedup, neural)
            self._fast_ahead ^= other > current * (1 + SWITCH_MARGIN)
            fast = self._fast_ahead
            due = self._fast_served >= PROBE_EVERY or self.t_neural.count < FIRST_MEASURES
            self._probing = fast and (self._probing or due)
            self.last = "fast" if fast and not self._probing else "neural"
        return self.last

    def observe_tokens(self, source: Source, tokens: int, greedy: bool) -> None:
        """A row's round emitted `tokens` (accepted + bonus) from a speculation of `source`."""
        y = self.yields[greedy]
        relative = {Source.NEURAL: y.r_neural, Source.FAST: y.r_fast}.get(source)
        if relative is None:
            y.e_hit.update(tokens)
        else:
            relative.update(tokens / max(y.e_hit.value, 1.0))

    def observe_reply(self, hit: list[bool], greedy: list[bool], build_ratio: float, wait_ratio: float) -> None:
        """A drafter's reply: which rows hit (hit [b] bool), its build took build_ratio
        verifications, and the target waited wait_ratio verifications for it."""
        self.build_ratio.update(build_ratio)
        for g in set(greedy):
            rows = [h for h, r in zip(hit, greedy) if r == g]
            self.yields[g].p_hit.update(sum(rows) / len(rows))
        if all(hit):
            self.t_primary.update(1.0 + wait_ratio)
        elif self.last == "neural":
            self.t_neural.update(wait_ratio, PROBE_WEIGHT if self._probing else None)
            self._probing, self._fast_served = False, 0

    def observe_fast(self, ratio: float) -> None:
        """The fast backup filled a round's misses in `ratio` verifications."""
        self.t_fast.update(ratio)
        self._fast_served += 1

    def live(self, greedy: list[bool], fixed_build_share: float | None) -> tuple[float, ...]:
        """(p_hit, e_hit, e_neural, t_neural, e_fast, t_fast, t_primary) for Theorem 17 at a
        round of these rows: p_hit is the geometric mean of theirs (p_hit ** b is the chance that
        all of them hit), the yields are their means.

        Until the neural backup's cost has been measured, it stands in from what the drafter
        shows every round: a just-in-time draft costs about one cache build at B = 1
        (fixed_build_share: the budget sizer's fixed share, when it has one; else the measured
        build ratio). The choice itself waits for FIRST_MEASURES measurements."""
        b, rows = max(len(greedy), 1), [self.yields[g] for g in greedy] or [self.yields[False]]
        # The geometric mean through logs: a product of thousands of rates underflows.
        p_hit = math.exp(sum(math.log(max(y.p_hit.value, 1e-12)) for y in rows) / b)
        e_hit = sum(y.e_hit.value for y in rows) / b
        e_neural = sum(y.e_hit.value * y.r_neural.value for y in rows) / b
        e_fast = sum(y.e_hit.value * y.r_fast.value for y in rows) / b
        guess = fixed_build_share if fixed_build_share is not None else self.build_ratio.or_else(self.t_neural.value)
        t_neural = self.t_neural.or_else(max(guess, 0.0))
        return p_hit, e_hit, e_neural, t_neural, e_fast, self.t_fast.value, self.t_primary.value

    def stats(self, fixed_build_share: float | None) -> dict:
        """The figures at the latest round's rows (b_star: at a batch of rows like them)."""
        live = self.live(self._greedy, fixed_build_share)
        return {
            "b_star": backup_threshold(*live),
            "tokens_per_round_on_hit": round(live[1], 4),
            "backup": self.last,
            "p_hit": round(live[0], 4),
            "T_primary": round(self.t_primary.value, 4),
            "T_neural": round(self.t_neural.value, 4),
        }
