"""The round loop: continuous batching over running sequences, one verification per round.

A round, for the b running sequences:
    speculation = proposer.propose(...)        # [b, K] tokens + [b, K, V] draft_probs
    target forward over [last token, speculation]  -> target_probs [b, K+1, V]
    verify(...)                                 -> num_accepted [b], bonus_tokens [b]
    roll back rejected columns of the target cache; append accepted + bonus under stop rules
Mode ar has no proposer (K = 0: the "bonus" is the next token). Between rounds the target cache
of every running sequence holds all its tokens but the last one.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass, field

import torch

from ssd.config import EngineConfig
from ssd.drafting.draft_proposer import DraftModelProposer, pad_rows
from ssd.drafting.speculation import Proposer, RoundOutcome, Source, Speculation
from ssd.engine.sampling import BatchSampling, process_logits
from ssd.engine.sequence import CompletionOutput, Sequence, SpecMetrics
from ssd.engine.stopping import StopChecker
from ssd.engine.verify import verify
from ssd.model.runner import draft_runner, target_runner
from ssd.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class EngineMetrics:
    """Totals over the engine's life (finished and running sequences)."""

    spec: SpecMetrics = field(default_factory=SpecMetrics)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    generated_tokens: int = 0
    finished_requests: int = 0
    # Wall time of whole steps (speculate, verify, observe; admission and prefill excluded), and
    # the same for the steps in which every row's speculation came from the SSD cache: their
    # tokens per second are Theorem 7's bound with p_hit = 1 at the measured E_hit and T_p.
    step_seconds: float = 0.0
    hit_steps: int = 0
    hit_step_seconds: float = 0.0
    hit_step_tokens: int = 0
    extra: dict = field(default_factory=dict)  # proposer-specific figures (SSD: fan-out, backup, ...)

    def as_dict(self) -> dict:
        rounds = max(self.spec.rounds, 1)
        return {
            **({"ssd": self.extra} if self.extra else {}),
            **self.spec.as_dict(),
            "generated_tokens": self.generated_tokens,
            "finished_requests": self.finished_requests,
            "draft_ms_per_round": round(1000 * self.draft_seconds / rounds, 3),
            "verify_ms_per_round": round(1000 * self.verify_seconds / rounds, 3),
            "step_seconds_total": self.step_seconds,
            "hit_steps": self.hit_steps,
            "hit_step_tokens": self.hit_step_tokens,
            "hit_step_seconds_total": self.hit_step_seconds,
        }


