"""The SSD drafter's neural backup: speculations drafted just in time for the rows that no cached
branch serves (a NEURAL_BACKUP, or a RESOLVE that asks for its misses), and a new request's first
one drafted at its admission, while the target prefills it.

Just in time: ordinary SD drafting (SDProposer) on the drafter's own cache. The batch forward
covers every row, but only the rows in need draw from their own generators (the others draw
from a scratch one and their drafts are discarded), so a seeded sequence's draws do not depend
on which other sequences missed.

Early: a new row's first round has nothing cached, so the target's neural backup asks for its
speculation just in time (NEURAL_BACKUP) after its own prefill and waits K draft steps for it. A
drafter that holds no other rows has nothing to do during that prefill (the target sends ADMIT
before it: ssd/engine/scheduler.py), so it drafts the speculation at admission: the same call
NEURAL_BACKUP would make, on the same cache, state and generators, hence the same tokens and
probabilities. A NEURAL_BACKUP for exactly those rows is served from it. Anything else that comes
first (BEGIN_ROUND after the fast backup speculated, another ADMIT, a RELEASE, a NEURAL_BACKUP for
other rows) takes it back: the rows' generators return to their states from before it, so what a
request samples never depends on whether it was drafted early (as with predicted rounds,
ssd/worker/session.py). (Demo pair, batch 1, CPU: the wait was about 7 ms of a request's first
round.) A drafter in the engine's own thread (draft_transport="inprocess") drafts it at
admission too, before the prefill rather than beside it: the same work, earlier.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ssd.core.sampling import BatchSampling, SequenceSampling
from ssd.core.speculation import Speculation
from ssd.drafting.draft_grammars import DraftGrammars
from ssd.drafting.sd_proposer import SDProposer
from ssd.drafting.tree_adjustments import DraftView, first_position, processes


@dataclass
class SeqState:
    """One sequence as a drafter holds it."""

    tokens: list[int]  # committed tokens (prompt + output) as the drafter knows them
    generator: torch.Generator
    sampling: SequenceSampling


@dataclass
class EarlyDraft:
    seq_ids: list[int]  # the rows, in the order the drafter holds them
    spec: Speculation  # their speculations [b, K], on the host
    generators: list[torch.Tensor]  # each row's generator state from before it was drafted

    def serves(self, seq_ids: list[int], need: list[bool]) -> bool:
        """Whether it is what a NEURAL_BACKUP for these rows asks for (every row, in this order)."""
        return self.seq_ids == list(seq_ids) and all(need)

    def take_back(self, generators: dict[int, torch.Generator]) -> None:
        """Put the generators of the rows still held (seq id -> generator) back as they were."""
        for seq_id, state in zip(self.seq_ids, self.generators):
            if seq_id in generators:
                generators[seq_id].set_state(state)


class NeuralBackup:
    """Drafts with `proposer`, whose cache is the drafter's (its rows in the order of the seq ids
    each call is given: the drafter orders them first), K tokens a row."""

    def __init__(self, proposer: SDProposer, grammars: DraftGrammars, k: int) -> None:
        self.proposer, self.grammars, self.k = proposer, grammars, k
        self.early: EarlyDraft | None = None  # first speculations drafted at admission, until asked for

    def draft(self, seq_ids: list[int], states: dict[int, SeqState], need: list[bool]) -> Speculation:
        """Speculations [b, K] for the rows, drawn from their own generators where `need`; the
        drafts' columns leave the cache at once (it keeps committed tokens only)."""
        scratch = torch.Generator()
        views = [
            DraftView(state.tokens, state.sampling, state.generator if n else scratch, self.grammars.matchers.get(s))
            for s, n in zip(seq_ids, need)
            for state in [states[s]]
        ]
        rows = [states[s].sampling for s in seq_ids]
        sampling = BatchSampling.of(rows)
        if self.grammars.any(seq_ids) or any(map(processes, rows)):  # processed position by position, as SD drafts
            sampling = first_position(views, rows, sampling, self.proposer.target_vocab)
        spec = self.proposer.propose(views, self.k, sampling)
        cache = self.proposer.cache
        committed = torch.tensor([v.num_tokens for v in views])
        cache.drop_last(cache.lengths() - committed + 1)
        return spec

    def draft_early(self, seq_ids: list[int], states: dict[int, SeqState]) -> None:
        """Draft the first speculation of rows just admitted, every row the drafter holds."""
        generators = [states[s].generator.get_state() for s in seq_ids]
        spec = self.draft(seq_ids, states, [True] * len(seq_ids))
        self.early = EarlyDraft(seq_ids, spec.on_host(torch.ones(len(seq_ids), dtype=torch.bool)), generators)

    def take_early(self, seq_ids: list[int], need: list[bool]) -> Speculation | None:
        """The speculations drafted at admission where they are what a NEURAL_BACKUP for these rows
        asks for (given out once), else None."""
        if self.early is None or not self.early.serves(seq_ids, need):
            return None
        spec, self.early = self.early.spec, None
        return spec

    def settle(self, states: dict[int, SeqState]) -> None:
        """Take back first speculations drafted at admission that no NEURAL_BACKUP asked for."""
        if self.early is not None:
            self.early.take_back({s: state.generator for s, state in states.items()})
            self.early = None
