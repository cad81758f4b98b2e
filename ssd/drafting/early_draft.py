"""The first speculation of rows admitted to an idle drafter, drafted while the target prefills them.

A new row's first round has nothing cached, so the target's neural backup asks for its
speculation just in time (DRAFT_NOW) after its own prefill and waits K draft steps for it. A
drafter that holds no other rows has nothing to do during that prefill (the target sends ADMIT
before it: ssd/engine/llm_engine.py), so it drafts the speculation at admission: the same call
DRAFT_NOW would make, on the same cache, state and generators, hence the same tokens and
probabilities. A DRAFT_NOW for exactly those rows is served from it. Anything else that comes
first (BEGIN_ROUND after the fast backup speculated, another ADMIT, a RELEASE, a DRAFT_NOW for
other rows) takes it back: the rows' generators return to their states from before it, so what a
request samples never depends on whether it was drafted early (as with predicted rounds,
ssd/worker/session.py). (Demo pair, batch 1, CPU: the wait was about 7 ms of a request's first
round.) A drafter in the engine's own thread (draft_transport="inprocess") drafts it at
admission too, before the prefill rather than beside it: the same work, earlier.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ssd.core.speculation import Speculation


@dataclass
class EarlyDraft:
    seq_ids: list[int]  # the rows, in the order the drafter holds them
    spec: Speculation  # their speculations [b, K], on the host
    generators: list[torch.Tensor]  # each row's generator state from before it was drafted

    def serves(self, seq_ids: list[int], need: list[bool]) -> bool:
        """Whether it is what a DRAFT_NOW for these rows asks for (every row, in this order)."""
        return self.seq_ids == list(seq_ids) and all(need)

    def take_back(self, generators: dict[int, torch.Generator]) -> None:
        """Put the generators of the rows still held (seq id -> generator) back as they were."""
        for seq_id, state in zip(self.seq_ids, self.generators):
            if seq_id in generators:
                generators[seq_id].set_state(state)
