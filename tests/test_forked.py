"""Processes forked from the fork server (ssd/core/forked.py): the child runs its target and
nothing of the caller's main module (scripts without a guard, `python -c`, stdin), exits with
the target's code, gets the descriptors it was given and its owner's environment, dies with its
owner (and the server with it), is reaped; the server holds no thread when it forks; a draft
worker's imports and its draft's load leave transformers' modeling stack out."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import forked_targets
import pytest
from workers import processes

from ssd.core import forked

TESTS = str(Path(__file__).resolve().parent)
ROOT = str(Path(__file__).resolve().parents[1])


def read_report(fd: int, timeout: float = 60) -> dict:
    with os.fdopen(fd) as lines:
        line = lines.readline()
    assert line, "the child wrote nothing"
    return json.loads(line)


def fork_report(extra: dict | None = None) -> tuple[forked.ForkedProcess, dict]:
    ours, theirs = os.pipe()
    try:
        process = forked.fork(forked_targets.report, (theirs, extra), [theirs], "ssd-fork-test", ["torch"])
    finally:
        os.close(theirs)
    return process, read_report(ours)


def test_the_child_runs_its_target_with_its_descriptors_and_the_owners_environment(monkeypatch):
    monkeypatch.setenv("SSD_FORK_TEST", "first")
    first, seen = fork_report({"n": 1})
    assert seen["n"] == 1 and seen["env"] == "first" and seen["pid"] == first.pid
    # The owner's path (this test's module is importable only through it: neither installed
    # nor on PYTHONPATH), so an uninstalled checkout's workers import it as the owner did.
    assert seen["sys_path"] == sys.path
    monkeypatch.setenv("SSD_FORK_TEST", "second")  # read at each fork, not at the server's start
    second, seen2 = fork_report({"n": 2})
    assert seen2["n"] == 2 and seen2["env"] == "second" and seen2["server"] == seen["server"]
    assert first.wait(10) == 0 and second.wait(10) == 0


def test_the_fork_server_holds_no_thread_when_it_forks():
    """Asked from an owner that runs threads and has used torch's OpenMP pool: the server, a
    fresh interpreter that imported torch (and with it numpy's OpenBLAS, whose pool shuts down
    at fork), forks with one thread."""
    script = textwrap.dedent(
        f"""
        import json, os, sys, threading, time
        sys.path.insert(0, {TESTS!r})
        import torch
        torch.set_num_threads(2)
        torch.randn(512, 512) @ torch.randn(512, 512)  # the owner's OpenMP pool is up
        threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
        import forked_targets
        from ssd.core import forked
        ours, theirs = os.pipe()
        process = forked.fork(forked_targets.report, (theirs,), [theirs], "ssd-fork-test", ["torch"])
        os.close(theirs)
        seen = json.loads(os.fdopen(ours).readline())
        seen["owner_threads"] = len(os.listdir("/proc/self/task"))
        print(json.dumps(seen))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["owner_threads"] > 1  # the owner had threads; its server does not
    assert seen["server_threads"] == 1 and seen["modules"] == ["torch"], seen


def test_exit_codes_signals_and_release():
    assert forked.fork(forked_targets.exit_with, (7,)).wait(30) == 7
    assert forked.fork(forked_targets.fail).wait(30) == 1
    killed = forked.fork(forked_targets.sleep)
    assert killed.poll() is None
    killed.kill()
    assert killed.wait(10) == -signal.SIGKILL
    released = forked.fork(forked_targets.sleep)
    released.release()  # as if its owner died
    assert released.wait(10) == 0
    with pytest.raises(subprocess.TimeoutExpired):
        forked.fork(forked_targets.sleep, (1,)).wait(0.05)


def test_an_exited_child_is_reaped():
    process = forked.fork(forked_targets.exit_with, (0,))
    assert process.wait(10) == 0
    assert process.pid not in processes()  # no zombie left: the server waited for it


def test_a_handle_nobody_holds_takes_its_child_with_it():
    """Its lifeline is closed when the handle is collected: no child is left that nobody can stop."""
    pid = forked.fork(forked_targets.sleep, (60,)).pid  # the handle is dropped at once
    assert _wait_gone([pid]) == []


