"""Helper processes forked from the standard library's fork server: started in milliseconds,
their imports already done.

A draft worker or a tensor-parallel rank spends seconds importing torch and the project before
it can load a model; forked from a process that has done those imports, it starts at once.
`multiprocessing`'s fork server is that process: started once per process that asks for it (a
fresh interpreter, so it holds no threads, no OpenMP pool and none of its owner's state), it
imports the modules it is told to preload and then forks a child per request, passing file
descriptors over a Unix socket, reaping each child and reporting its exit code. It outlives the
engines of its owner, so a second engine, a replacement after a crash or a test suite's hundredth
worker forks from the same warm server.

What this module adds to it (the standard library's `Process` would re-run the caller's main
module in every child, as its spawn method does: a script without a `__main__` guard, a notebook
or a Ray actor's worker script would run again):
- `fork(target, args, fds)`: the child runs `target(ForkedChild, *args)` and nothing else; its
  preparation names no main module. The fork server itself preloads no `__main__` either.
- `ForkedProcess`: subprocess.Popen's poll / wait / kill / returncode for a process that is the
  fork server's child, not ours (exit codes come from the server; signals go through a pidfd,
  so a reused pid is never hit).
- Lifetime: the child holds the read end of a lifeline pipe whose write end only its owner's
  handle holds; it exits when the owner closes it (`release()`), drops the handle or dies,
  however it dies. The child
  also asks the kernel to kill it when the fork server dies (PR_SET_PDEATHSIG: the server is
  single-threaded, so the signal follows the process), and gives up its copy of the server's
  "alive" pipe, so the server ends with its owner and not when the last child does.
- Environment: the child takes the owner's environment as it is at fork(), as a spawned
  subprocess would (variables read at import time by preloaded modules keep the server's).

Threads at fork: the server runs no thread of its own. numpy (which torch imports) loads
OpenBLAS, whose thread pool exists after the import but is shut down by OpenBLAS's own
pthread_atfork handler before each fork; torch's OpenMP pool starts at the first parallel
operation, which the server never runs. tests/test_forked.py checks the server's threads at fork.
"""

from __future__ import annotations

import ctypes
import logging
import os
import pickle
import select
import signal
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing import forkserver

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG, _PR_SET_NAME = 1, 15


def warm(preload: Sequence[str]) -> None:
    """Start this process's fork server now (if none runs), importing `preload` (module names),
    so that a later fork() finds it ready: the caller does this before loading its models, which
    then load while the server imports."""
    _set_preload(preload)
    forkserver.ensure_running()


def _set_preload(preload: Sequence[str]) -> None:
    """The server's preload list (read when it starts): `preload` and what another user of the
    fork server asked for, but never `__main__` (the standard library's default), which would
    re-run the caller's script in the server."""
    asked = getattr(forkserver._forkserver, "_preload_modules", [])
    modules = [m for m in dict.fromkeys([*preload, *asked]) if m != "__main__"]
    forkserver.set_forkserver_preload(modules)


@dataclass
class ForkedChild:
    """What a forked child's target receives. fds: the owner's descriptor numbers -> this
    process's copies (the numbers differ: they crossed a Unix socket); lifeline: the read end
    of the pipe only the owner writes to (EOF: the owner released this child or died)."""

    fds: dict[int, int]
    lifeline: int

    def owner_alive(self) -> bool:
        return not _readable(self.lifeline, 0)


def fork(
    target: Callable[..., int], args: tuple = (), fds: Sequence[int] = (), name: str = "", preload: Sequence[str] = ()
) -> ForkedProcess:
    """Fork a child of the fork server that runs `target(ForkedChild, *args)` and exits with its
    return value (1 if it raised). target and args are pickled (a module-level function, plain
    data); fds reach the child as ForkedChild.fds; name: the process's name (what `ps` shows,
    15 bytes at most). preload: modules the server imports, if it is not running yet."""
    _set_preload(preload)
    status, data = forkserver.connect_to_new_process(list(fds))
    lifeline = os.dup(data)  # its read end is the child's sentinel: EOF once every copy of `data` is closed
    try:
        with open(data, "wb", closefd=True) as pipe:
            # The preparation the standard library's child applies before our object runs:
            # path and directory, and no main module to re-run.
            pickle.dump({"sys_path": sys.path, "dir": os.getcwd(), "name": name or "forked"}, pipe)
            pickle.dump(_Child(target, args, list(fds), dict(os.environ), name), pipe)
        pid = forkserver.read_signed(status)
    except EOFError as err:
        os.close(status)
        os.close(lifeline)
        raise RuntimeError("the fork server exited before it forked the child (its stderr says why)") from err
    except BaseException:
        os.close(status)
        os.close(lifeline)
        raise
    return ForkedProcess(pid, status, lifeline)


