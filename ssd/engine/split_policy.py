"""draft_split auto: each SSD round's split of the pool's work (outcomes or sequences), whichever
gives the most tokens per second at the batch's size now, judged from this engine's own rounds.

Why measured, not derived: splitting the outcomes makes every worker build a shard of every
row's tree, so the union covers D x ssd_budget branches and more outcomes hit, but each worker's
build grows with the batch; splitting the sequences gives each worker b / D rows with whole trees
of ssd_budget branches, a smaller build that the hit rate of one worker pays for. Which wins
depends on the batch, the pair's acceptance, the temperature and how the workers' hardware
compares with the target's: the same terms auto's modes depend on, so the same chooser
(autopilot.ModeChooser) judges them, over the splits instead of the modes, per batch-size bucket
and regime (greedy or sampled).

What a switch costs: the proposer detaches (its drafters release the batch), the pool sends each
live worker its new place (JOIN), and the proposer rejoins (the drafters admit the batch again
with every committed token): the same as auto's return to ssd, so the chooser skips the same
rounds after it. A switch happens only between rounds, and only in SSD rounds: when auto enters
ssd, the split is put in place before the rejoin, at no extra cost. Every split is exact.
"""

from __future__ import annotations

from ssd.core.proposer import Proposer
from ssd.core.sequence import Sequence
from ssd.engine.autopilot import ModeChooser


class SplitChoice:
    """Chooses an SSD proposer's split before each of its rounds (apply) and learns from what the
    round did (record)."""

    def __init__(self, splits: tuple[str, ...], explore_every: int, probe_rounds: int) -> None:
        assert len(splits) > 1, splits
        # Every split re-admits the batch when entered; none is steady (tokens per round vary).
        self.chooser = ModeChooser(splits, explore_every, probe_rounds, steady=(), rebuilt=splits)

    def apply(self, proposer: Proposer, seqs: list[Sequence], greedy: bool, detached: bool) -> bool:
        """Put `proposer` (about to run a round for `seqs`) in the chosen split. detached: whether
        it is detached now. Returns whether it is detached after (its caller then rejoins it)."""
        split = self.chooser.choose(len(seqs), greedy)
        if split == proposer.splits()[0]:
            return detached
        if not detached:
            proposer.detach()
        proposer.resplit(split)
        return True

    def record(self, batch: int, seconds: float, tokens: int, greedy: bool) -> None:
        """What the SSD round just run (in the split apply() chose) did."""
        self.chooser.record(self.chooser.current, batch, seconds, tokens, greedy)

    def stats(self, batch: int, greedy: bool) -> dict:
        """The split in use, its switches, and per split its totals and estimate at this batch."""
        figures = self.chooser.stats(batch, greedy)
        return {"split": figures["mode"], "switches": figures["switches"], "splits": figures["modes"]}
