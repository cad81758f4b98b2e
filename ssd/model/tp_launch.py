"""Starting a tensor-parallel model (the target, or a draft): rank 0 in this process, ranks
1..t-1 started by a launcher.

`start_split` has a `RankLauncher` start the other ranks (by default `LocalRanks`: processes
forked from this process's fork server, ssd/core/forked.py, which has imported torch already,
each running `run_forked_rank` with its spec; a serving layer injects one that starts them where
its scheduler reserved room). It loads rank 0's shard while they load theirs, waits until each
has joined (a dead one is reported at once, with how it ended), and builds the groups over a
TCPStore that rank 0 serves on a port the OS picks (none fixed) at the launcher's address. A
forked rank holds a lifeline from rank 0's process: it closes when that process ends, however it
ends, or when rank 0 releases it, and the rank exits then, so no rank outlives its engine.

Devices: on CPU every rank uses the CPU (gloo); on GPUs the forward's collectives run over NCCL,
and rank r uses the device `device` names plus r (device "cuda:1" with t = 2 puts ranks on cuda:1
and cuda:2), unless the launcher gives each rank a device of its own (then every rank uses
`device` as it sees it). Threads: on CPU each rank runs num_threads torch threads, by default the
cores divided among the ranks (t ranks of all the cores each would fight over them).
"""

from __future__ import annotations

import datetime
import logging
import os
import subprocess
import time
from typing import Protocol

import torch
import torch.distributed as dist

from ssd.core.forked import ForkedChild, ForkedProcess, fork
from ssd.core.threads import set_process_threads
from ssd.model.fast_forward import can_pack, unsupported_config_reason
from ssd.model.model_config import read_config
from ssd.model.runner import ModelRunner
from ssd.model.shards import ShardPlan, load_shard
from ssd.model.tensor_parallel import STEP_TIMEOUT, ShardComm, TensorParallelRunner, serve_steps

logger = logging.getLogger(__name__)

JOIN_TIMEOUT = datetime.timedelta(minutes=15)  # loading a large shard takes minutes
RANK_NAME = "ssd-tp-rank"  # what `ps -e` shows for a forked rank


class RankGroup(Protocol):
    """Ranks 1..t-1 of one target, as a launcher started them."""

    def poll(self) -> dict[int, str]:
        """rank -> how it ended, of the ranks that ended (without waiting)."""

    def describe(self) -> str:
        """The ranks that ended and how, for an error message."""

    def close(self, kill: bool) -> None:
        """Stop the ranks and wait for them; kill=True: at once, else after rank 0 sent STOP."""


class RankLauncher(Protocol):
    """Starts ranks 1..t-1 of a tensor-parallel target. host: the address rank 0's store and
    collectives listen on, reachable from every rank; one_device_each: every rank sees only the
    device reserved for it (so each uses `device` as named, not `device` plus its rank)."""

    host: str
    one_device_each: bool

    def start(self, spec: dict) -> RankGroup:
        """Start ranks 1..spec["world"]-1; each runs `run_rank(spec with its rank, its own address)`."""


def rank_device(spec: dict, rank: int) -> torch.device:
    base = torch.device(spec["device"])
    if base.type == "cpu" or spec["one_device_each"]:
        return base
    return torch.device(base.type, (base.index or 0) + rank)


def _groups(store: dist.Store, rank: int, world: int, device: torch.device, host: str):
    """(control, data): a gloo group for the steps; the forward's collectives on the same group on
    CPU, on an NCCL group of their own on GPUs. host: this rank's own address."""
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    opts._timeout = JOIN_TIMEOUT
    control = dist.ProcessGroupGloo(dist.PrefixStore("control", store), rank, world, opts)
    if device.type == "cpu":
        return control, control
    nccl = dist.ProcessGroupNCCL.Options()
    nccl._timeout = STEP_TIMEOUT
    return control, dist.ProcessGroupNCCL(dist.PrefixStore("data", store), rank, world, nccl)