class ForkedProcess:
    """A forked child as its owner sees it, with subprocess.Popen's poll, wait, kill and
    returncode. The fork server reaps it and reports its exit code (negative: the signal that
    killed it, as Popen gives it)."""

    def __init__(self, pid: int, status: int, lifeline: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._status = status
        self._lock = threading.Lock()  # poll() from the pool's threads and the engine's
        try:
            pidfd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:  # already gone: nothing left to signal
            pidfd = None
        # The descriptors this handle holds; closed when it is collected or released (the
        # finalizer closes what the dict holds then).
        self._fds = {"status": status, "lifeline": lifeline, **({"pidfd": pidfd} if pidfd is not None else {})}
        weakref.finalize(self, _close_all, self._fds)

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None and _readable(self._status, 0):
                self._collect()
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        with self._lock:
            if self.returncode is None:
                if not _readable(self._status, timeout):
                    raise subprocess.TimeoutExpired(f"forked process {self.pid}", timeout)
                self._collect()
            return self.returncode

    def send_signal(self, sig: int) -> None:
        pidfd = self._fds.get("pidfd")
        if self.poll() is None and pidfd is not None:
            try:
                signal.pidfd_send_signal(pidfd, sig)
            except ProcessLookupError:  # exited since poll(); its code arrives on the status pipe
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def release(self) -> None:
        """Close the child's lifeline: it exits (as when the owner dies)."""
        _close_all(self._fds, "lifeline")

    def _collect(self) -> None:
        try:
            self.returncode = forkserver.read_signed(self._status)
        except EOFError:
            # The server died before it reported: its children die with it (PR_SET_PDEATHSIG).
            self.returncode = -signal.SIGKILL
        _close_all(self._fds)  # the process is gone: no more codes, signals or lifeline


def _close_all(fds: dict[str, int], *names: str) -> None:
    """Close and forget the descriptors `names` of `fds` (all of them when none is named)."""
    for name in names or list(fds):
        fd = fds.pop(name, None)
        if fd is not None:
            os.close(fd)


def _readable(fd: int, timeout: float | None) -> bool:
    return bool(select.select([fd], [], [], timeout)[0])


class _Child:
    """What the fork server's child unpickles and runs: the standard library calls
    `_bootstrap(parent_sentinel)` and exits with its return value, without finalizing."""

    def __init__(self, target, args: tuple, parent_fds: list[int], env: dict[str, str], name: str) -> None:
        self.target, self.args, self.parent_fds, self.env, self.name = target, args, parent_fds, env, name

    def _bootstrap(self, parent_sentinel: int) -> int:
        _end_with_the_server(self.name)
        _leave_the_server_to_its_owner()
        os.environ.clear()
        os.environ.update(self.env)
        child = ForkedChild(dict(zip(self.parent_fds, forkserver.get_inherited_fds())), parent_sentinel)
        threading.Thread(target=_exit_at_eof, args=(parent_sentinel,), name="ssd-lifeline", daemon=True).start()
        try:
            code = self.target(child, *self.args)
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
        except BaseException:  # noqa: BLE001 - the child's last word, before its exit code says it failed
            logger.exception("forked %s failed", self.name or "child")
            code = 1
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        return int(code or 0)


def _end_with_the_server(name: str) -> None:
    """PR_SET_PDEATHSIG (killed when the fork server dies, and it dies with its owner) and
    PR_SET_NAME (what `ps -e`, `top` and `pgrep` show)."""
    server = os.getppid()
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if name:
            libc.prctl(_PR_SET_NAME, name.encode()[:15])
    except OSError:
        logger.warning("prctl unavailable: a forked process may outlive a killed fork server")
    if os.getppid() != server:  # the server died before the signal was asked for
        os._exit(1)


def _leave_the_server_to_its_owner() -> None:
    """Close this child's copy of the server's "alive" pipe (the standard library hands one to
    every child, so that a child may fork through the same server): with it open, a server
    whose owner died would live on as long as any child does."""
    server = forkserver._forkserver
    alive = getattr(server, "_forkserver_alive_fd", None)
    if alive is not None:
        os.close(alive)
        server._forkserver_alive_fd = None
        server._forkserver_address = None  # a fork from this child starts a server of its own


def _exit_at_eof(fd: int) -> None:
    """The lifeline: read returns b"" once the owner released this child or died."""
    while os.read(fd, 4096):
        pass
    os._exit(0)