class LLMEngine:
    def __init__(self, config: EngineConfig, target_model, draft_model, tokenizer, max_model_len: int) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.target = target_runner(target_model, config.device, config.lean_forward, config.pack_target_weights)
        self.vocab_size = self.target.vocab_size
        self.cache = self.target.new_cache()
        self.proposer: Proposer | None = None
        if config.mode == "sd":
            self.proposer = DraftModelProposer(
                draft_runner(draft_model, config.draft_device, config.lean_forward), self.vocab_size
            )
        elif config.mode == "ssd":
            self.proposer = build_ssd_proposer(config, draft_model, self.vocab_size)
        eos = getattr(target_model.generation_config, "eos_token_id", None)
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        if eos is None:
            eos = tokenizer.eos_token_id
        self.stopper = StopChecker(tokenizer, eos, max_model_len)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.metrics = EngineMetrics()
        self._ids = itertools.count()
        self._seed_source = torch.Generator().manual_seed(config.seed)

    # ---- requests -------------------------------------------------------------------------

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("prompt must not be empty (got an empty list of token ids)")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        return ids

    def check_request(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """Everything about a request that only the engine can check (the prompt's tokens and
        length, stop token ids against the vocabulary); -> the prompt's token ids."""
        ids = self.tokenize(prompt)
        if not ids:
            raise ValueError("prompt must not be empty (it tokenized to no tokens)")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the context length "
                f"{self.max_model_len}: lower max_tokens to at most {self.max_model_len - len(ids)} or shorten "
                "the prompt"
            )
        # SamplingParams already refused negative ids; only the engine knows the vocabulary.
        beyond = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if beyond:
            raise ValueError(f"stop_token_ids: token id {beyond[0]} is outside the vocabulary [0, {self.vocab_size})")
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

    def _admit(self) -> None:
        room = self.config.max_num_seqs - len(self.running)
        if room <= 0 or not self.waiting:
            return
        new, self.waiting = self.waiting[:room], self.waiting[room:]
        cache = self.target.new_cache()
        tokens, valid = pad_rows([s.prompt_ids[:-1] for s in new])
        self.target.forward(cache, tokens, valid)
        self.cache.extend(cache)
        if self.proposer is not None:
            self.proposer.add(new)
        self.running.extend(new)

    def _keep(self, rows: list[int]) -> None:
        index = torch.tensor(rows, dtype=torch.long)
        self.cache.select(index)
        if self.proposer is not None:
            self.proposer.keep(index)
        self.running = [self.running[i] for i in rows]

    def _round_k(self) -> int:
        if self.proposer is None:
            return 0
        # Positions of the verified tokens must stay inside the context.
        room = min(self.max_model_len - s.num_tokens for s in self.running)
        return max(0, min(self.config.k, room))

    def _sampling(self) -> BatchSampling:
        params = [s.params for s in self.running]
        return BatchSampling(
            torch.tensor([p.temperature for p in params], dtype=torch.float32),
            torch.tensor([p.top_k for p in params], dtype=torch.long),
            torch.tensor([p.top_p for p in params], dtype=torch.float32),
        )

    @torch.inference_mode()
    def step(self) -> list[CompletionOutput]:
        """Run one round; return an output (with deltas) for every sequence that progressed."""
        self._admit()
        if not self.running:
            return []
        seqs, b = self.running, len(self.running)
        started = time.perf_counter()
        sampling = self._sampling()
        k = self._round_k()
        t0 = time.perf_counter()
        spec = self.proposer.propose(seqs, k, sampling) if k > 0 else Speculation.empty(b, self.vocab_size)
        if k > 0 and any(s.max_draft is not None and s.max_draft < k for s in seqs):
            caps = torch.tensor([k if s.max_draft is None else min(s.max_draft, k) for s in seqs], dtype=torch.long)
            spec = dataclasses.replace(spec, num_draft=torch.minimum(spec.num_draft, caps))
        t1 = time.perf_counter()
        last = torch.tensor([[s.last_token] for s in seqs], dtype=torch.long)
        tokens = torch.cat([last, spec.tokens], 1)  # [b, K+1]
        valid = torch.arange(spec.k + 1).unsqueeze(0) <= spec.num_draft.unsqueeze(1)
        target_probs = process_logits(self.target.forward(self.cache, tokens, valid), sampling)  # [b, K+1, V]
        uniforms = torch.stack([torch.rand(spec.k + 1, generator=s.generator) for s in seqs])  # [b, K+1]
        result = verify(spec.tokens, spec.probs, target_probs, spec.num_draft, uniforms[:, :-1], uniforms[:, -1])
        before = torch.tensor([s.num_tokens for s in seqs], dtype=torch.long)
        outcome = RoundOutcome(result.num_accepted, result.bonus_tokens, before)
        t2 = time.perf_counter()
        if self.proposer is not None and k > 0:
            self.proposer.outcome_known(seqs, spec, outcome)
        t3 = time.perf_counter()
        self.cache.drop_last(spec.num_draft - result.num_accepted)
        self.metrics.draft_seconds += (t1 - t0) + (t3 - t2)
        self.metrics.verify_seconds += (t2 - t1) + (time.perf_counter() - t3)

        accepted = result.num_accepted.tolist()
        bonus = result.bonus_tokens.tolist()
        drafted = spec.tokens.tolist()
        num_draft = spec.num_draft.tolist()
        sources = spec.source.tolist() if spec.source is not None else [int(Source.DRAFT)] * b
        round_metrics = SpecMetrics()
        outputs = []
        step_tokens = 0
        for r, seq in enumerate(seqs):
            new_tokens = drafted[r][: accepted[r]] + [bonus[r]]
            for m in (seq.metrics, round_metrics):
                m.record(num_draft[r], accepted[r], len(new_tokens), sources[r])
            step_tokens += self.stopper.append(seq, new_tokens)
            outputs.append(self._output(seq))
        self.metrics.generated_tokens += step_tokens
        self.metrics.spec.add(round_metrics)
        if self.proposer is not None and k > 0:
            t3 = time.perf_counter()
            self.proposer.observe(seqs, spec, outcome)
            self.metrics.draft_seconds += time.perf_counter() - t3
        keep = [i for i, s in enumerate(seqs) if not s.finished]
        if len(keep) < b:
            self.metrics.finished_requests += b - len(keep)
            self._keep(keep)
        elapsed = time.perf_counter() - started
        self.metrics.step_seconds += elapsed
        if k > 0 and all(src == int(Source.CACHE) for src in sources):
            self.metrics.hit_steps += 1
            self.metrics.hit_step_seconds += elapsed
            self.metrics.hit_step_tokens += step_tokens
        return outputs

    def engine_metrics(self) -> dict:
        stats = getattr(self.proposer, "stats", None)
        if stats is not None:
            self.metrics.extra = stats()
        return self.metrics.as_dict()

    def _output(self, seq: Sequence) -> CompletionOutput:
        text = self.stopper.text(seq)  # incremental: no full decode per round
        sendable_end = self.stopper.streamable_end(seq, text)
        delta_text = text[seq.sent_text : sendable_end] if sendable_end > seq.sent_text else ""
        delta_tokens = seq.output_ids[seq.sent_tokens :]
        seq.sent_text = max(seq.sent_text, sendable_end)
        seq.sent_tokens = len(seq.output_ids)
        return CompletionOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_ids,
            token_ids=list(seq.output_ids),
            text=text,
            finish_reason=seq.finish_reason.value if seq.finished else None,
            metrics=seq.metrics.as_dict(),
            delta_token_ids=delta_tokens,
            delta_text=delta_text,
        )

    def close(self) -> None:
        if self.proposer is not None:
            self.proposer.close()