def _runner(
    spec: dict, rank: int, store: dist.Store, config, host: str, ranks: RankGroup | None = None
) -> tuple[ModelRunner, ShardComm]:
    """Load this rank's shard, join the groups -> its ModelRunner and communicator. host: this
    rank's own address; ranks: on rank 0, the others, waited for before joining (a rank that ended
    is reported instead of waited for)."""
    world = spec["world"]
    device = rank_device(spec, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL's collectives run on the current device
    plan = ShardPlan.of(config, rank, world)
    dtype = getattr(torch, spec["dtype"])
    shard = load_shard(spec["directory"], config, plan, dtype, device)
    store.set(f"joining-{rank}", "1")
    if ranks is not None:
        _await_ranks(store, ranks, world)
    control, data = _groups(store, rank, world, device, host)
    fused = spec["pack"] and can_pack(shard.model.layers[0].self_attn.q_proj.weight)
    comm = ShardComm(plan, control, data)
    return ModelRunner(shard, device, lean=True, fused=fused, parallel=comm), comm


def _await_ranks(store: dist.Store, ranks: RankGroup, world: int) -> None:
    deadline = time.monotonic() + JOIN_TIMEOUT.total_seconds()
    keys = [f"joining-{r}" for r in range(1, world)]
    while not store.check(keys):
        dead = ranks.poll()
        if dead:
            raise RuntimeError(f"tensor-parallel {ranks.describe()} before joining (its log says why)")
        if time.monotonic() > deadline:
            raise RuntimeError(f"tensor-parallel ranks did not join within {JOIN_TIMEOUT.total_seconds():.0f} s")
        time.sleep(0.05)


class LocalRanks:
    """The default launcher: ranks 1..t-1 as processes forked on this host."""

    host = "127.0.0.1"
    one_device_each = False

    def start(self, spec: dict) -> RankProcesses:
        return RankProcesses(spec)


class RankProcesses:
    """Ranks 1..t-1 as forked processes, each holding a lifeline from this one."""

    def __init__(self, spec: dict) -> None:
        self.processes: dict[int, ForkedProcess] = {}
        try:
            for rank in range(1, spec["world"]):
                self.processes[rank] = fork(run_forked_rank, ({**spec, "rank": rank},), (), RANK_NAME, (__name__,))
        except BaseException:
            self.close(kill=True)
            raise

    def poll(self) -> dict[int, str]:
        codes = {rank: p.poll() for rank, p in self.processes.items()}
        return {rank: f"exited with code {code}" for rank, code in codes.items() if code is not None}

    def describe(self) -> str:
        return describe_ended(self.poll())

    def close(self, kill: bool) -> None:
        """Stop the ranks (releasing their lifelines) and wait for them; kill=True: at once."""
        for process in self.processes.values():
            if kill:
                process.kill()
            process.release()
        for process in self.processes.values():
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)


def describe_ended(ended: dict[int, str]) -> str:
    if not ended:
        return "every rank still running"
    return ", ".join(f"rank {rank} {how}" for rank, how in sorted(ended.items()))


def size_option(role: str) -> str:
    """The option that sets a role's rank count, for errors: tensor_parallel_size for the target,
    draft_tensor_parallel_size for a draft."""
    return "tensor_parallel_size" if role == "target" else f"{role}_tensor_parallel_size"


def start_split(
    directory: str, config, world: int, dtype: str, device: str, pack: bool, num_threads: int | None,
    launcher: RankLauncher | None = None, role: str = "target",
) -> TensorParallelRunner:  # fmt: skip
    """Rank 0 of a model split over `world` ranks (config: its Hugging Face config; dtype: a
    torch dtype's name; launcher: what starts the other ranks, LocalRanks by default; role:
    "target", or "draft", whose rank 0 shares a process that set its own threads) -> the runner
    its caller calls; the other ranks are running. num_threads: each CPU rank's torch threads
    (None: the cores divided among the ranks)."""
    setting = size_option(role)
    reason = unsupported_config_reason(config)
    if reason is not None:
        raise ValueError(f"{setting}={world} runs the lean forward, which does not support this model: {reason}")
    ShardPlan.of(config, 0, world, setting)  # ValueError naming the sizes that divide the heads, before anything starts
    launcher = launcher or LocalRanks()
    threads = num_threads or max(1, (os.cpu_count() or 1) // world)
    if torch.device(device).type == "cpu" and role == "target":
        set_process_threads(threads)
    # Rank 0 serves the store; wait_for_workers=False: the ranks connect while rank 0 loads.
    store = dist.TCPStore(launcher.host, 0, world, True, JOIN_TIMEOUT, wait_for_workers=False)
    spec = {
        "directory": str(directory), "world": world, "dtype": dtype, "device": device, "pack": pack,
        "threads": threads, "store": [launcher.host, store.port], "one_device_each": launcher.one_device_each,
        "log_level": logging.getLogger("ssd").getEffectiveLevel(),
    }  # fmt: skip
    ranks = launcher.start(spec)
    try:
        runner, comm = _runner(spec, 0, store, config, launcher.host, ranks)
    except BaseException:
        ranks.close(kill=True)
        raise
    logger.info("tensor-parallel %s over %d ranks, started by %s", role, world, type(launcher).__name__)
    # The store stays referenced by the runner: rank 0 serves it for as long as the ranks run.
    return TensorParallelRunner(runner, comm, ranks, store, role)


def run_rank(spec: dict, host: str) -> None:
    """Rank spec["rank"]: load its shard, join rank 0's groups, run rank 0's steps until STOP.
    host: this rank's own address (its collectives listen there)."""
    if rank_device(spec, 0).type == "cpu":
        set_process_threads(spec["threads"])
    store_host, port = spec["store"]
    store = dist.TCPStore(store_host, port, spec["world"], False, JOIN_TIMEOUT)
    # As rank 0 read it (ssd.model.loader.load_split): without transformers' config classes where it can.
    config = read_config(spec["directory"])
    if config is None:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(spec["directory"], local_files_only=True)
    runner, comm = _runner(spec, spec["rank"], store, config, host)
    with torch.inference_mode():
        serve_steps(runner, comm)


def run_forked_rank(child: ForkedChild, spec: dict) -> int:
    """A forked rank's life (ssd.core.forked runs it, and ends it when its lifeline closes)."""
    logging.basicConfig(level=spec["log_level"], format=f"%(asctime)s tp-rank{spec['rank']} %(name)s: %(message)s")
    run_rank(spec, LocalRanks.host)
    return 0
