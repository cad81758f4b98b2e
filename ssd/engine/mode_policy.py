"""Which mode each round runs in, and what a mode needs around it: its proposer, its threads, and
in mode auto the switches between modes.

A fixed mode (ar, sd, ssd) runs every round in itself. Mode auto asks its ModeChooser
(autopilot.py: the measurements, the estimates, when to probe) for each round's mode and does
what a switch takes: the proposer of the mode left is detached (SSD's drafters let go of the
batch, the SD draft defers the prefill of new rows: work nothing reads until that mode returns),
the proposer of the mode entered rejoins with the running batch (Proposer.detach / rejoin). So
a proposer is detached exactly while its mode is not the current one.

The split of SSD's pool (draft_split auto, split_policy.py) is chosen the same way, before
each SSD round, by the policy's SplitChoice: a change of split is a detach, a resplit and a
rejoin, folded into auto's own rejoin when auto enters ssd.

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
from ssd.engine.split_policy import SplitChoice


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

    def __init__(
        self, mode: str, proposers: dict[str, Proposer], threads: dict[str, int], splitter: SplitChoice | None = None
    ) -> None:
        self.proposers = proposers
        self.current = RoundMode(mode, proposers.get(mode))
        self.threads = threads
        self.splitter = splitter  # chooses the SSD pool's split (draft_split auto); None: it is fixed
        self._threads_before = torch.get_num_threads()
        self._use_threads()

    def choose(self, seqs: list[Sequence]) -> RoundMode:
        """The next round's mode for the running batch `seqs`."""
        if self.splitter is not None:  # a fixed mode with a splitter is ssd (mode_policy)
            greedy = all(s.params.greedy for s in seqs)
            if self.splitter.apply(self.current.proposer, seqs, greedy, detached=False):
                self.current.proposer.rejoin(seqs)
            self.current = RoundMode(self.current.name, self.current.proposer, greedy)
        self._use_threads()
        return self.current

    def record(self, batch: int, seconds: float, tokens: int) -> None:
        """What the round just run did: its batch's rows, wall time and the tokens it committed."""
        if self.splitter is not None and self.current.name == "ssd":
            self.splitter.record(batch, seconds, tokens, self.current.greedy)

    def stats(self, batch: int) -> dict:
        """The policy's figures for the engine's metrics ({}: none)."""
        if self.splitter is None:
            return {}
        return {"draft_split": self.splitter.stats(max(1, batch), self.current.greedy)}

    def _resplit(self, seqs: list[Sequence], mode: RoundMode, greedy: bool, detached: bool) -> bool:
        """Before a round of `mode`: an SSD round's split, as the splitter chooses it. detached:
        whether mode's proposer is detached now; returns whether it is after (then the caller
        rejoins it)."""
        if self.splitter is None or mode.name != "ssd":
            return detached
        return self.splitter.apply(mode.proposer, seqs, greedy, detached)

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

    def __init__(
        self,
        config: EngineConfig,
        proposers: dict[str, Proposer],
        threads: dict[str, int],
        splitter: SplitChoice | None = None,
    ) -> None:
        self.chooser = ModeChooser(AUTO_MODES, config.auto_explore_every, config.auto_probe_rounds)
        super().__init__(AUTO_MODES[0], proposers, threads, splitter)
        for name, proposer in proposers.items():
            if name != self.current.name:
                proposer.detach()

    def choose(self, seqs: list[Sequence]) -> RoundMode:
        # Greedy and sampled batches are judged apart: SSD's hit rate differs most between them.
        greedy = all(s.params.greedy for s in seqs)
        name = self.chooser.choose(len(seqs), greedy)
        mode = RoundMode(name, self.proposers.get(name), greedy)
        switched = mode.name != self.current.name
        if switched and self.current.proposer is not None:
            self.current.proposer.detach()
        if self._resplit(seqs, mode, greedy, detached=switched) and mode.proposer is not None:
            mode.proposer.rejoin(seqs)
        self.current = mode
        self._use_threads()
        return self.current

    def record(self, batch: int, seconds: float, tokens: int) -> None:
        self.chooser.record(self.current.name, batch, seconds, tokens, self.current.greedy)
        super().record(batch, seconds, tokens)

    def stats(self, batch: int) -> dict:
        return {"auto": self.chooser.stats(max(1, batch), self.current.greedy), **super().stats(batch)}


def mode_policy(config: EngineConfig, proposers: dict[str, Proposer], threads: dict[str, int]) -> ModePolicy:
    """The policy of config.mode: auto's, or a fixed mode's; with a SplitChoice when the SSD
    proposer's pool can be split more than one way and draft_split is auto."""
    ssd = proposers.get("ssd")
    splits = ssd.splits() if ssd is not None and config.draft_split == "auto" else ()
    splitter = SplitChoice(splits, config.auto_explore_every, config.auto_probe_rounds) if len(splits) > 1 else None
    if config.mode == "auto":
        return AutoMode(config, proposers, threads, splitter)
    return ModePolicy(config.mode, proposers, threads, splitter)
