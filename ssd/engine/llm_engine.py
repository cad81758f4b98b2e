"""The round loop: continuous batching over running sequences, one verification per round.

A step, for the b running sequences (each call is a role with its own object):
    scheduler.admit()                 prefill the waiting requests there is room for  (scheduler.py)
    policy.choose(seqs)               the round's mode and proposer; auto switches    (mode_policy.py)
    proposer.propose(...)             [b, K] tokens + [b, K, V] draft_probs (or None) (ssd/drafting)
    verifier.verify(...)              target forward -> num_accepted [b], bonus [b]   (verifier.py)
    committer.commit(...)             accepted + bonus appended under stop rules      (commit.py)
    scheduler.retire_finished()       (the proposer hears the outcome in between: outcome_known, observe)
Mode ar has no proposer (K = 0: the "bonus" is the next token). Between rounds the target cache
of every running sequence holds all its tokens but the last one.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from ssd.core.config import EngineConfig
from ssd.core.proposer import Proposer
from ssd.core.sampling import BatchSampling
from ssd.core.sampling_params import SamplingParams
from ssd.core.sequence import CompletionOutput, Sequence
from ssd.core.speculation import Speculation
from ssd.engine.commit import Committer
from ssd.engine.intake import Intake, eos_token_id
from ssd.engine.logprob_recorder import LogprobRecorder
from ssd.engine.metrics import EngineMetrics, graph_metrics
from ssd.engine.mode_policy import RoundMode, mode_policy
from ssd.engine.proposers import WorkerProviderFactory, build_proposers, round_threads
from ssd.engine.scheduler import Scheduler
from ssd.engine.stopping import StopChecker
from ssd.engine.verifier import Verifier
from ssd.model.runner import target_runner
from ssd.model.tensor_parallel import TensorParallelRunner


class LLMEngine:
    """One engine over a loaded model pair: requests in (add_request), a round per step(), outputs
    out. worker_provider: where SSD's draft pool gets its workers (ssd/engine/proposers.py)."""

    def __init__(
        self,
        config: EngineConfig,
        target_model,
        draft_model,
        tokenizer,
        max_model_len: int,
        worker_provider: WorkerProviderFactory | None = None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.target = target_runner(
            target_model, config.device, config.lean_forward, config.pack_target_weights, config.enforce_eager
        )
        self.vocab_size = self.target.vocab_size
        # A draft split over ranks in this process (SD's), watched as the split target is (broken()).
        self.split_draft = draft_model if isinstance(draft_model, TensorParallelRunner) else None
        self.cache = self.target.new_cache(config.max_num_seqs, max_model_len, config.kv_cache_bytes)
        self.proposers: dict[str, Proposer] = build_proposers(
            config, draft_model, self.vocab_size, max_model_len, worker_provider
        )
        threads = round_threads(config, worker_provider, torch.get_num_threads())
        self.policy = mode_policy(config, self.proposers, threads)
        eos = eos_token_id(target_model, tokenizer)
        self.stopper = StopChecker(tokenizer, eos, max_model_len)
        self.metrics = EngineMetrics()
        logprobs = LogprobRecorder(config.logprobs_mode, tokenizer)
        self.intake = Intake(tokenizer, self.vocab_size, max_model_len, eos, config.seed)
        self.scheduler = Scheduler(
            config.max_num_seqs, self.target, self.cache, self.proposers, self.stopper, logprobs, self.metrics
        )
        self.verifier = Verifier(self.target, self.cache, self.vocab_size, logprobs)
        self.committer = Committer(self.stopper, logprobs, self.metrics)

    # ---- requests -------------------------------------------------------------------------

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return self.intake.tokenize(prompt)

    def check_request(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """Everything about a request that only the engine can check (request_checks.py, and the
        grammar's compilation); -> the prompt's token ids."""
        return self.intake.check(prompt, params)

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        k: int | None = None,
    ) -> str:
        """Queue a request; k caps the draft tokens its rounds verify at most K (0 = none)."""
        seq = self.intake.sequence(prompt, params, request_id, k)
        self.scheduler.add(seq)
        return seq.request_id

    def abort(self, request_ids: str | list[str]) -> None:
        """Drop requests wherever they are (one cache re-pack however many are aborted)."""
        self.scheduler.abort(request_ids)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the round --------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[CompletionOutput]:
        """Run one round; return an output (with deltas) for every sequence that progressed."""
        scored = self.scheduler.admit()
        seqs = self.scheduler.running
        if not seqs:
            return scored
        started = time.perf_counter()
        mode = self.policy.choose(seqs)
        # The first position's sampling: SD's draft advances it (with masks), verification extends it.
        first = self.verifier.sampling(seqs, masks=mode.name == "sd")
        k = self._round_k(mode, seqs)
        with self.metrics.timed("draft"):
            spec = self._propose(mode, seqs, k, first)
        with self.metrics.timed("verify"):
            verdict = self.verifier.verify(seqs, spec, first)
        if mode.proposer is not None and k > 0:
            with self.metrics.timed("draft"):  # overlaps the drafter's answer with the bookkeeping below
                mode.proposer.outcome_known(seqs, spec, verdict.outcome)
        with self.metrics.timed("verify"):
            self.verifier.roll_back(spec, verdict.outcome)
        committed = self.committer.commit(seqs, spec, verdict, mode.name)
        if mode.proposer is not None and k > 0:
            with self.metrics.timed("draft"):
                mode.proposer.observe(seqs, spec, verdict.outcome)
        self.scheduler.retire_finished()
        elapsed = time.perf_counter() - started
        self.metrics.record_step(elapsed, spec, committed.tokens)
        self.policy.record(len(seqs), elapsed, committed.tokens)  # mode auto learns from every step
        return scored + committed.outputs

    def _round_k(self, mode: RoundMode, seqs: list[Sequence]) -> int:
        if mode.proposer is None:
            return 0
        # Positions of the verified tokens must stay inside the context.
        room = min(self.max_model_len - s.num_tokens for s in seqs)
        return max(0, min(self.config.k, room))

    def _propose(self, mode: RoundMode, seqs: list[Sequence], k: int, sampling: BatchSampling) -> Speculation:
        """The round's proposals: [b, K] tokens and their draft probabilities, capped per request."""
        if k == 0:
            return Speculation.empty(len(seqs), self.vocab_size)
        spec = mode.proposer.propose(seqs, k, sampling)
        if any(s.k is not None and s.k < k for s in seqs):
            caps = torch.tensor([k if s.k is None else min(s.k, k) for s in seqs], dtype=torch.long)
            spec = dataclasses.replace(spec, num_draft=torch.minimum(spec.num_draft, caps))
        return spec

    # ---- the engine's state -------------------------------------------------------------------

    def engine_metrics(self) -> dict:
        self.metrics.extra = {mode: stats for mode, p in self.proposers.items() if (stats := p.stats())}
        out = self.metrics.as_dict()
        runners = {"target": self.target}
        for proposer in self.proposers.values():
            runners.update(proposer.graph_runners())
        out.update(graph_metrics(runners))
        out.update(self.policy.stats(len(self.scheduler.running)))
        return out

    def broken(self) -> str | None:
        """Why this engine cannot run another round (its split target or split draft lost a
        rank), or None."""
        return self.target.broken() or (self.split_draft.broken() if self.split_draft is not None else None)

    def close(self) -> None:
        for proposer in self.proposers.values():
            proposer.close()
        self.target.close()  # a tensor-parallel target's ranks stop (closing twice is a no-op)
        self.policy.close()

    # Read (and, in tests, set) by the engine's callers: each is one role's.
    waiting = property(lambda self: self.scheduler.waiting)
    running = property(lambda self: self.scheduler.running)
    mode = property(lambda self: self.policy.current.name)  # of the round being (or last) run
    proposer = property(lambda self: self.policy.current.proposer)

    @property
    def chooser(self):
        return self.policy.chooser

    @chooser.setter
    def chooser(self, chooser) -> None:
        self.policy.chooser = chooser

    @property
    def device_round(self) -> bool:
        return self.verifier.device_round

    @device_round.setter
    def device_round(self, on: bool) -> None:
        self.verifier.device_round = on
