"""Targets that tests fork through ssd/core/forked.py (a child runs a module-level function of
an importable module; this one imports nothing heavy, so a child reports what its fork server
had imported)."""

from __future__ import annotations

import json
import os
import sys
import time


def report(child, fd: int, extra: dict | None = None) -> int:
    """Write what this child sees as one JSON line to the owner's descriptor `fd`."""
    server = os.getppid()
    seen = {
        "pid": os.getpid(),
        "server": server,
        "server_threads": len(os.listdir(f"/proc/{server}/task")),
        "modules": sorted(
            m for m in ("torch", "transformers.modeling_utils", "scipy", "torch._dynamo") if m in sys.modules
        ),
        "env": os.environ.get("SSD_FORK_TEST"),
        "sys_path": sys.path,
        **(extra or {}),
    }
    with os.fdopen(child.fds[fd], "w") as out:
        out.write(json.dumps(seen) + "\n")
    return 0


def exit_with(child, code: int) -> int:
    return code


def fail(child) -> int:
    raise ValueError("a target that raised")


def sleep(child, seconds: float = 60) -> int:
    time.sleep(seconds)
    return 0


def load_the_demo_draft(child, fd: int) -> int:
    """Load the bundled draft as a draft worker does, then report which modules that imported."""
    from ssd.core.config import EngineArgs
    from ssd.model.demo_models import VOCAB_SIZE
    from ssd.worker.main import load_drafter

    load_drafter(EngineArgs(mode="ssd").to_config(), VOCAB_SIZE)
    # transformers' config classes (and torch.distributed.tensor, which they import): a
    # Llama-family checkpoint's config is read without them (ssd/model/model_config.py).
    classes = (
        "torch.distributed.tensor",
        "transformers.configuration_utils",
        "transformers.models.auto.configuration_auto",
    )
    # Nor transformers at all: a worker never reads its draft's generation config (lean_model.py).
    found = {"config_classes": [m for m in classes if m in sys.modules], "transformers": "transformers" in sys.modules}
    return report(child, fd, found)


def neighbour_board_worker(child, spec: dict) -> int:
    """A draft worker with the same bug on its board only (ssd/transport/shm_board.py): each depth
    is published with the distributions of the neighbouring branch, its replies stay right."""
    import ssd.transport.shm_board
    from ssd.worker.main import run_forked

    add = ssd.transport.shm_board.BoardWriter.add

    def neighbours_add(self, d, tokens, probs):
        return add(self, d, tokens, None if probs is None else probs.roll(1, dims=1))

    ssd.transport.shm_board.BoardWriter.add = neighbours_add  # in this worker process only
    return run_forked(child, spec)


def neighbour_branch_worker(child, spec: dict) -> int:
    """A draft worker with a plausible indexing bug, for the sampling check's power test: on a
    hit, the cached tokens travel with the draft probabilities of the neighbouring branch."""
    import ssd.drafting.tree_drafter
    from ssd.worker.main import run_forked

    resolve = ssd.drafting.tree_drafter.TreeDrafter.resolve

    def neighbours_resolve(self, msg):
        if self.round is not None:  # branch n gets n-1's (rows kept dense or sparse alike)
            probs = self.round.probs
            probs.values = [v.roll(1, dims=0) for v in probs.values]
            probs.indices = [i if i is None else i.roll(1, dims=0) for i in probs.indices]
            probs._dense = {r: [d.roll(1, dims=0) for d in depths] for r, depths in probs._dense.items()}
        return resolve(self, msg)

    ssd.drafting.tree_drafter.TreeDrafter.resolve = neighbours_resolve  # in this worker process only
    return run_forked(child, spec)