def build_ssd_proposer(config: EngineConfig, draft_model, vocab_size: int):
    from ssd.drafting.drafter import Drafter
    from ssd.drafting.ssd_proposer import SSDConfig, SSDProposer
    from ssd.transport.channel import InProcessClient

    ssd_config = SSDConfig(
        k=config.k,
        budget=config.ssd_budget,
        autobudget=config.ssd_autobudget,
        fanout=config.ssd_fanout,
        saguaro_c=config.saguaro_c,
        backup=config.ssd_backup,
        deadline_s=config.draft_deadline_s,
        reproducible=config.ssd_reproducible,
        num_workers=config.draft_workers
        if config.draft_split == "outcomes"
        else 1,  # the tree's width: D shares or one
    )
    if config.draft_transport == "inprocess":
        drafter = Drafter(
            draft_runner(draft_model, config.draft_device, config.lean_forward), vocab_size, config.k, config.saguaro_c
        )
        client = InProcessClient(drafter)
    else:
        from ssd.transport.pool import DraftPool

        client = DraftPool(
            draft_worker_source(config, vocab_size), config.draft_workers, config.draft_deadline_s, config.draft_split
        )
    return SSDProposer(client, ssd_config, vocab_size)


def uses_ray(config: EngineConfig) -> bool:
    """Whether the draft workers are Ray actors (config.draft_launcher, resolved)."""
    if config.draft_launcher != "auto":
        return config.draft_launcher == "ray"
    if config.draft_transport not in ("torch", "grpc"):
        return False
    try:
        import ray
    except ImportError:
        return False
    return ray.is_initialized()


def draft_worker_source(config: EngineConfig, vocab_size: int):
    """Where the draft pool gets its workers: child processes of this one, or Ray actors leased
    from the shared pool. The Ray side lives in the top-level `actors` package, which imports
    ssd (never the reverse): it is looked up by name only when asked for."""
    if not uses_ray(config):
        from ssd.transport.draft_process import SpawnedWorkers

        return SpawnedWorkers(config, vocab_size)
    import importlib

    try:
        source = importlib.import_module("actors.source")
    except ImportError as err:
        raise ValueError(
            f"draft_launcher='ray' needs the actors package of ssd-serve and Ray installed: {err}"
        ) from err
    return source.RayLeasedWorkers(
        config,
        vocab_size,
        start_workers=config.draft_workers if config.draft_start_workers else 0,
        resources=config.draft_worker_resources,
    )
