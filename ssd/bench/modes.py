"""What `ssd bench` can run: thread settings, and the registry of decoding modes with their runners
(this project's engine, Hugging Face assisted generation).

Modes are data: `MODES` maps a name to how to build a runner for it (`register_mode`). An engine
mode is one line: `register_mode(BenchMode("ssd", "...", build=engine_mode("ssd")))`.

Runners are built inside a worker process; torch, transformers and the engine are imported there.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from ssd.core.config import available_cpus

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BenchSetting:
    name: str
    description: str
    threads: Callable[[], int]


SETTINGS: dict[str, BenchSetting] = {
    "paper": BenchSetting("paper", "one thread per mode, OMP_NUM_THREADS=1", lambda: 1),
    "machine": BenchSetting("machine", "all the machine's cores per mode", available_cpus),
}


@dataclass
class BatchCounters:
    """What a runner reports for one generate call over one batch of prompts."""

    generated_tokens: int
    rounds: int | None = None  # sequence-rounds (a batch of b running sequences counts b per step)
    accepted_tokens: int | None = None
    draft_seconds: float | None = None
    verify_seconds: float | None = None
    step_seconds: float | None = None  # engine steps' wall time (prefill excluded)
    hit_step_seconds: float | None = None  # of which steps where every row hit the SSD cache
    counters: dict[str, int] = field(default_factory=dict)  # mode-specific counts, summed per run
    gauges: dict = field(default_factory=dict)  # mode-specific live figures after the call (SSD)


@dataclass(frozen=True)
class BenchContext:
    """Everything a mode needs to build its runner (inside a worker)."""

    target: str
    draft: str | None
    k: int
    dtype: str
    draft_dtype: str
    device: str
    num_threads: int
    max_batch_size: int
    seed: int
    # SSD engine options of this variant (saguaro_c, ssd_budget); ignored by other modes.
    ssd_options: dict = field(default_factory=dict)
    # Options of every mode of this engine in this variant (tensor_parallel_size).
    engine_options: dict = field(default_factory=dict)


class ModeRunner(Protocol):
    def generate(self, prompts: list[str], seeds: list[int], temperature: float, max_tokens: int) -> BatchCounters: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class BenchMode:
    name: str
    description: str
    build: Callable[[BenchContext], ModeRunner]
    needs_draft: bool = True
    max_batch_size: int | None = None  # None = any batch size
    unsupported_reason: str = ""
    ssd: bool = False  # an SSD mode of this engine: --saguaro-c and --ssd-budget sweep it
    engine: bool = False  # a mode of this engine: --tensor-parallel-size sweeps it

    def supports(self, batch_size: int) -> bool:
        return self.max_batch_size is None or batch_size <= self.max_batch_size


MODES: dict[str, BenchMode] = {}


def register_mode(mode: BenchMode) -> BenchMode:
    MODES[mode.name] = mode
    return mode


class EngineRunner:
    """A mode of this project's engine (`ssd.LLM(mode=...)`)."""

    def __init__(self, ctx: BenchContext, mode: str, needs_draft: bool, **llm_kwargs) -> None:
        from ssd.llm import LLM

        # SSD's draft process (auto runs one too) takes one core of the setting's budget for itself;
        # tensor-parallel ranks share the rest.
        threads = max(1, ctx.num_threads - 1) if mode in ("ssd", "auto") else ctx.num_threads
        threads = max(1, threads // ctx.engine_options.get("tensor_parallel_size", 1))
        self.llm = LLM(
            target=ctx.target,
            draft=ctx.draft if needs_draft else None,
            mode=mode,
            k=ctx.k,
            max_num_seqs=ctx.max_batch_size,
            dtype=ctx.dtype,
            draft_dtype=ctx.draft_dtype,
            device=ctx.device,
            num_threads=threads,
            seed=ctx.seed,
            **{**llm_kwargs, **ctx.engine_options, **(ctx.ssd_options if mode in ("ssd", "auto") else {})},
        )

    def generate(self, prompts: list[str], seeds: list[int], temperature: float, max_tokens: int) -> BatchCounters:
        from ssd.core.sampling_params import SamplingParams

        params = [
            SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=s) for s in seeds
        ]
        before = self.llm.metrics()
        outputs = self.llm.generate(prompts, params)
        after = self.llm.metrics()
        rounds = after["rounds"] - before["rounds"]

        def seconds(key: str) -> float:
            # The engine reports time per (sequence-)round; totals are per-round figure x rounds.
            return (after[key] * after["rounds"] - before[key] * before["rounds"]) / 1000

        return BatchCounters(
            generated_tokens=sum(len(o.token_ids) for o in outputs),
            rounds=rounds,
            accepted_tokens=after["accepted_tokens"] - before["accepted_tokens"],
            draft_seconds=seconds("draft_ms_per_round"),
            verify_seconds=seconds("verify_ms_per_round"),
            step_seconds=after["step_seconds_total"] - before["step_seconds_total"],
            hit_step_seconds=after["hit_step_seconds_total"] - before["hit_step_seconds_total"],
            # Every integer in the engine's metrics is a counter (rounds, tokens, and whatever a
            # mode adds, e.g. cache hits): report their growth over this call.
            counters={
                key: value - before.get(key, 0)
                for key, value in after.items()
                if isinstance(value, int) and not isinstance(value, bool)
            },
            gauges={**after.get("ssd", {}), **({"auto": after["auto"]} if "auto" in after else {})},
        )

    def close(self) -> None:
        self.llm.engine.close()


