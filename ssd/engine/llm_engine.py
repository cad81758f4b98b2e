"""The round loop: continuous batching over running sequences, one verification per round.

A round, for the b running sequences:
    speculation = proposer.propose(...)        # [b, K] tokens + [b, K, V] draft_probs (or None: verify.py)
    target forward over [last token, speculation]  -> target_probs [b, K+1, V]
    verify(...)                                 -> num_accepted [b], bonus_tokens [b]
    roll back rejected columns of the target cache; append accepted + bonus under stop rules
Mode ar has no proposer (K = 0: the "bonus" is the next token); mode auto runs each round in
ar, sd or ssd as its ModeChooser decides (autopilot.py). Between rounds the target cache of every
running sequence holds all its tokens but the last one.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from functools import partial

import torch

from ssd.core.bad_words import word_tokens
from ssd.core.config import EngineConfig
from ssd.core.grammar import GrammarCompiler, consume
from ssd.core.logits_processing import Processing
from ssd.core.sampling import BatchSampling, no_mass, process_logits, process_logits_on_device, sampling_tensors
from ssd.core.sampling_params import SamplingParams
from ssd.core.sequence import CompletionOutput, Sequence
from ssd.core.speculation import Proposer, RoundOutcome, Source, SpecMetrics, Speculation
from ssd.engine.autopilot import AUTO_MODES, ModeChooser
from ssd.engine.logprob_recorder import LogprobRecorder
from ssd.engine.metrics import EngineMetrics, graph_metrics
from ssd.engine.proposers import WorkerProviderFactory, build_proposers, round_threads
from ssd.engine.request_checks import check_fits, prompt_ids
from ssd.engine.round_adjustments import RoundAdjustments
from ssd.engine.stopping import StopChecker
from ssd.engine.verify import verify, verify_greedy, verify_step
from ssd.model.runner import pad_rows, target_runner
from ssd.model.step_graphs import run_step
from ssd.model.tensor_parallel import TensorParallelRunner

logger = logging.getLogger(__name__)


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
        self.cache = self.target.new_cache(config.max_num_seqs)
        # Where the target's probabilities are processed and verified: on its device, without host
        # reads, wherever that is not the CPU (there the host versions are faster); tests set it.
        self.device_round = self.target.device.type != "cpu"
        self.proposers: dict[str, Proposer] = build_proposers(config, draft_model, self.vocab_size, worker_provider)
        # Mode auto chooses each round's mode; any other mode is every round's.
        self.chooser = None
        if config.mode == "auto":
            self.chooser = ModeChooser(AUTO_MODES, config.auto_explore_every, config.auto_probe_rounds)
        self.mode = AUTO_MODES[0] if self.chooser is not None else config.mode  # of the round being run
        self.greedy = False  # mode auto: whether every row of the round being run is greedy
        self.proposer: Proposer | None = self.proposers.get(self.mode)
        self._threads_before = torch.get_num_threads()  # the process's, put back at close()
        self.threads = round_threads(config, worker_provider, self._threads_before)
        self._use_threads()
        eos = getattr(target_model.generation_config, "eos_token_id", None)
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        if eos is None:
            eos = tokenizer.eos_token_id
        self.stopper = StopChecker(tokenizer, eos, max_model_len)
        self.logprobs = LogprobRecorder(config.logprobs_mode, tokenizer)
        self.grammars = GrammarCompiler(tokenizer, self.vocab_size, eos)
        self.adjustments = RoundAdjustments(self.vocab_size)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.metrics = EngineMetrics()
        self._ids = itertools.count()
        self._seed_source = torch.Generator().manual_seed(config.seed)

    # ---- requests -------------------------------------------------------------------------

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return prompt_ids(self.tokenizer, prompt, self.vocab_size)

    def check_request(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """Everything about a request that only the engine can check (request_checks.py, and the
        grammar's compilation); -> the prompt's token ids."""
        ids = self.tokenize(prompt)
        check_fits(ids, params, self.max_model_len, self.vocab_size)
        if params.structured_outputs is not None:
            self.grammars.matcher(params.structured_outputs)  # compiles (and caches) the grammar, or says why not
        return ids

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        max_draft: int | None = None,
    ) -> str:
        """Queue a request; max_draft caps the draft tokens its rounds verify (0 = none)."""
        ids = self.check_request(prompt, params)
        if max_draft is not None and max_draft < 0:
            raise ValueError(f"max_draft must be >= 0 (0 = no speculation for this request), got {max_draft}")
        seq_id = next(self._ids)
        seed = params.seed if params.seed is not None else int(torch.randint(2**62, (1,), generator=self._seed_source))
        seq = Sequence(
            seq_id, request_id or str(seq_id), ids, params, torch.Generator().manual_seed(seed), max_draft=max_draft
        )
        if params.structured_outputs is not None:
            seq.matcher = self.grammars.matcher(params.structured_outputs)
            seq.grammar = params.structured_outputs.grammar_text()
            seq.grammar_eos = -1 if self.stopper.eos_token_id is None else self.stopper.eos_token_id
        words = word_tokens(self.tokenizer, params.bad_words) if params.bad_words else ()
        seq.processing = Processing.of(params, self.stopper.eos_token_id, words)
        self.waiting.append(seq)
        return seq.request_id

    def abort(self, request_ids: str | list[str]) -> None:
        """Drop requests wherever they are (one cache re-pack however many are aborted)."""
        gone = {request_ids} if isinstance(request_ids, str) else set(request_ids)
        self.waiting = [s for s in self.waiting if s.request_id not in gone]
        rows = [i for i, s in enumerate(self.running) if s.request_id not in gone]
        if len(rows) != len(self.running):
            self._keep(rows)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- the round --------------------------------------------------------------------------

    def _admit(self) -> list[CompletionOutput]:
        """Prefill the waiting requests there is room for; -> the outputs of those that end there
        (max_tokens 0: a prompt scored, not continued), which leave at once."""
        room = self.config.max_num_seqs - len(self.running)
        if room <= 0 or not self.waiting:
            return []
        new, self.waiting = self.waiting[:room], self.waiting[room:]
        # The rows that go on past their prefill join the proposers first: SSD's drafters then
        # prefill the draft while the target prefills here, not after it, ahead of the first round.
        going = [s for s in new if s.params.max_tokens != 0]
        if going:
            if self.chooser is not None:
                # Mode auto, out of sd (as of the last round): the SD draft's prefill of a new row
                # (a draft forward on this thread) waits until an sd round needs it.
                self.proposers["sd"].defer_prefill = self.mode != "sd"
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

    def _keep(self, rows: list[int]) -> None:
        index = torch.tensor(rows, dtype=torch.long)
        self.cache.keep(index)
        for proposer in self.proposers.values():
            proposer.keep(index)
        self.running = [self.running[i] for i in rows]

    def _round_k(self) -> int:
        if self.proposer is None:
            return 0
        # Positions of the verified tokens must stay inside the context.
        room = min(self.max_model_len - s.num_tokens for s in self.running)
        return max(0, min(self.config.k, room))

    @torch.inference_mode()
    def step(self) -> list[CompletionOutput]:
        """Run one round; return an output (with deltas) for every sequence that progressed."""
        scored = self._admit()
        if not self.running:
            return scored
        started = time.perf_counter()
        self._choose_mode()
        self._use_threads()  # here, not only at a switch: the thread that steps may not be the one that built
        # The first position's adjustments: SD's draft advances them, verification extends them.
        sampling = self._sampling(masks=self.mode == "sd")
        k = self._round_k()
        with self.metrics.timed("draft"):
            spec = self._speculate(k, sampling)
        with self.metrics.timed("verify"):
            outcome, logprobs = self._verify(spec, sampling)
        if self.proposer is not None and k > 0:
            with self.metrics.timed("draft"):  # overlaps the drafter's answer with the bookkeeping below
                self.proposer.outcome_known(self.running, spec, outcome)
        with self.metrics.timed("verify"):
            self.cache.drop_last(spec.num_draft - outcome.num_accepted)
        seqs = self.running
        outputs, tokens = self._commit(spec, outcome, logprobs)
        if self.proposer is not None and k > 0:
            with self.metrics.timed("draft"):
                self.proposer.observe(seqs, spec, outcome)
        batch = len(seqs)
        self._retire_finished()
        self._account(time.perf_counter() - started, spec, tokens, batch)
        return scored + outputs

    def _use_threads(self) -> None:
        """This round's mode's threads, where they depend on the mode (proposers.round_threads)."""
        threads = self.threads.get(self.mode)
        if threads is not None and threads != torch.get_num_threads():
            torch.set_num_threads(threads)

    def _choose_mode(self) -> None:
        """Mode auto: this round's mode and proposer. SSD's drafters let go of the batch while
        other modes run and rejoin when SSD's rounds resume (ssd/engine/autopilot.py)."""
        if self.chooser is None:
            return
        # Greedy and sampled batches are judged apart: SSD's hit rate differs most between them.
        self.greedy = all(s.params.temperature == 0 for s in self.running)
        self.mode = self.chooser.choose(len(self.running), self.greedy)
        self.proposer = self.proposers.get(self.mode)
        ssd = self.proposers["ssd"]
        if self.mode != "ssd":
            ssd.detach()
        elif not ssd.attached:
            ssd.rejoin(self.running)

    def _sampling(self, masks: bool) -> BatchSampling:
        """The running rows' sampling settings at the round's first position, with the penalties
        and bias of the rows that have any, and their masks if `masks` (RoundAdjustments.first)."""
        sampling = BatchSampling.of([s.sampling for s in self.running])
        return sampling.adjusted(self.adjustments.first(self.running, masks))

    def _speculate(self, k: int, sampling: BatchSampling) -> Speculation:
        """The round's proposals: [b, K] tokens and their draft probabilities, capped per request."""
        seqs = self.running
        if k == 0:
            return Speculation.empty(len(seqs), self.vocab_size)
        spec = self.proposer.propose(seqs, k, sampling)
        if any(s.max_draft is not None and s.max_draft < k for s in seqs):
            caps = torch.tensor([k if s.max_draft is None else min(s.max_draft, k) for s in seqs], dtype=torch.long)
            spec = dataclasses.replace(spec, num_draft=torch.minimum(spec.num_draft, caps))
        return spec

    def _verify(self, spec: Speculation, first: BatchSampling) -> tuple[RoundOutcome, dict | None]:
        """The target's forward over [last token, speculation] and the verification rule; first:
        the round's first position's sampling; -> the outcome and the log-probabilities of the
        rows that asked (LogprobRecorder.round)."""
        seqs = self.running
        spec = spec if self.device_round else spec.on_host()
        if self.device_round and any(s.adjusted or s.params.logprobs is not None for s in seqs):
            # Penalties, masks and logprobs follow the drafts on the host: read back once, here.
            spec = dataclasses.replace(spec, tokens=spec.host_tokens())
        last = torch.tensor([[s.last_token] for s in seqs], dtype=torch.long, device=spec.tokens.device)
        tokens = torch.cat([last, spec.tokens.clamp(min=0)], 1)  # [b, K+1]; a -1 draft fails the round below
        valid = torch.arange(spec.k + 1).unsqueeze(0) <= spec.num_draft.unsqueeze(1)
        uniforms = torch.stack([torch.rand(spec.k + 1, generator=s.generator) for s in seqs])  # [b, K+1]
        before = torch.tensor([s.num_tokens for s in seqs], dtype=torch.long)
        assert spec.probs is not None or bool(first.greedy.all()), "draft probs left out for a sampled row"
        sampling = first.adjusted(self.adjustments.every(first.adjust, seqs, spec.tokens))
        if self.device_round:
            outcome, logprobs = self._verify_on_device(tokens, valid, spec, sampling, uniforms, before)
        else:
            logits = self.target.forward(self.cache, tokens, valid)  # [b, K+1, V]
            raw_read = any(s.params.logprobs is not None for s in seqs)  # after this, only logprobs read them
            if not raw_read and bool(sampling.greedy.all()):  # the adjusted logits' argmaxes, read as nothing else
                adjusted = logits if sampling.adjust is None else sampling.adjust.apply(logits, in_place=True)
                result, target_probs = verify_greedy(spec.tokens, adjusted, spec.num_draft), None
            else:
                target_probs = process_logits(logits, sampling, in_place=not raw_read)
                result = verify(
                    spec.tokens, spec.probs, target_probs, spec.num_draft, uniforms[:, :-1], uniforms[:, -1]
                )
            outcome = RoundOutcome(result.num_accepted, result.bonus_tokens, before)
            logprobs = self._round_logprobs(logits, target_probs, spec, outcome)
        self.adjustments.carry(seqs, sampling.adjust, outcome.num_accepted, outcome.bonus_tokens)
        return outcome, logprobs

    def _round_logprobs(self, logits, target_probs, spec: Speculation, outcome: RoundOutcome) -> dict | None:
        accepted, bonus = outcome.num_accepted, outcome.bonus_tokens
        return self.logprobs.round(self.running, logits, target_probs, spec.tokens, accepted, bonus)

    def _verify_on_device(self, tokens, valid, spec, sampling, uniforms, before) -> tuple[RoundOutcome, dict | None]:
        """_verify with the target's logits kept on its device: processed and verified there,
        then one copy of the counts and bonus tokens to the host. Without processing or
        logprobs, the steps after the forward are one step (verify_step) that replays a CUDA graph."""
        device = self.target.device
        logits = self.target.forward(self.cache, tokens, valid, on_host=False)  # [b, K+1, V], on device
        # Plain: the verification reads only the target's logits (no row has processing or logprobs).
        plain = sampling.adjust is None and all(s.params.logprobs is None for s in self.running)
        drafts = (spec.tokens, spec.num_draft, uniforms, spec.probs)
        target_probs = None
        if plain:
            how = "greedy" if bool(sampling.greedy.all()) else "logits"  # a host read of host tensors
            # A greedy batch's step reads neither uniforms nor settings: none is copied in.
            inputs = (*drafts[:2], None, None) if how == "greedy" else (*drafts, *sampling_tensors(sampling))
            step = partial(verify_step, how)
            (counts,) = run_step(self.target.steps, device, f"verify {how}", step, logits, *inputs)
        else:  # the processed probs are what logprobs and processing read
            target_probs = process_logits_on_device(logits, sampling.to(device))
            (counts,) = run_step(None, device, "", partial(verify_step, "probs"), target_probs, *drafts)
        accepted, bonus, broken = counts.cpu().unbind(1)  # the round's one copy
        if bool((broken > 0).any()):
            raise no_mass("draft", "draft_dtype")
        if bool((bonus < 0).any()):
            raise no_mass("target", "dtype")
        outcome = RoundOutcome(accepted, bonus, before)
        return outcome, None if plain else self._round_logprobs(logits, target_probs, spec, outcome)

    def _commit(
        self, spec: Speculation, outcome: RoundOutcome, logprobs: dict | None
    ) -> tuple[list[CompletionOutput], int]:
        """Append each row's accepted tokens and bonus token under its stop rules; -> an output per
        row and the tokens appended."""
        accepted, bonus = outcome.num_accepted.tolist(), outcome.bonus_tokens.tolist()
        drafted, num_draft = spec.tokens.tolist(), spec.num_draft.tolist()
        b = len(self.running)
        sources = spec.source.tolist() if spec.source is not None else [int(Source.DRAFT)] * b
        round_metrics = SpecMetrics()
        outputs, appended = [], 0
        for r, seq in enumerate(self.running):
            new_tokens = drafted[r][: accepted[r]] + [bonus[r]]
            for m in (seq.metrics, round_metrics):
                m.record(num_draft[r], accepted[r], len(new_tokens), sources[r], self.mode)
            count = self.stopper.append(seq, new_tokens)
            if seq.matcher is not None:
                consume(seq.matcher, new_tokens[:count])
            if logprobs is not None and r in logprobs:
                self.logprobs.commit(seq, logprobs[r], new_tokens[:count])
            appended += count
            outputs.append(self.stopper.output(seq))
        self.metrics.generated_tokens += appended
        self.metrics.spec.add(round_metrics)
        return outputs, appended

    def _retire_finished(self) -> None:
        keep = [i for i, s in enumerate(self.running) if not s.finished]
        if len(keep) < len(self.running):
            self.metrics.finished_requests += len(self.running) - len(keep)
            self._keep(keep)

    def _account(self, elapsed: float, spec: Speculation, tokens: int, batch: int) -> None:
        """The step's wall time; a step in which every row hit the SSD cache also counts towards
        Theorem 7's bound (EngineMetrics); mode auto learns from every step."""
        self.metrics.step_seconds += elapsed
        if self.chooser is not None:
            self.chooser.record(self.mode, batch, elapsed, tokens, self.greedy)
        if spec.k > 0 and spec.source is not None and bool((spec.source == int(Source.CACHE)).all()):
            self.metrics.hit_steps += 1
            self.metrics.hit_step_seconds += elapsed
            self.metrics.hit_step_tokens += tokens

    def engine_metrics(self) -> dict:
        ssd = self.proposers.get("ssd")
        if ssd is not None:
            self.metrics.extra = ssd.stats()
        out = self.metrics.as_dict()
        out.update(graph_metrics({"target": self.target, "draft": getattr(self.proposers.get("sd"), "runner", None)}))
        if self.chooser is not None:
            out["auto"] = self.chooser.stats(max(1, len(self.running)), self.greedy)
        return out

    def broken(self) -> str | None:
        """Why this engine cannot run another round (its split target or split draft lost a
        rank), or None."""
        return self.target.broken() or (self.split_draft.broken() if self.split_draft is not None else None)

    def close(self) -> None:
        for proposer in self.proposers.values():
            proposer.close()
        self.target.close()  # a tensor-parallel target's ranks stop (closing twice is a no-op)
        if self.threads:  # the process's threads, as they were before this engine changed them
            torch.set_num_threads(self._threads_before)
