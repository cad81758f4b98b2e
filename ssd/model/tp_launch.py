"""Starting a tensor-parallel target: rank 0 in this process, ranks 1..t-1 as child processes.

`start_target` spawns `python -m ssd.model.tp_launch` once per other rank (its spec as one JSON
line on stdin), loads rank 0's shard while they load theirs, waits until each has joined (a dead
one is reported at once, with its exit code), and builds the groups over a FileStore in a
private directory (no port chosen, none fixed). A rank reads its spec, then watches its stdin:
the pipe closes when rank 0's process ends, however it ends, and the rank exits then, so no rank
outlives its engine.

Devices: on CPU every rank uses the CPU (gloo); on GPUs rank r uses the device `device` names
plus r (device "cuda:1" with t = 2 puts ranks on cuda:1 and cuda:2) and the forward's collectives
run over NCCL. Threads: on CPU each rank runs num_threads torch threads, by default the cores
divided among the ranks (t ranks of all the cores each would fight over them).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ssd.model.fast_forward import can_pack, unsupported_config_reason
from ssd.model.runner import ModelRunner
from ssd.model.shards import ShardPlan, load_shard
from ssd.model.tensor_parallel import STEP_TIMEOUT, ShardComm, TensorParallelRunner, serve_steps

logger = logging.getLogger(__name__)

JOIN_TIMEOUT = datetime.timedelta(minutes=15)  # loading a large shard takes minutes
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


def rank_device(device: str, rank: int) -> torch.device:
    base = torch.device(device)
    if base.type == "cpu":
        return base
    return torch.device(base.type, (base.index or 0) + rank)


def _groups(store: dist.Store, rank: int, world: int, device: torch.device):
    """(control, data): a gloo group for the steps; the forward's collectives on the same group on
    CPU, on an NCCL group of their own on GPUs."""
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    opts._timeout = JOIN_TIMEOUT
    control = dist.ProcessGroupGloo(dist.PrefixStore("control", store), rank, world, opts)
    if device.type == "cpu":
        return control, control
    nccl = dist.ProcessGroupNCCL.Options()
    nccl._timeout = STEP_TIMEOUT
    return control, dist.ProcessGroupNCCL(dist.PrefixStore("data", store), rank, world, nccl)


def _runner(
    spec: dict, rank: int, store: dist.Store, config, ranks: RankProcesses | None = None
) -> tuple[ModelRunner, ShardComm]:
    """Load this rank's shard, join the groups -> its ModelRunner and communicator. ranks: on rank
    0, the others' processes, waited for before joining (a rank that died is reported instead of
    waited for)."""
    world = spec["world"]
    device = rank_device(spec["device"], rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL's collectives run on the current device
    plan = ShardPlan.of(config, rank, world)
    dtype = getattr(torch, spec["dtype"])
    shard = load_shard(spec["directory"], config, plan, dtype, device)
    store.set(f"joining-{rank}", "1")
    if ranks is not None:
        _await_ranks(store, ranks, world)
    control, data = _groups(store, rank, world, device)
    fused = spec["pack"] and can_pack(shard.model.layers[0].self_attn.q_proj.weight)
    comm = ShardComm(plan, control, data)
    return ModelRunner(shard, device, lean=True, fused=fused, parallel=comm), comm


def _await_ranks(store: dist.Store, ranks: RankProcesses, world: int) -> None:
    deadline = time.monotonic() + JOIN_TIMEOUT.total_seconds()
    keys = [f"joining-{r}" for r in range(1, world)]
    while not store.check(keys):
        dead = ranks.poll()
        if dead:
            raise RuntimeError(f"tensor-parallel {ranks.describe()} before joining (its log says why)")
        if time.monotonic() > deadline:
            raise RuntimeError(f"tensor-parallel ranks did not join within {JOIN_TIMEOUT.total_seconds():.0f} s")
        time.sleep(0.05)


class RankProcesses:
    """Ranks 1..t-1 as child processes; each holds its stdin pipe to this process as its lifeline."""

    def __init__(self, spec: dict, store_dir: str) -> None:
        self.store_dir = store_dir
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([_PACKAGE_ROOT, *filter(None, [env.get("PYTHONPATH")])])
        self.processes: dict[int, subprocess.Popen] = {}
        try:
            for rank in range(1, spec["world"]):
                process = subprocess.Popen(
                    [sys.executable, "-m", "ssd.model.tp_launch"], stdin=subprocess.PIPE, env=env, close_fds=True
                )
                self.processes[rank] = process
                process.stdin.write((json.dumps({**spec, "rank": rank}) + "\n").encode())
                process.stdin.flush()
        except BaseException:
            self.close(kill=True)
            raise

    def poll(self) -> dict[int, int]:
        """rank -> exit code, of the ranks that exited."""
        return {rank: p.poll() for rank, p in self.processes.items() if p.poll() is not None}

    def describe(self) -> str:
        dead = self.poll()
        if not dead:
            return "every rank still running"
        return ", ".join(f"rank {rank} exited with code {code}" for rank, code in sorted(dead.items()))

    def close(self, kill: bool) -> None:
        """Stop the ranks (closing their lifelines) and wait for them; kill=True: at once."""
        for process in self.processes.values():
            if kill:
                process.kill()
            if process.stdin is not None and not process.stdin.closed:
                try:
                    process.stdin.close()
                except OSError:  # the rank already exited: its end of the pipe is gone
                    pass
        for process in self.processes.values():
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)
        shutil.rmtree(self.store_dir, ignore_errors=True)


def start_target(
    directory: str, config, world: int, dtype: str, device: str, pack: bool, num_threads: int | None
) -> TensorParallelRunner:
    """Rank 0 of a target split over `world` ranks (config: its Hugging Face config; dtype: a
    torch dtype's name) -> the runner the engine calls; the other ranks are running."""
    reason = unsupported_config_reason(config)
    if reason is not None:
        raise ValueError(
            f"tensor_parallel_size={world} runs the lean forward, which does not support this model: {reason}"
        )
    ShardPlan.of(config, 0, world)  # ValueError naming the sizes that divide the heads, before anything starts
    threads = num_threads or max(1, (os.cpu_count() or 1) // world)
    if torch.device(device).type == "cpu":
        torch.set_num_threads(threads)
    store_dir = tempfile.mkdtemp(prefix="ssd-tp-")
    spec = {
        "directory": str(directory), "world": world, "dtype": dtype, "device": device, "pack": pack,
        "threads": threads, "store": os.path.join(store_dir, "store"),
        "log_level": logging.getLogger("ssd").getEffectiveLevel(),
    }  # fmt: skip
    ranks = RankProcesses(spec, store_dir)
    try:
        store = dist.FileStore(spec["store"], world)
        store.set_timeout(JOIN_TIMEOUT)
        runner, comm = _runner(spec, 0, store, config, ranks)
    except BaseException:
        ranks.close(kill=True)
        raise
    logger.info(
        "tensor-parallel target over %d ranks (%s)", world, ", ".join(f"pid {p.pid}" for p in ranks.processes.values())
    )
    return TensorParallelRunner(runner, comm, ranks)


def _watch_lifeline() -> None:
    sys.stdin.buffer.read()  # returns at EOF: rank 0 closed the pipe or its process ended
    os._exit(0)


def _rank_main() -> None:
    from transformers import AutoConfig

    spec = json.loads(sys.stdin.buffer.readline())
    logging.basicConfig(level=spec["log_level"], format=f"%(asctime)s tp-rank{spec['rank']} %(name)s: %(message)s")
    threading.Thread(target=_watch_lifeline, name="ssd-tp-lifeline", daemon=True).start()
    if rank_device(spec["device"], 0).type == "cpu":
        torch.set_num_threads(spec["threads"])
    store = dist.FileStore(spec["store"], spec["world"])
    store.set_timeout(JOIN_TIMEOUT)
    config = AutoConfig.from_pretrained(spec["directory"], local_files_only=True)
    runner, comm = _runner(spec, spec["rank"], store, config)
    with torch.inference_mode():
        serve_steps(runner, comm)


if __name__ == "__main__":
    _rank_main()
