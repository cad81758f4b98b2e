"""Draft-process startup failures are reported at once."""

from __future__ import annotations

import multiprocessing as mp
import sys
import time

import pytest

from ssd.channel import DrafterUnavailable
from ssd.draft_process import _await_worker, pair_store


def test_a_worker_that_dies_before_connecting_is_reported_at_once(tmp_path):
    """Regression: spawn() waited the whole 180 s connect timeout for a dead child."""
    process = mp.get_context("spawn").Process(target=sys.exit, args=(3,), daemon=True)
    process.start()
    started = time.monotonic()
    with pytest.raises(DrafterUnavailable, match="exited with code 3 before connecting"):
        _await_worker(pair_store(str(tmp_path)), process)
    assert time.monotonic() - started < 30
    process.join(5)