def engine_mode(mode: str, needs_draft: bool = True, **llm_kwargs) -> Callable[[BenchContext], ModeRunner]:
    """A builder for `ssd.LLM(mode=mode, k=..., **llm_kwargs)`."""

    def build(ctx: BenchContext) -> ModeRunner:
        return EngineRunner(ctx, mode, needs_draft, **llm_kwargs)

    return build


# The SSD options a bench can sweep, each with the tag its rows are labelled with (" D=2 split=sequences").
SWEEP_TAGS = {
    "saguaro_c": "C",
    "ssd_budget": "B",
    "draft_workers": "D",
    "draft_transport": "tr",
    "draft_split": "split",
    "draft_worker_cpus": "cpus",
}


@dataclass(frozen=True)
class Variant:
    """One row group of the bench: a mode, with SSD options where the plan sweeps them."""

    label: str  # the mode's name, then e.g. " C=0.5 B=32" for a swept SSD mode, " tp=2" for a swept engine mode
    mode: str
    ssd_options: dict
    engine_options: dict = field(default_factory=dict)

    @property
    def record(self) -> dict:
        """What a record says about the variant besides its label."""
        out = {"base_mode": self.mode}
        out.update({key: v for key, v in self.ssd_options.items() if key in SWEEP_TAGS})
        out.update(self.engine_options)
        return out


def variants(
    modes: list[str], sweeps: dict[str, list] | None = None, tp_sizes: list[int] | None = None
) -> list[Variant]:
    """Every mode once, every SSD mode once per combination of the swept SSD options (`sweeps`:
    option -> values, options of SWEEP_TAGS), and each mode of this engine once per
    tensor-parallel size when those are swept."""
    out = _ssd_variants(modes, {key: v for key, v in (sweeps or {}).items() if v})
    if not tp_sizes:
        return out
    return [
        Variant(f"{v.label} tp={t}", v.mode, v.ssd_options, {"tensor_parallel_size": t}) if MODES[v.mode].engine else v
        for v in out
        for t in (tp_sizes if MODES[v.mode].engine else [None])
    ]


def _ssd_variants(modes: list[str], sweeps: dict[str, list]) -> list[Variant]:
    unknown = set(sweeps) - set(SWEEP_TAGS)
    assert not unknown, unknown
    keys = [key for key in SWEEP_TAGS if key in sweeps]  # labels in SWEEP_TAGS' order
    out = []
    for name in modes:
        if not MODES[name].ssd or not keys:
            out.append(Variant(name, name, {}))
            continue
        for values in itertools.product(*(sweeps[key] for key in keys)):
            options = dict(zip(keys, values))
            if options.get("draft_split") == "sequences" and options.get("draft_workers", 1) == 1:
                continue  # one worker has nothing to split
            if "ssd_budget" in options:  # a swept budget is the budget: the sizer would move it
                options["ssd_autobudget"] = False
            suffix = "".join(
                f" {SWEEP_TAGS[key]}={v}" if isinstance(v, str) else f" {SWEEP_TAGS[key]}={v:g}"
                for key, v in zip(keys, values)
            )
            out.append(Variant(name + suffix, name, options))
    return out


