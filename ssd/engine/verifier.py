"""A round's verification: the target's forward over [last token, speculation], its logits
processed as each row asks, and the rule of verify.py, in one call whatever the round is.

Two pipelines, the same outcome for the same inputs (tests/test_device_round.py):
    host    logits read back, processed and verified on the host: faster where the target runs
            on the CPU (each operation costs microseconds, a copy nothing)
    device  logits kept on the target's device, processed and verified there, then one copy of
            the counts and bonus tokens to the host; without processing or logprobs the steps
            after the forward are one step (verify_step) that replays a CUDA graph
and in each, a greedy batch without processing or logprobs reads only the logits' argmaxes
(verify_greedy) instead of building one-hot probabilities.

The round's penalties, bias and masks (RoundAdjustments) are built here: at the first position
for the proposer (sampling), at every position for verification, and carried to the next round
once the outcome is known.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial

import torch

from ssd.core.logprobs import PositionLogprobs
from ssd.core.sampling import BatchSampling, no_mass, process_logits, process_logits_on_device, sampling_tensors
from ssd.core.sequence import Sequence
from ssd.core.speculation import RoundOutcome, Speculation
from ssd.engine.logprob_recorder import LogprobRecorder
from ssd.engine.verify import verify, verify_greedy, verify_step
from ssd.model.step_graphs import run_step
from ssd.processing.round_adjustments import RoundAdjustments


@dataclass(frozen=True)
class Verdict:
    """What a round's verification decided, with what the commit reads besides."""

    outcome: RoundOutcome  # num_accepted [b], bonus_tokens [b], tokens_before [b]: on the host
    # {row: (its PositionLogprobs on the host, its index there)} of the rows that asked for
    # logprobs (LogprobRecorder.round); None where none did
    logprobs: dict[int, tuple[PositionLogprobs, int]] | None


