"""Which mode each round runs in, and what a mode needs around it: its proposer, its threads, and
in mode auto the switches between modes.

A fixed mode (ar, sd, ssd) runs every round in itself. Mode auto asks its ModeChooser
(autopilot.py: the measurements, the estimates, when to probe) for each round's mode and does
what a switch takes: the proposer of the mode left is detached (SSD's drafters let go of the
batch, the SD draft defers the prefill of new rows: work nothing reads until that mode returns),
the proposer of the mode entered rejoins with the running batch (Proposer.detach / rejoin). So
a proposer is detached exactly while its mode is not the current one.

Threads: where SSD's draft workers share this host's cores, an SSD round leaves them the cores
their threads use and the other modes take the process's threads (proposers.round_threads);
they are set every round, as the thread that steps may not be the one that built the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ssd.core.config import EngineConfig
from ssd.core.proposer import Proposer
from ssd.core.sequence import Sequence
from ssd.engine.autopilot import AUTO_MODES, ModeChooser


@dataclass(frozen=True)
class RoundMode:
    """The mode a round runs in, as the policy chose it."""

    name: str  # ar, sd or ssd
    proposer: Proposer | None  # None: ar (K = 0, the bonus token is the next token)
    greedy: bool = False  # mode auto: every row at temperature 0 (it judges the two regimes apart)


class ModePolicy:
    """Every round in one mode (a fixed mode; AutoMode changes it round by round). threads: mode
    -> this process's torch threads in its rounds ({}: left as they are); the process's threads
    before are put back at close()."""

    chooser: ModeChooser | None = None

    def __init__(self, mode: str, proposers: dict[str, Proposer], threads: dict[str, int]) -> None:
        self.proposers = proposers
        self.current = RoundMode(mode, proposers.get(mode))
        self.threads = threads
        self._threads_before = torch.get_num_threads()
        self._use_threads()

    def choose(self, seqs: list[Sequence]) -> RoundMode:
        """The next round's mode for the running batch `seqs`."""
        self._use_threads()
        return self.current

    def record(self, batch: int, seconds: float, tokens: int) -> None:
        """What the round just run did: its batch's rows, wall time and the tokens it committed."""

    def stats(self, batch: int) -> dict:
        """The policy's figures for the engine's metrics ({}: none)."""
        return {}

    def close(self) -> None:
        if self.threads:  # the process's threads, as they were before this engine changed them
            torch.set_num_threads(self._threads_before)

    def _use_threads(self) -> None:
        threads = self.threads.get(self.current.name)
        if threads is not None and threads != torch.get_num_threads():
            torch.set_num_threads(threads)


class AutoMode(ModePolicy):
    """Each round in the mode its chooser expects the most tokens per second from; the chooser is
    replaceable (tests force modes by setting one with fewer modes)."""

    def __init__(self, config: EngineConfig, proposers: dict[str, Proposer], threads: dict[str, int]) -> None:
        self.chooser = ModeChooser(AUTO_MODES, config.auto_explore_every, config.auto_probe_rounds)
        super().__init__(AUTO_MODES[0], proposers, threads)
        for name, proposer in proposers.items():
            if name != self.current.name:
                proposer.detach()

    def choose(self, seqs: list[Sequence]) -> RoundMode:
        # Greedy and sampled batches are judged apart: SSD's hit rate differs most between them.
        greedy = all(s.params.temperature == 0 for s in seqs)
        mode = self.chooser.choose(len(seqs), greedy)
        left, entered = self.current.proposer, self.proposers.get(mode)
        if mode != self.current.name:
            if left is not None:
                left.detach()
            if entered is not None:
                entered.rejoin(seqs)
        self.current = RoundMode(mode, entered, greedy)
        self._use_threads()
        return self.current

    def record(self, batch: int, seconds: float, tokens: int) -> None:
        self.chooser.record(self.current.name, batch, seconds, tokens, self.current.greedy)

    def stats(self, batch: int) -> dict:
        return {"auto": self.chooser.stats(max(1, batch), self.current.greedy)}


def mode_policy(config: EngineConfig, proposers: dict[str, Proposer], threads: dict[str, int]) -> ModePolicy:
    """The policy of config.mode: auto's, or a fixed mode's."""
    if config.mode == "auto":
        return AutoMode(config, proposers, threads)
    return ModePolicy(config.mode, proposers, threads)