class HFAssistedRunner:
    """Hugging Face assisted generation: `target.generate(..., assistant_model=draft)`.

    The draft proposes a constant K tokens per round (no heuristic schedule, no confidence early
    stop) so that the comparison with `sd` is like for like. Rounds and accepted tokens are read
    by wrapping the candidate generator's `update_candidate_strategy` (called once per round with
    the number of accepted draft tokens); draft time by wrapping its `get_candidates`.
    """

    def __init__(self, ctx: BenchContext, constant_k: bool = True) -> None:
        from ssd.model.loader import load_model, load_tokenizer

        self.tokenizer = load_tokenizer(ctx.target)
        self.target = load_model(ctx.target, ctx.dtype, ctx.device)
        self.draft = load_model(ctx.draft, ctx.draft_dtype, ctx.device)
        if constant_k:
            gc = self.draft.generation_config
            gc.num_assistant_tokens = ctx.k
            gc.num_assistant_tokens_schedule = "constant"
            gc.assistant_confidence_threshold = 0.0
        self.device = ctx.device
        self._stats = {"rounds": 0, "accepted": 0, "draft_seconds": 0.0}
        self._instrument()
        pad = self.target.generation_config.pad_token_id
        if pad is None:
            pad = (
                self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
            )
        self.pad_token_id = pad

    def _instrument(self) -> None:
        stats = self._stats
        original = getattr(self.target, "_get_candidate_generator", None)
        if original is None:
            logger.warning("transformers has no _get_candidate_generator: hf-assisted reports no acceptance figures")
            return

        def get_candidate_generator(*args, **kwargs):
            generator = original(*args, **kwargs)
            update, get = generator.update_candidate_strategy, generator.get_candidates

            def update_candidate_strategy(input_ids, scores, num_matches, *a, **kw):
                stats["rounds"] += 1
                stats["accepted"] += int(num_matches)
                return update(input_ids, scores, num_matches, *a, **kw)

            def get_candidates(*a, **kw):
                t0 = time.perf_counter()
                try:
                    return get(*a, **kw)
                finally:
                    stats["draft_seconds"] += time.perf_counter() - t0

            generator.update_candidate_strategy = update_candidate_strategy
            generator.get_candidates = get_candidates
            return generator

        self.target._get_candidate_generator = get_candidate_generator

    def generate(self, prompts: list[str], seeds: list[int], temperature: float, max_tokens: int) -> BatchCounters:
        import torch

        if len(prompts) != 1:
            raise ValueError("Hugging Face assisted generation supports batch size 1 only")
        ids = self.tokenizer(prompts[0], add_special_tokens=False, return_tensors="pt").input_ids.to(self.device)
        sampling = (
            {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
            if temperature > 0
            else {"do_sample": False}
        )
        torch.manual_seed(seeds[0])
        before = dict(self._stats)
        with torch.inference_mode():
            out = self.target.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                assistant_model=self.draft,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                pad_token_id=self.pad_token_id,
                **sampling,
            )
        rounds = self._stats["rounds"] - before["rounds"]
        return BatchCounters(
            generated_tokens=int(out.shape[1] - ids.shape[1]),
            rounds=rounds or None,
            accepted_tokens=(self._stats["accepted"] - before["accepted"]) if rounds else None,
            draft_seconds=(self._stats["draft_seconds"] - before["draft_seconds"]) if rounds else None,
        )

    def close(self) -> None:
        pass


register_mode(
    BenchMode(
        "ar",
        "target only, one token per round (this engine)",
        engine_mode("ar", needs_draft=False),
        needs_draft=False,
        engine=True,
    )
)
register_mode(BenchMode("sd", "ordinary speculative decoding (this engine)", engine_mode("sd"), engine=True))
register_mode(
    BenchMode(
        "ssd",
        "speculative speculative decoding, Saguaro geometric fan-out (this engine)",
        engine_mode("ssd"),
        ssd=True,
        engine=True,
    )
)
register_mode(
    BenchMode(
        "auto",
        "each round in the fastest of ssd, sd and ar, as measured (this engine)",
        engine_mode("auto"),
        engine=True,
    )
)
register_mode(
    BenchMode(
        "ssd-marginal",
        "SSD with the marginal fan-out (integer optimum under the fitted miss law, this engine)",
        engine_mode("ssd", ssd_fanout="marginal"),
        ssd=True,
        engine=True,
    )
)
register_mode(
    BenchMode(
        "ssd-uniform",
        "SSD with uniform fan-out (this engine)",
        engine_mode("ssd", ssd_fanout="uniform"),
        ssd=True,
        engine=True,
    )
)
for _name, _constant, _what in (
    ("hf-assisted", True, "constant K, like sd"),
    ("hf-assisted-default", False, "Hugging Face's default assistant schedule"),
):
    register_mode(
        BenchMode(
            _name,
            f"Hugging Face assisted generation (model.generate(assistant_model=draft)), {_what}",
            lambda ctx, _c=_constant: HFAssistedRunner(ctx, constant_k=_c),
            max_batch_size=1,
            unsupported_reason="Hugging Face assisted generation supports batch size 1 only",
        )
    )
