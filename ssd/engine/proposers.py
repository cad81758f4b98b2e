"""The engine's proposers for its mode: none (ar), the SD proposer, SSD's, or both (auto). SSD's
drafter is in this thread (draft_transport="inprocess") or a pool of workers from a worker provider.

The provider is injected: `worker_provider(config, vocab) -> WorkerProvider` is what the caller
passes (LLM(worker_provider=...); the serving package passes its Ray one). Without one, the
engine forks worker processes of its own (ssd/transport/spawn.py) running the worker package's
entry point, from a fork server that has imported what they import; the engine factory
(ssd/engine/factory.py) starts that server before loading the models (`warm_fork_server`), so
that it imports while they load.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from ssd.core.config import CONNECTABLE_TRANSPORTS, EngineConfig, available_cpus
from ssd.core.forked import warm
from ssd.core.proposer import Proposer
from ssd.drafting.build import build_tree_drafter, config_draft_runner
from ssd.drafting.sd_proposer import SDProposer
from ssd.drafting.ssd_proposer import SSDProposer
from ssd.transport.link import WorkerProvider
from ssd.transport.pool_client import PoolClient
from ssd.transport.spawn import SpawnedWorkers
from ssd.worker.main import run_forked

# (engine config, the target's vocabulary size) -> where the draft pool gets its workers.
WorkerProviderFactory = Callable[[EngineConfig, int], WorkerProvider]

logger = logging.getLogger(__name__)

# What the fork server imports once for every process it forks: a draft worker's modules (its
# entry point, its channel, the lean loader through the drafter) and a tensor-parallel rank's.
# Nothing of transformers: a Llama-family checkpoint's config is read without its config classes
# (ssd/model/model_config.py) and a worker never reads its draft's generation config
# (ssd/model/lean_model.py); the server's start is on the critical path of an SSD engine's.
FORK_PRELOAD = ("ssd.worker.main", "ssd.transport.shm_channel", "ssd.model.tp_launch")


def warm_fork_server(config: EngineConfig, given: WorkerProviderFactory | None, rank_launcher=None) -> bool:
    """Start this process's fork server now where the engine of `config` will fork helper
    processes (draft workers, see resolve_provider; tensor-parallel ranks without a launcher of
    the caller's): what a caller does before loading the models, which then load while the
    server imports. -> whether it did. Refuses a layout NCCL cannot run before anything starts."""
    workers = workers_on_this_host(config, given)
    if workers:
        _refuse_nccl_on_one_gpu(config)
    ranks = rank_launcher is None and config.tensor_parallel_size > 1
    draft_ranks = config.draft_tensor_parallel_size > 1 and (workers or config.draft_in_engine)
    if not (workers or ranks or draft_ranks):
        return False
    warm(FORK_PRELOAD)
    return True


def workers_on_this_host(config: EngineConfig, given: WorkerProviderFactory | None) -> bool:
    """Whether the engine's SSD drafts in worker processes it starts on this host."""
    if config.mode not in ("ssd", "auto") or config.draft_transport == "inprocess":
        return False
    return config.draft_launcher != "ray" and _spawns(config, given)


def round_threads(config: EngineConfig, given: WorkerProviderFactory | None, default: int) -> dict[str, int]:
    """This process's torch threads for a round of each mode, where they change with the mode:
    num_threads unset and SSD's draft workers on this host's cores. SSD's rounds leave the workers
    the cores their threads use (left at every core, the target's threads and the workers' took
    turns: on 2 cores an SSD round at batch 2 took 3x as long); sd's and ar's, which mode auto
    runs while the workers wait blocked, take `default` (the process's threads before the engine:
    torch's default, OMP_NUM_THREADS or the caller's setting), which SSD's never exceed."""
    if config.num_threads is not None or not workers_on_this_host(config, given):
        return {}
    return {"ssd": min(default, config.threads_beside_workers(available_cpus())), "sd": default, "ar": default}


def build_proposers(
    config: EngineConfig,
    draft_model,
    vocab: int,
    max_model_len: int,
    worker_provider: WorkerProviderFactory | None = None,
) -> dict[str, Proposer]:
    """The proposer of every mode the engine may run a round in (ar has none): auto runs both.
    max_model_len: the longest sequence the engine admits (what the draft caches are sized for)."""
    modes = ("ssd", "sd") if config.mode == "auto" else (config.mode,)
    assert draft_model is not None or not config.draft_in_engine, "the pair was loaded without the draft's weights"
    proposers: dict[str, Proposer] = {}
    if "sd" in modes:
        runner = config_draft_runner(config, draft_model)
        proposers["sd"] = SDProposer(runner, vocab, config.max_num_seqs, max_model_len, config.kv_cache_bytes)
    if "ssd" in modes:
        proposers["ssd"] = _ssd_proposer(config, draft_model, vocab, max_model_len, worker_provider)
    return proposers


def _ssd_proposer(config: EngineConfig, draft_model, vocab: int, max_model_len: int, worker_provider) -> SSDProposer:
    if config.draft_transport == "inprocess":
        return SSDProposer(build_tree_drafter(config, draft_model, vocab, max_model_len), config, vocab)
    provider = resolve_provider(config, worker_provider)(config, vocab)
    return SSDProposer(PoolClient(provider, config.draft_workers, config.first_split), config, vocab)


def resolve_provider(config: EngineConfig, given: WorkerProviderFactory | None) -> WorkerProviderFactory:
    """config.draft_launcher, resolved: process -> worker processes of this one; ray -> the given
    provider (required); auto -> the given provider when there is one and the transport can cross
    hosts, else processes."""
    if config.draft_launcher == "ray" and given is None:
        raise ValueError(
            "draft_launcher='ray' needs a worker provider that leases Ray actors: pass worker_provider=... "
            "(the serving package's Ray layer provides one), or use draft_launcher='process'"
        )
    if not _spawns(config, given):
        return given
    _refuse_nccl_on_one_gpu(config)
    _warn_on_a_shared_gpu_without_mps(config)
    return lambda cfg, vocab: SpawnedWorkers(cfg, vocab, run_forked, FORK_PRELOAD)


def _gpu(device: str) -> str | None:
    """The GPU a device names ("cuda" and "cuda:0" name one), or None for another kind."""
    kind, _, index = device.partition(":")
    return f"cuda:{index or 0}" if kind == "cuda" else None


def _refuse_nccl_on_one_gpu(config: EngineConfig) -> None:
    """The torch transport joins the target and each spawned worker over NCCL on a CUDA device,
    and NCCL refuses two ranks on one GPU (ncclInvalidUsage, seen on the one-GPU H100 machine)."""
    shared = _gpu(config.device)
    if config.draft_transport == "torch" and shared is not None and shared == _gpu(config.draft_device):
        raise ValueError(
            f"draft_transport='torch' joins the target and each draft worker over NCCL, which refuses two "
            f"processes on one GPU ({shared}): put the draft on another GPU (draft_device), or use "
            "draft_transport 'shm' or 'grpc'"
        )


def mps_running() -> bool:
    """Whether a CUDA MPS control daemon serves this machine's processes: its pipe directory
    (CUDA_MPS_PIPE_DIRECTORY, by default /tmp/nvidia-mps) holds its control pipe."""
    return os.path.exists(os.path.join(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"), "control"))


def _warn_on_a_shared_gpu_without_mps(config: EngineConfig) -> None:
    """Spawned draft workers on the target's GPU are other processes: without MPS the GPU
    time-slices between processes, so a worker's tree decode runs only between the target's
    kernels (docs/gpu.md, one H200, demo pair: SSD at 0.37x SD without MPS, 0.67x with it). A
    warning, not an error: the output is exact either way."""
    shared = _gpu(config.device)
    if shared is None or shared != _gpu(config.draft_device) or mps_running():
        return
    logger.warning(
        "SSD's draft workers share %s with the target, and no CUDA MPS daemon is running: the GPU "
        "time-slices between their processes, which starves the workers' trees. Start MPS before the engine "
        "(nvidia-cuda-mps-control -d), or put the draft on another GPU (draft_device), or compare with mode='sd'",
        shared,
    )


def _spawns(config: EngineConfig, given: WorkerProviderFactory | None) -> bool:
    """Whether the engine starts its draft workers as processes of its own (else: given's)."""
    connectable = config.draft_transport in CONNECTABLE_TRANSPORTS
    return not (given is not None and config.draft_launcher != "process" and connectable)