GUARDLESS = """
import os, sys
sys.path.insert(0, {tests!r})
print("main module ran", flush=True)
import forked_targets
from ssd.core import forked
ours, theirs = os.pipe()
process = forked.fork(forked_targets.report, (theirs,), [theirs], "ssd-fork-test", ["forked_targets"])
os.close(theirs)
print(os.fdopen(ours).readline().strip(), flush=True)
print("exit", process.wait(30), flush=True)
"""


@pytest.mark.parametrize("how", ["script", "-c", "stdin"])
def test_the_callers_main_module_is_never_run_again(tmp_path, how):
    """A script without a `__main__` guard, `python -c` and a script on stdin: each runs once;
    neither the server nor the child imports the main module (the standard library's spawn and
    forkserver Process would run the script again in the child)."""
    source = GUARDLESS.format(tests=TESTS)
    path = tmp_path / "guardless.py"
    path.write_text(source)
    command = {
        "script": [sys.executable, str(path)],
        "-c": [sys.executable, "-c", source],
        "stdin": [sys.executable, "-"],
    }
    done = subprocess.run(
        command[how], input=source if how == "stdin" else None, capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines.count("main module ran") == 1, done.stdout
    assert json.loads(lines[1])["pid"] > 0 and lines[2] == "exit 0"


def _wait_gone(pids: list[int], timeout: float = 10) -> list[int]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        seen = processes()  # one snapshot: a process may end between two reads of /proc
        alive = [p for p in pids if p in seen and seen[p][1] != "Z"]
        if not alive:
            return []
        time.sleep(0.05)
    return alive


def test_a_child_and_the_server_die_with_their_owner():
    """The owner is killed (SIGKILL: no cleanup of its own): its child sees its lifeline close
    and exits, and the server sees its owner gone and exits."""
    script = textwrap.dedent(
        f"""
        import json, os, sys, time
        sys.path.insert(0, {TESTS!r})
        import forked_targets
        from ssd.core import forked
        ours, theirs = os.pipe()
        reporter = forked.fork(forked_targets.report, (theirs,), [theirs], "ssd-fork-test", ["forked_targets"])
        os.close(theirs)
        seen = json.loads(os.fdopen(ours).readline())
        sleeper = forked.fork(forked_targets.sleep, (120,))
        print(json.dumps([sleeper.pid, seen["server"]]), flush=True)
        time.sleep(120)
        """
    )
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        child, server = json.loads(owner.stdout.readline())
        assert processes()[child][2] == server and processes()[server][2] == owner.pid
        owner.kill()
        owner.wait(10)
        assert _wait_gone([child, server]) == []
    finally:
        owner.kill()
        owner.wait(10)


def test_a_draft_workers_imports_and_draft_load_leave_the_modeling_stack_out():
    """What a forked worker holds after loading the bundled draft, in an owner whose server
    preloads what the engine preloads: torch, none of transformers' modeling stack (it pulls in
    scipy, torch._dynamo and torch.distributed.tensor; ~2.5 s of a worker's start), nor its config
    classes, nor transformers at all."""
    script = textwrap.dedent(
        f"""
        import os, sys
        sys.path.insert(0, {TESTS!r})
        import forked_targets
        from ssd.core import forked
        from ssd.engine.proposers import FORK_PRELOAD
        ours, theirs = os.pipe()
        process = forked.fork(
            forked_targets.load_the_demo_draft, (theirs,), [theirs], "ssd-fork-test", [*FORK_PRELOAD, "forked_targets"]
        )
        os.close(theirs)
        print(os.fdopen(ours).readline().strip())
        print(process.wait(60))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=180)
    assert done.returncode == 0, done.stderr
    report, code = done.stdout.strip().splitlines()[-2:]
    assert code == "0" and json.loads(report)["modules"] == ["torch"], report
    assert json.loads(report)["config_classes"] == [] and not json.loads(report)["transformers"], report
