"""The batch: requests waiting, sequences running, and the rows they hold.

Row r of the running batch is row r of the target's KV cache and of every proposer's state, so
whatever changes the batch changes all of them together: admission appends rows (after the
target's prefill and the proposers' add), and keep() re-packs them once for every row that
leaves, finished or aborted. Admission is first come, first served, up to max_num_seqs rows.
"""

from __future__ import annotations

import torch

from ssd.core.proposer import Proposer
from ssd.core.sequence import CompletionOutput, Sequence
from ssd.engine.logprob_recorder import LogprobRecorder
from ssd.engine.metrics import EngineMetrics
from ssd.engine.stopping import StopChecker
from ssd.model.runner import pad_rows


class Scheduler:
    """target / cache: the target's runner and KV cache (prefill here); proposers: every mode's,
    each told of the rows that join and leave; stopper / logprobs / metrics: what a prefill that
    ends a request (max_tokens 0) and a retirement report to."""

    def __init__(
        self,
        max_num_seqs: int,
        target,
        cache,
        proposers: dict[str, Proposer],
        stopper: StopChecker,
        logprobs: LogprobRecorder,
        metrics: EngineMetrics,
    ) -> None:
        self.max_num_seqs = max_num_seqs
        self.target = target
        self.cache = cache
        self.proposers = proposers
        self.stopper = stopper
        self.logprobs = logprobs
        self.metrics = metrics
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_ids: str | list[str]) -> None:
        """Drop requests wherever they are (one cache re-pack however many are aborted)."""
        gone = {request_ids} if isinstance(request_ids, str) else set(request_ids)
        self.waiting = [s for s in self.waiting if s.request_id not in gone]
        rows = [i for i, s in enumerate(self.running) if s.request_id not in gone]
        if len(rows) != len(self.running):
            self._keep(rows)

    def admit(self) -> list[CompletionOutput]:
        """Prefill the waiting requests there is room for; -> the outputs of those that end there
        (max_tokens 0: a prompt scored, not continued), which leave at once."""
        room = self.max_num_seqs - len(self.running)
        if room <= 0 or not self.waiting:
            return []
        new, self.waiting = self.waiting[:room], self.waiting[room:]
        # The rows that go on past their prefill join the proposers first: SSD's drafters then
        # prefill the draft while the target prefills here, not after it, ahead of the first round.
        # (A detached proposer, mode auto, defers that work: Proposer.detach.)
        going = [s for s in new if s.params.max_tokens != 0]
        if going:
            for proposer in self.proposers.values():
                proposer.add(going)
        tokens, valid = pad_rows([s.prompt_ids[:-1] for s in new])
        scoring = any(s.params.prompt_logprobs is not None for s in new)  # else nobody reads the logits
        logits = self.target.forward(self.cache.add_rows(len(new)), tokens, valid, on_host=False, with_logits=scoring)
        if scoring:
            self.logprobs.prompt(new, logits)
        scored = [s for s in new if s.params.max_tokens == 0]
        if scored:
            for seq in scored:
                self.stopper.finish_at_length(seq)
            self.metrics.finished_requests += len(scored)
            before = len(self.running)
            kept = [*range(before), *(before + i for i, s in enumerate(new) if not s.finished)]
            self.cache.keep(torch.tensor(kept, dtype=torch.long))
            new = [s for s in new if not s.finished]
        assert new == going, "a prefill finishes only the rows that asked for no tokens"
        self.running.extend(going)
        return [self.stopper.output(s) for s in scored]

    def retire_finished(self) -> None:
        keep = [i for i, s in enumerate(self.running) if not s.finished]
        if len(keep) < len(self.running):
            self.metrics.finished_requests += len(self.running) - len(keep)
            self._keep(keep)

    def _keep(self, rows: list[int]) -> None:
        index = torch.tensor(rows, dtype=torch.long)
        self.cache.keep(index)
        for proposer in self.proposers.values():
            proposer.keep(index)
        self.running = [self.running[i] for i in rows]
