"""Engine configuration: a pydantic model at the user boundary, a frozen dataclass inside."""

from __future__ import annotations

import os
import zlib
from dataclasses import make_dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from ssd.core.sampling_params import MAX_SEED

MODES = ("ar", "sd", "ssd")

# The bundled demo pair lives beside the package in the source tree (models/ at the repo root).
DEMO_MODELS_DIR = Path(__file__).resolve().parents[2] / "models"


class EngineArgs(BaseModel):
    """Everything a user sets for an engine (Python `LLM(...)`, CLI flags, Serve YAML)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    target: str | None = Field(None, description="Target model: local directory or hub id. None = bundled demo target.")
    draft: str | None = Field(
        None, description="Draft model (same vocabulary). None = bundled demo draft (when the target is the demo too)."
    )
    mode: Literal["ar", "sd", "ssd", "auto"] = Field(
        "sd",
        description="ar: target only; sd: ordinary speculative decoding; ssd: speculative "
        "speculative decoding (Saguaro); auto: each round in whichever of ssd, sd and ar gives the most "
        "tokens per second at the current batch size, as this engine measures them (ssd/engine/autopilot.py).",
    )
    auto_explore_every: int = Field(
        512,
        ge=1,
        description="mode='auto': after this many rounds, each mode not in use is measured again for "
        "auto_probe_rounds rounds, so an estimate that went stale is renewed.",
    )
    auto_probe_rounds: int = Field(
        12,
        ge=1,
        description="mode='auto': measured rounds of each probe of a mode not in use (after one warm-up round); "
        "a probe of ar takes at most 4, as its tokens per round are the batch size.",
    )
    k: int = Field(6, ge=1, le=32, description="Speculation length K: draft tokens verified per round.")
    max_num_seqs: int = Field(16, ge=1, description="Most sequences decoded together (continuous batching).")
    max_model_len: int | None = Field(
        None, ge=2, description="Context length cap; None = the smaller of the two models' limits."
    )
    kv_cache_gib: float = Field(
        1.0,
        gt=0,
        description="The most memory each KV cache (the target's, each draft's) takes at its first forward, in "
        "GiB: max_num_seqs rows of max_model_len columns (and a draft tree's scratch columns) when they fit, "
        "so that a server's memory does not grow after its first request; else as many columns as fit (at least "
        "256), and the cache grows past them (doubling, logged) when a longer sequence needs it.",
    )
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "float32", description="Weights/activations dtype; auto = the checkpoint's."
    )
    draft_dtype: Literal["auto", "float32", "float16", "bfloat16"] | None = Field(
        None,
        description="dtype of the draft alone; None = the same as dtype. The draft's precision never "
        "changes the output's "
        "distribution (verification uses the draft's probabilities as computed), only how often its guesses are "
        "accepted; bfloat16 drafts faster on CPUs with AVX512-BF16 or AMX.",
    )
    device: str = Field("cpu", description="torch device for both models, e.g. cpu, cuda, cuda:1.")
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        le=64,
        description="Ranks the target is split over (Megatron-style: attention heads and MLP columns, embedding "
        "and LM head by vocabulary; ssd/model/shards.py). Rank 0 runs in the engine's process, the others as child "
        "processes on this host: on CPU each with cores/t threads, on GPUs rank r on the device after `device` "
        "plus r. Needs a Llama-architecture target in safetensors; its head counts must divide evenly.",
    )
    draft_device: str | None = Field(None, description="torch device for the draft; None = same as device.")
    draft_tensor_parallel_size: int = Field(
        1,
        ge=1,
        le=64,
        description="Ranks the draft is split over wherever it runs (SD's draft in the engine's process, each SSD "
        "draft worker), as tensor_parallel_size splits the target: rank 0 in that process, the others its child "
        "processes; on CPU each with draft_num_threads threads, on GPUs rank r on draft_device plus r. For drafts "
        "that outgrow one device; a split draft runs eagerly (no CUDA graphs).",
    )
    num_threads: int | None = Field(
        None,
        ge=1,
        description="torch intra-op threads for this process; None = torch's default, except in SSD's rounds when "
        "SSD's draft workers run as processes on this host: then at most the cores their threads leave.",
    )
    seed: int = Field(
        0,
        ge=0,
        le=MAX_SEED,
        description="Seed in [0, 2**64 - 1] from which requests that carry no seed of their own draw theirs.",
    )
    ssd_budget: int = Field(
        16, ge=1, le=4096, description="SSD: speculation-cache budget B (branches per sequence per round)."
    )
    ssd_autobudget: bool = Field(
        True,
        description="SSD: lower B below ssd_budget while the drafter cannot build the cache within one verification.",
    )
    ssd_fanout: Literal["geometric", "marginal", "uniform"] = Field(
        "geometric",
        description="SSD: fan-out over the outcomes (0..K tokens accepted): Saguaro's geometric (Theorem 12, "
        "rounded), marginal (the integer optimum under the fitted miss law with its intercept), or uniform.",
    )
    saguaro_c: float = Field(
        1.0, ge=0.0, le=1.0, description="SSD: Saguaro sampling constant C in [0, 1]; 1 = plain sampling."
    )
    ssd_backup: Literal["auto", "neural", "fast"] = Field(
        "auto", description="SSD: backup speculator on a miss; auto picks by batch size (threshold b*)."
    )
    ssd_reproducible: bool = Field(
        False,
        description="SSD: a seeded request's output depends only on its prompt, sampling parameters and seed, never on "
        "timing, batch mates or earlier requests. Trees are always built to depth K (the target waits for the "
        "whole build instead of cutting it short), the budget stays at ssd_budget (no autobudget), the backup "
        "stays fixed (auto becomes neural) and the geometric fan-out uses the prior acceptance and miss-exponent "
        "estimates instead of learned ones. Slower; the output's distribution is exact either way.",
    )
    draft_transport: Literal["shm", "gloo", "torch", "grpc", "inprocess"] = Field(
        "shm",
        description="SSD: how the target reaches its draft workers. shm (default): worker processes "
        "on this host, started by "
        "the engine, over shared-memory mailboxes polled by both sides (a message in microseconds). gloo: the "
        "same processes over a torch.distributed gloo pair group on a private FileStore. torch: workers that "
        "listen on a port of their own (a TCPStore rendezvous, then a pair group: gloo on CPU, NCCL on GPUs), on "
        "this host or, as Ray actors, anywhere. grpc: the same over a gRPC bidirectional stream. inprocess: the "
        "drafter in the engine's own thread (no overlap with verification; tests and debugging).",
    )
    draft_split: Literal["auto", "outcomes", "sequences"] = Field(
        "auto",
        description="SSD with draft_workers > 1: how the workers share the work. outcomes: every worker drafts every "
        "sequence and builds its shard of each round's tree (the tree covers draft_workers x ssd_budget "
        "branches, so more outcomes hit). sequences: each worker drafts its own sequences with whole trees of "
        "ssd_budget branches (each build is smaller, the hit rate stays that of one worker); for large batches, "
        "where one worker cannot build every sequence's tree within a verification. auto (default): each SSD "
        "round in whichever split gives the most tokens per second at the current batch size, as this engine "
        "measures them (ssd/engine/split_policy.py).",
    )
    draft_launcher: Literal["auto", "process", "ray"] = Field(
        "auto",
        description="SSD: who starts the draft workers. process: this process starts them as child processes on "
        "this host (restarting any that die). ray: Ray actors leased from a shared pool and placed by Ray's "
        "scheduler, through the worker provider the engine is given (LLM(worker_provider=...); ssd serve passes "
        "it); needs draft_transport torch or grpc. auto: the worker provider when one is given and the transport "
        "is torch or grpc, else process.",
    )
    draft_worker_resources: dict | None = Field(
        None,
        description='SSD with Ray: the resources of each draft worker actor, e.g. {"num_cpus": 1, "num_gpus": 0, '
        '"resources": {"draft_node": 1}, "label_selector": {...}}, so drafts land on other nodes than targets. '
        "Default: one CPU each.",
    )
    draft_start_workers: bool = Field(
        True,
        description="SSD with Ray: start the draft worker actors this engine needs when the shared "
        "pool has fewer free ones "
        "(and stop them on close). False = only lease workers someone else started, waiting for them (the Serve "
        "app, whose draft deployment is the pool).",
    )
    draft_workers: int = Field(
        1,
        ge=1,
        le=64,
        description="SSD: D, the draft workers that share each round's speculation tree: the fan-out covers D times "
        "ssd_budget branches, each worker builds its shard (ssd_budget branches) on its own core or device, and "
        "the one whose shard holds the outcome answers. A worker that fails is replaced without stopping SSD. "
        "Not with draft_transport='inprocess'.",
    )
    draft_spin_ms: float = Field(
        50.0,
        ge=0.0,
        le=10_000.0,
        description="SSD, shm channel: how long the draft worker spins on its inbox waiting for "
        "the next message before it "
        "blocks in the kernel. Spinning answers an outcome microseconds after it arrives; blocking frees the "
        "worker's core and costs a wake-up.",
    )
    draft_num_threads: int = Field(1, ge=1, description="SSD: torch threads of the draft process.")
    draft_worker_cpus: Literal["shared", "pinned"] = Field(
        "shared",
        description="SSD, draft workers this engine forks (draft_launcher process): shared (default) lets the OS "
        "place them; pinned runs each on cores of its own among them (draft_tensor_parallel_size x "
        "draft_num_threads, the highest of the cores this process may use, at least one left below them), so a "
        "worker keeps its caches. The target's own placement is unchanged (its threads leave the workers' cores: "
        "num_threads); engines in one process pin theirs to the same cores.",
    )
    draft_deadline_s: float = Field(
        30.0, gt=0, description="SSD: seconds the target waits for a drafter reply before going on without it."
    )
    lean_forward: bool = Field(
        True,
        description="Run Llama-architecture models (llama, qwen2, mistral without sliding window) "
        "through the built-in lean "
        "forward: the same math as Hugging Face's, with less Python per call (the draft also fuses its "
        "projections into fewer, prepacked products). False = always the Hugging Face forward.",
    )
    pack_target_weights: bool = Field(
        True,
        description="With the lean forward: run the target's projections that read one input (q, k, v; gate, up) "
        "as fused products. On CPU on weights prepacked for oneDNN (about 2x faster verification of a few tokens; "
        "one extra copy of the projection weights); off CPU in place (the weights become views of the fused ones: "
        "no copy; a tensor-parallel target's ranks fuse on CPU only). Logits differ from Hugging Face's in the "
        "last bits, as with any optimized kernel. False = Hugging Face's products, bit-identical to Hugging Face.",
    )
    enforce_eager: bool = Field(
        False,
        description="Run every forward eagerly. By default, on a CUDA device, the lean forward of few-token "
        "steps (decoding, verification, the draft's steps) replays CUDA graphs captured per batch-size, "
        "token-count and attention-width bucket the first time each is met; prefills stay eager.",
    )
    trust_remote_code: bool = Field(False, description="Allow custom model code from the checkpoint (Hugging Face).")
    logprobs_mode: Literal["raw", "processed"] = Field(
        "raw",
        description="Which distribution a request's logprobs are from: raw (the model's own, log_softmax of "
        "its logits, as OpenAI and vLLM report) or processed (after the request's temperature, top-k and top-p, "
        "the distribution each token was drawn from).",
    )

    def to_config(self) -> "EngineConfig":
        """The engine's frozen configuration: every field as given, the derived ones resolved here
        (and nowhere else): the demo pair's paths, the draft's dtype and device, and what
        ssd_reproducible fixes."""
        if self.target is None and self.draft is not None:
            raise ValueError("draft was given without target: pass target too (or neither for the demo pair)")
        demo = self.target is None
        target = str(DEMO_MODELS_DIR / "target") if demo else self.target
        draft = str(DEMO_MODELS_DIR / "draft") if demo else self.draft
        if self.mode != "ar" and draft is None:
            raise ValueError(f"mode={self.mode!r} needs a draft model: pass draft=... or use mode='ar'")
        if self.draft_launcher == "ray" and self.draft_transport not in CONNECTABLE_TRANSPORTS:
            raise ValueError(
                "draft_launcher='ray' places workers on any node: use draft_transport='torch' or 'grpc', not "
                f"{self.draft_transport!r}"
            )
        if self.draft_workers > 1 and self.draft_transport == "inprocess":
            raise ValueError(
                f"draft_workers={self.draft_workers} needs workers of their own: use the default "
                "draft_transport, not 'inprocess'"
            )
        gpus = (self.draft_worker_resources or {}).get("num_gpus") or 0
        if self.draft_tensor_parallel_size > 1 and 0 < gpus < self.draft_tensor_parallel_size:
            raise ValueError(
                f"draft_tensor_parallel_size={self.draft_tensor_parallel_size} runs each draft worker's ranks on "
                f"GPUs of its own, and draft_worker_resources reserves {gpus}: reserve num_gpus >= "
                f"{self.draft_tensor_parallel_size} per worker, or lower draft_tensor_parallel_size"
            )
        derived = {
            "target": target,
            "draft": draft if self.mode != "ar" else None,
            "draft_dtype": self.draft_dtype or self.dtype,
            "draft_device": self.draft_device or self.device,
            # Reproducible runs keep everything that follows wall-clock timings or the history
            # of other requests fixed (the worker also stops cutting trees short).
            "ssd_autobudget": self.ssd_autobudget and not self.ssd_reproducible,
            "ssd_backup": "neural" if self.ssd_reproducible and self.ssd_backup == "auto" else self.ssd_backup,
        }
        return EngineConfig(**{**self.model_dump(), **derived})


# Transports a worker listens on, so that a target anywhere can connect (what Ray-placed workers use).
CONNECTABLE_TRANSPORTS = ("torch", "grpc")


class _Resolved:
    """What EngineConfig adds to EngineArgs' fields: the type of each field that to_config resolves
    (declared here, once: never None once resolved), and the values that follow from several fields."""

    target: str  # the bundled demo target's directory when none was given
    draft_dtype: str  # dtype when none was given
    draft_device: str  # device when none was given

    @property
    def draft_in_engine(self) -> bool:
        """Whether the engine's own process runs the draft: SD's draft (modes sd and auto), or
        SSD's drafter in the engine's thread. SSD's draft workers load their own."""
        return self.draft is not None and (self.mode in ("sd", "auto") or self.draft_transport == "inprocess")

    def threads_beside_workers(self, cpus: int) -> int:
        """The most torch threads the engine's process may use on a host whose cores it shares
        with this engine's draft workers, when num_threads is unset: what the workers' threads
        leave of cpus, split as among the target's ranks, at least one. Left at torch's default
        the target takes every core while each worker drafts or spins on one: on 2 cores an SSD
        round at batch 2 took 3x as long."""
        busy = self.draft_workers * self.draft_tensor_parallel_size * self.draft_num_threads
        return max(1, (cpus - busy) // self.tensor_parallel_size)

    def draft_cpu_sets(self, cpus: list[int]) -> list[tuple[int, ...]]:
        """The cores each forked draft worker is pinned to, one set per worker of the D, taken
        from `cpus` (the cores this process may use) from the highest down; [] when the workers
        are shared (the OS places them)."""
        if self.draft_worker_cpus == "shared":
            return []
        per = self.draft_tensor_parallel_size * self.draft_num_threads
        need = self.draft_workers * per
        if need >= len(cpus):
            raise ValueError(
                f"draft_worker_cpus='pinned' gives {self.draft_workers} draft worker(s) {per} core(s) each and the "
                f"target at least one, {need + 1} in all; this process may use {len(cpus)}: lower draft_workers, "
                "draft_num_threads or draft_tensor_parallel_size, or set draft_worker_cpus to 'shared'"
            )
        top = sorted(cpus)[-need:]
        return [tuple(top[i * per : (i + 1) * per]) for i in range(self.draft_workers)]

    @property
    def kv_cache_bytes(self) -> int:
        """kv_cache_gib in bytes: what each KV cache may take at its first forward."""
        return int(self.kv_cache_gib * 2**30)

    @property
    def first_split(self) -> str:
        """The split SSD's draft workers start in: draft_split, or outcomes when auto chooses."""
        return "outcomes" if self.draft_split == "auto" else self.draft_split

    def tree_shards(self, split: str) -> int:
        """Workers that share one sequence's speculation tree in `split`: D when they split the
        outcomes, 1 when each drafts whole trees of its own sequences. The tree covers
        tree_shards x ssd_budget branches (ssd_budget is one worker's share, what the budget
        sizer sizes)."""
        return self.draft_workers if split == "outcomes" else 1


def _config_fields() -> list[tuple[str, object]]:
    """EngineConfig's fields: EngineArgs' own, in their order, with the resolved types of _Resolved."""
    resolved = _Resolved.__annotations__
    return [(name, resolved.get(name, field.annotation)) for name, field in EngineArgs.model_fields.items()]


if TYPE_CHECKING:  # what a type checker sees: EngineArgs' fields, the resolved ones with their types

    class EngineConfig(_Resolved, EngineArgs):
        pass

else:
    # Generated from EngineArgs, so that no field is declared twice.
    EngineConfig = make_dataclass(
        "EngineConfig",
        _config_fields(),
        bases=(_Resolved,),
        frozen=True,
        namespace={
            "__module__": __name__,
            "__doc__": "EngineArgs resolved (EngineArgs.to_config): the same fields, none of them None that has "
            "a derived value. It travels to draft worker processes as a dict (dataclasses.asdict).",
        },
    )


def available_cpus() -> int:
    """How many cores this process may run on."""
    return len(cpu_ids())


def cpu_ids() -> list[int]:
    """The cores this process may run on, in order."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def fingerprint(*parts) -> int:
    """A 31-bit digest of `parts` (their repr): what ties two ends of a channel together."""
    return zlib.crc32(repr(parts).encode()) & 0x7FFF_FFFF


def config_fingerprint(config: EngineConfig, vocab: int) -> int:
    """Ties both ends of a drafter channel to one configuration: a message from a worker of
    another draft model, K, dtype, C or vocabulary is refused."""
    return fingerprint(vocab, config.k, config.draft, config.draft_dtype, config.saguaro_c)