class Verifier:
    """target / cache: the target's runner and KV cache; vocab: the target's vocabulary size;
    logprobs: the engine's recorder (the rows that ask get the verification's logits)."""

    def __init__(self, target, cache, vocab: int, logprobs: LogprobRecorder) -> None:
        self.target = target
        self.cache = cache
        self.logprobs = logprobs
        self.adjustments = RoundAdjustments(vocab)
        # The device pipeline wherever the target is not on the CPU (there the host's is faster);
        # tests set it to compare the two.
        self.device_round = target.device.type != "cpu"

    def sampling(self, seqs: list[Sequence], masks: bool) -> BatchSampling:
        """The rows' sampling settings at the round's first position, with the penalties and bias
        of the rows that have any, and their masks if `masks` (RoundAdjustments.first): what a
        proposer drafts under, and what verify() extends to every position."""
        sampling = BatchSampling.of([s.sampling for s in seqs])
        return sampling.adjusted(self.adjustments.first(seqs, masks))

    def verify(self, seqs: list[Sequence], spec: Speculation, first: BatchSampling) -> Verdict:
        """The target's forward over [last token, speculation] and the verification rule; first:
        sampling(seqs, ...) of this round. The cache then holds the rejected columns too:
        roll_back() drops them."""
        spec = spec if self.device_round else spec.on_host()
        if self.device_round and any(s.adjusted or s.params.logprobs is not None for s in seqs):
            # Penalties, masks and logprobs follow the drafts on the host: read back once, here.
            spec = dataclasses.replace(spec, tokens=spec.host_tokens())
        last = torch.tensor([[s.last_token] for s in seqs], dtype=torch.long, device=spec.tokens.device)
        tokens = torch.cat([last, spec.tokens.clamp(min=0)], 1)  # [b, K+1]; a -1 draft fails the round below
        valid = torch.arange(spec.k + 1).unsqueeze(0) <= spec.num_draft.unsqueeze(1)  # [b, K+1]
        uniforms = torch.stack([torch.rand(spec.k + 1, generator=s.generator) for s in seqs])  # [b, K+1]
        before = torch.tensor([s.num_tokens for s in seqs], dtype=torch.long)  # [b]
        assert spec.probs is not None or bool(first.greedy.all()), "draft probs left out for a sampled row"
        sampling = first.adjusted(self.adjustments.every(first.adjust, seqs, spec.tokens))
        pipeline = self._on_device if self.device_round else self._on_host
        verdict = pipeline(seqs, tokens, valid, spec, sampling, uniforms, before)
        outcome = verdict.outcome
        self.adjustments.carry(seqs, sampling.adjust, outcome.num_accepted, outcome.bonus_tokens)
        return verdict

    def roll_back(self, spec: Speculation, outcome: RoundOutcome) -> None:
        """Drop the rejected columns from the target's cache: it then holds every committed token
        of each row but the last (the bonus token, which the next round's forward feeds)."""
        self.cache.drop_last(spec.num_draft - outcome.num_accepted)

    def _on_host(self, seqs, tokens, valid, spec, sampling, uniforms, before) -> Verdict:
        logits = self.target.forward(self.cache, tokens, valid)  # [b, K+1, V]
        raw_read = any(s.params.logprobs is not None for s in seqs)  # after this, only logprobs read them
        if not raw_read and bool(sampling.greedy.all()):  # the adjusted logits' argmaxes, read as nothing else
            adjusted = logits if sampling.adjust is None else sampling.adjust.apply(logits, in_place=True)
            result, target_probs = verify_greedy(spec.tokens, adjusted, spec.num_draft), None
        else:
            target_probs = process_logits(logits, sampling, in_place=not raw_read)  # [b, K+1, V]
            result = verify(spec.tokens, spec.probs, target_probs, spec.num_draft, uniforms[:, :-1], uniforms[:, -1])
        outcome = RoundOutcome(result.num_accepted, result.bonus_tokens, before)
        return Verdict(outcome, self._logprobs(seqs, logits, target_probs, spec, outcome))

    def _on_device(self, seqs, tokens, valid, spec, sampling, uniforms, before) -> Verdict:
        device = self.target.device
        logits = self.target.forward(self.cache, tokens, valid, on_host=False)  # [b, K+1, V], on device
        # Plain: the verification reads only the target's logits (no row has processing or logprobs).
        plain = sampling.adjust is None and all(s.params.logprobs is None for s in seqs)
        drafts = (spec.tokens, spec.num_draft, uniforms, spec.probs)
        target_probs = None
        if plain:
            how = "greedy" if bool(sampling.greedy.all()) else "logits"  # a host read of host tensors
            # A greedy batch's step reads neither uniforms nor settings: none is copied in.
            inputs = (*drafts[:2], None, None) if how == "greedy" else (*drafts, *sampling_tensors(sampling))
            step = partial(verify_step, how)
            (counts,) = run_step(self.target.steps, device, f"verify {how}", step, logits, *inputs)
        else:  # the processed probs are what logprobs and processing read
            target_probs = process_logits_on_device(logits, sampling.to(device))  # [b, K+1, V]
            (counts,) = run_step(None, device, "", partial(verify_step, "probs"), target_probs, *drafts)
        accepted, bonus, broken = counts.cpu().unbind(1)  # the round's one copy; [b] each
        if bool((broken > 0).any()):
            raise no_mass("draft", "draft_dtype")
        if bool((bonus < 0).any()):
            raise no_mass("target", "dtype")
        outcome = RoundOutcome(accepted, bonus, before)
        return Verdict(outcome, None if plain else self._logprobs(seqs, logits, target_probs, spec, outcome))

    def _logprobs(self, seqs, logits, target_probs, spec: Speculation, outcome: RoundOutcome):
        accepted, bonus = outcome.num_accepted, outcome.bonus_tokens
        return self.logprobs.round(seqs, logits, target_probs, spec.tokens, accepted, bonus)
