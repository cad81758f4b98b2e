"""Mode `auto`: each round, the decoding mode (ssd, sd or ar) that gives the most tokens per
second now, judged from this engine's own measurements.

What is measured: for each mode and bucket, moving averages of a round's wall time and of the
tokens it committed (every row's accepted tokens plus its bonus token). A bucket is a batch-size
bucket (1, 2, 3-4, 5-8, ...) in one of two regimes, greedy (every row at temperature 0) or
sampled: SSD's hit rate and the acceptance differ most between the two (at batch 1 on the demo
pair, hits 0.86 greedy and 0.52 sampled), so a server whose traffic moves between them would
otherwise judge one by rounds of the other. The ratio is the mode's tokens per second in that
bucket: it holds every term of Theorem 7 and of the SD round it competes with (hit rate,
acceptance, draft and verify times, the batch's all-rows-hit condition) as they are on this
hardware now, without a model of them.

Granularity: a round, for the whole batch (one target forward serves every row, so a round has
one mode). Switching is lossless because every mode is exact. What a switch costs: into sd,
nothing but one draft forward over the tokens the draft's cache missed (SDProposer catches up);
into ar, nothing; out of ssd, the draft workers drop the batch (SSDProposer.detach: they do no
work while other modes run), and into ssd they admit it again with the committed tokens
(SSDProposer.rejoin), so its first rounds have no cache to hit. So the first `warmup` rounds
after a switch (one more for ssd) are counted in the totals but not in the estimates, and a
switch needs the other mode to be better by `margin`. The mode in use updates its estimate
every round over a long window (`weight`; until the estimate holds 1/weight rounds, their plain
mean); a probe moves its mode's estimate `probe_weight` of the way to the probe's mean (less
its interrupted rounds, slower than `outlier` x its median: a probe is short, and one such
round would decide it), but replaces a mode's first estimate, which a cold engine measured
(workers just spawned, kernels used for the first time).

Exploration, bounded: every mode is probed once at the start (`probe_rounds` measured rounds
each; ar only `steady_probe_rounds`: its tokens per round are the batch size, so only its round
time needs averaging, and that varies little); then each other mode is probed again, the one
measured longest ago first, after `first_period` rounds, then twice as late each time up to every
`explore_every` rounds, so an estimate that went stale is measured again; a mode far behind the
one in use (below `far` x), only every `far_every`-th time. A bucket not measured in every mode
is judged by the nearest one that is, and probed once the batch has stayed in it for
`settle_rounds`: only in the modes not far behind the best at the judging bucket. The others
are left to the explorations that probe far modes (a served batch wanders over several buckets,
and probing every mode in each new one was most of what auto lost to the best mode,
docs/serving.md). The nearest bucket is one of the same regime where there is one, else the
other regime's nearest in size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

AUTO_MODES = ("ssd", "sd", "ar")  # the modes auto chooses among


def bucket_of(batch: int) -> int:
    """The batch-size bucket: the smallest power of two >= batch (1, 2, 4, 8, ...)."""
    return 1 << max(0, batch - 1).bit_length()


Bucket = tuple[bool, int]  # (greedy: every row at temperature 0, bucket_of(batch))


def _distance(a: Bucket, b: Bucket) -> tuple[bool, int, int]:
    """How far bucket b is from a when b judges a: another regime is farther than any size."""
    return a[0] != b[0], abs(a[1].bit_length() - b[1].bit_length()), b[1]


@dataclass
class _Estimate:
    """Moving averages of one (mode, bucket): seconds and tokens per round."""

    seconds: float
    tokens: float
    measured_at: int  # the chooser's round count at the last measurement
    rounds: int = 1  # measured into it: until 1/weight, each round has the same weight (a plain mean)
    # Made by the mode's first probe since the engine started: it paid one-time costs (workers
    # just spawned, kernels used for the first time), so the next probe replaces it.
    cold: bool = False

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


@dataclass
class _Totals:
    rounds: int = 0
    tokens: int = 0
    seconds: float = 0.0


@dataclass
class ModeChooser:
    """Chooses each round's mode (choose) and learns from what the round did (record)."""

    modes: tuple[str, ...] = AUTO_MODES
    explore_every: int = 512
    probe_rounds: int = 12
    steady_probe_rounds: int = 4  # of a probe of a `steady` mode (at most probe_rounds)
    # Modes whose tokens per round are the batch size (ar): a probe only needs to average their
    # round time, which varies little.
    steady: tuple[str, ...] = ("ar",)
    # Modes whose drafters re-admit the batch when entered (ssd): the second round after a switch
    # may still miss, as the drafters prefilled during the first and may not have a tree for it.
    rebuilt: tuple[str, ...] = ("ssd",)
    warmup: int = 1
    margin: float = 0.05
    # Of a new round in the moving averages of the mode in use: SSD's rounds are bimodal (a hit
    # costs little, a miss a backup round; at batch 1 each new request starts with a miss), so the
    # window is long (~1/weight rounds). A probe instead moves its mode's estimate half way to
    # what the probe measured.
    weight: float = 1 / 128
    probe_weight: float = 0.5
    first_period: int = 64  # early estimates come from a cold start (new workers, first batches)
    far: float = 0.7  # a mode below far x the one in use is probed every far_every-th exploration
    far_every: int = 4
    settle_rounds: int = 16  # rounds at a bucket not measured in every mode before it is probed
    # A probe's round slower than this many times the probe's median round was interrupted (the
    # OS, a collector, a neighbour process): one 200 ms round among twelve of 30 ms made sd look
    # far behind at batch 8, and a far mode is seldom probed again. A round that admits a new
    # request at batch 1 (the drafters' prefill, SSD's miss) stays under it: ~4x at most.
    outlier: float = 5.0
    current: str = ""
    switches: int = 0
    rounds: int = 0
    _since_switch: int = 0  # rounds in the current mode (the first `warmup` are not measured)
    _since_explore: int = 0
    _period: int = 0  # rounds between explorations: first_period, doubling up to explore_every
    _explorations: int = 0
    _unjudged: dict[Bucket, int] = field(default_factory=dict)  # bucket -> rounds chosen from another's
    _probe_left: int = 0  # measured rounds the current probe still needs (0: not probing)
    _probe: list[tuple[float, int]] = field(default_factory=list)  # the probe's rounds so far: seconds, tokens
    _probes: list[str] = field(default_factory=list)  # modes still to probe, in order
    _estimates: dict[tuple[str, Bucket], _Estimate] = field(default_factory=dict)
    # (mode, bucket) not probed when the bucket settled: the mode was far behind where it was judged.
    _skipped: set[tuple[str, Bucket]] = field(default_factory=set)
    _totals: dict[str, _Totals] = field(default_factory=dict)
    _warm: set[str] = field(default_factory=set)  # modes probed since the engine started

    def __post_init__(self) -> None:
        self.current = self.current or self.modes[0]
        self._totals = {m: _Totals() for m in self.modes}
        self._period = min(self.first_period, self.explore_every)

    def choose(self, batch: int, greedy: bool = False) -> str:
        """The mode of the next round for a batch of `batch` rows (`greedy`: all at temperature 0)."""
        bucket = (greedy, bucket_of(batch))
        if self._probe_left > 0:
            return self.current
        if self._probes:
            return self._switch(self._probes.pop(0), probe=True)
        if self._since_explore >= self._period:
            return self._explore(bucket)
        judged_at = self._judged_at(bucket)
        if judged_at != bucket:
            # A cold start, or a bucket the batch stayed in: measure its unmeasured modes.
            self._unjudged[bucket] = self._unjudged.get(bucket, 0) + 1
            if judged_at is None or self._unjudged[bucket] > self.settle_rounds:
                return self._settle(bucket, judged_at)
        return self._switch(self._best(judged_at), probe=False)

    def _settle(self, bucket: Bucket, judged_at: Bucket | None) -> str:
        """Probe the modes not measured at this bucket, but for those far behind the best at the
        bucket that judged it so far (none at a cold start): they count as measured there, far
        behind, until an exploration that probes far modes measures them."""
        unmeasured = [m for m in self.modes if (m, bucket) not in self._estimates]
        if judged_at is not None:  # a mode skipped at the judging bucket is far behind here too
            rates = {m: e.tokens_per_second for m in self.modes if (e := self._estimates.get((m, judged_at)))}
            best = max(rates.values())
            far = {m for m in unmeasured if rates.get(m, 0.0) < self.far * best}
            self._skipped |= {(m, bucket) for m in far}
            unmeasured = [m for m in unmeasured if m not in far]
        if not unmeasured:  # every mode left unmeasured here is far behind: the bucket is judged
            return self._switch(self._best(bucket), probe=False)
        self._probes = unmeasured[1:]
        return self._switch(unmeasured[0], probe=True)

    def _explore(self, bucket: Bucket) -> str:
        """Probe the other modes at this bucket, the unmeasured first, then the one measured
        longest ago; a mode far behind (below `far` x the mode in use) only every `far_every`-th
        exploration, as its probe costs the most and is least likely to change the choice. The
        next exploration comes twice as late, up to explore_every."""
        self._explorations += 1
        est = {m: self._estimates.get((m, bucket)) for m in self.modes}
        now = est[self.current].tokens_per_second if est[self.current] is not None else 0.0
        due = self._explorations % self.far_every == 0

        def worth(m: str) -> bool:
            if est[m] is None:
                return due or (m, bucket) not in self._skipped
            return est[m].cold or due or est[m].tokens_per_second >= self.far * now

        others = [m for m in self.modes if m != self.current and worth(m)]
        self._probes = sorted(others, key=lambda m: -1 if est[m] is None else est[m].measured_at)
        self._since_explore, self._period = 0, min(2 * self._period, self.explore_every)
        if not self._probes:
            return self.current
        return self._switch(self._probes.pop(0), probe=True)

    def _judged_at(self, bucket: Bucket) -> Bucket | None:
        """The bucket whose estimates judge this one: itself when every mode was measured there,
        else the nearest such bucket (a batch that shrinks as its requests finish passes through
        buckets briefly: they are measured when an exploration finds them); None: none yet."""
        known = self._estimates.keys() | self._skipped
        complete = {b for (_, b) in self._estimates if all((m, b) in known for m in self.modes)}
        if not complete:
            return None
        return min(complete, key=lambda b: _distance(bucket, b))

    def record(self, mode: str, batch: int, seconds: float, tokens: int, greedy: bool = False) -> None:
        """What one round in `mode` (the one choose() returned for this batch) did: its wall time
        and the tokens it committed."""
        self.rounds += 1
        self._since_switch += 1
        self._since_explore += 1
        total = self._totals[mode]
        total.rounds, total.tokens, total.seconds = total.rounds + 1, total.tokens + tokens, total.seconds + seconds
        warmup = self.warmup + (mode in self.rebuilt)
        if self._since_switch <= warmup:
            return  # a switch's first rounds pay for the switch: not what the mode costs per round
        key = (mode, (greedy, bucket_of(batch)))
        if self._probe_left > 0:
            self._probe_left -= 1
            self._probe.append((seconds, tokens))
            if self._probe_left == 0:  # the probe's mean per round: new, replacing a cold one, or blended in
                s, t = self._probe_mean()
                old, n = self._estimates.get(key), len(self._probe)
                if old is None or old.cold:
                    self._estimates[key] = _Estimate(s, t, self.rounds, n, cold=mode not in self._warm)
                    self._warm.add(mode)
                else:
                    self._update(key, s, t, self.probe_weight, n)
            return
        self._update(key, seconds, tokens, self.weight)

    def _probe_mean(self) -> tuple[float, float]:
        """The probe's seconds and tokens per round, over its rounds less the interrupted ones
        (slower than `outlier` x its median round)."""
        times = sorted(seconds for seconds, _ in self._probe)
        limit = self.outlier * times[len(times) // 2]
        kept = [(seconds, tokens) for seconds, tokens in self._probe if seconds <= limit]
        return sum(s for s, _ in kept) / len(kept), sum(t for _, t in kept) / len(kept)

    def _update(self, key: tuple[str, Bucket], seconds: float, tokens: float, weight: float, rounds: int = 1) -> None:
        """Move the estimate `weight` of the way to a measurement of `rounds` rounds, or more while
        the estimate holds few rounds: a mode in use at a new bucket starts its estimate there
        with one round, which must not count for 1/weight rounds."""
        old = self._estimates.get(key)
        if old is None:
            self._estimates[key] = _Estimate(seconds, tokens, self.rounds, rounds)
            return
        w = max(weight, rounds / (old.rounds + rounds))
        old.rounds += rounds
        old.seconds, old.tokens = (1 - w) * old.seconds + w * seconds, (1 - w) * old.tokens + w * tokens
        old.measured_at, old.cold = self.rounds, False

    def _best(self, bucket: Bucket) -> str:
        """The mode to run at a complete bucket (a mode skipped there is not a candidate)."""
        rates = {m: e.tokens_per_second for m in self.modes if (e := self._estimates.get((m, bucket))) is not None}
        best = max(rates, key=rates.get)
        # Stay unless the best is better by the margin: a switch into ssd costs a rebuild.
        if self.current not in rates:
            return best
        return best if rates[best] > rates[self.current] * (1 + self.margin) else self.current

    def _switch(self, mode: str, probe: bool) -> str:
        if mode != self.current:
            self.current, self._since_switch = mode, 0
            self.switches += 1
        if probe:
            rounds = min(self.probe_rounds, self.steady_probe_rounds) if mode in self.steady else self.probe_rounds
            self._probe_left, self._probe = rounds, []
        return mode

    def stats(self, batch: int, greedy: bool = False) -> dict:
        """The live figures: the mode in use, switches, and per mode its totals and its estimate
        in the bucket of `batch` rows, greedy or not (tokens per second; None = not measured there
        yet)."""
        bucket = (greedy, bucket_of(batch))
        per_mode = {}
        for m in self.modes:
            est, total = self._estimates.get((m, bucket)), self._totals[m]
            per_mode[m] = {
                "rounds": total.rounds,
                "tokens": total.tokens,
                "seconds": round(total.seconds, 6),
                "estimated_tokens_per_second": None if est is None else round(est.tokens_per_second, 2),
            }
        return {
            "mode": self.current,
            "switches": self.switches,
            "bucket": bucket[1],
            "greedy": greedy,
            "modes": per_mode,
        }
