"""A round's commit: each row's accepted draft tokens and bonus token appended under its stop
rules (stopping.py), its grammar advanced and its logprobs recorded over what was appended, the
round counted; -> an output per row (what streams to its caller)."""

from __future__ import annotations

from dataclasses import dataclass

from ssd.core.sequence import CompletionOutput, Sequence
from ssd.core.speculation import Source, SpecMetrics, Speculation
from ssd.engine.logprob_recorder import LogprobRecorder
from ssd.engine.metrics import EngineMetrics
from ssd.engine.stopping import StopChecker
from ssd.engine.verifier import Verdict
from ssd.processing.grammar import consume


@dataclass(frozen=True)
class Committed:
    outputs: list[CompletionOutput]  # one per row, in batch order
    tokens: int  # appended over the batch: fewer than emitted where a stop rule cut a row short


class Committer:
    def __init__(self, stopper: StopChecker, logprobs: LogprobRecorder, metrics: EngineMetrics) -> None:
        self.stopper = stopper
        self.logprobs = logprobs
        self.metrics = metrics

    def commit(self, seqs: list[Sequence], spec: Speculation, verdict: Verdict, mode: str) -> Committed:
        """Append the round's tokens to every row of `seqs` (the batch verified, in a round of
        `mode`) and count the round, per row and for the engine."""
        accepted, bonus = verdict.outcome.num_accepted.tolist(), verdict.outcome.bonus_tokens.tolist()
        drafted, num_draft = spec.tokens.tolist(), spec.num_draft.tolist()
        sources = spec.source.tolist() if spec.source is not None else [int(Source.JUST_IN_TIME)] * len(seqs)
        logprobs = verdict.logprobs
        round_metrics = SpecMetrics()
        outputs, appended = [], 0
        for r, seq in enumerate(seqs):
            new_tokens = drafted[r][: accepted[r]] + [bonus[r]]
            for m in (seq.metrics, round_metrics):
                m.record(num_draft[r], accepted[r], len(new_tokens), sources[r], mode)
            count = self.stopper.append(seq, new_tokens)
            if seq.matcher is not None:
                consume(seq.matcher, new_tokens[:count])
            if logprobs is not None and r in logprobs:
                self.logprobs.commit(seq, logprobs[r], new_tokens[:count])
            appended += count
            outputs.append(self.stopper.output(seq))
        self.metrics.generated_tokens += appended
        self.metrics.spec.add(round_metrics)
        return Committed(outputs, appended)
