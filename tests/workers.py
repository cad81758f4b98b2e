"""Finding draft worker processes from tests: the fork server's children (ssd/core/forked.py), so
this process's grandchildren."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

from ssd.transport.spawn import WORKER_NAME


def processes() -> dict[int, tuple[str, str, int]]:
    """pid -> (name, state, parent pid) of every process."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # the process ended while we looked
            continue
        state, ppid = text[text.rindex(")") + 2 :].split()[:2]
        found[int(stat.parent.name)] = (text[text.index("(") + 1 : text.rindex(")")], state, int(ppid))
    return found


def live_draft_workers(ancestor: int | None = None) -> list[int]:
    """Pids of running (not zombie) draft workers that descend from `ancestor` (default: this
    process; its workers are children of its fork server)."""
    ancestor = os.getpid() if ancestor is None else ancestor
    table = processes()

    def descends(pid: int) -> bool:
        while pid in table and pid > 1:
            pid = table[pid][2]
            if pid == ancestor:
                return True
        return False

    return [
        pid for pid, (name, state, _) in table.items() if name == WORKER_NAME[:15] and state != "Z" and descends(pid)
    ]


class Proc:
    """A Python subprocess whose stdout lines arrive on a queue."""

    def __init__(self, script: str, *args) -> None:
        self.popen = subprocess.Popen(
            [sys.executable, "-c", script, *map(str, args)], stdout=subprocess.PIPE, text=True
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.popen.stdout:
            self.lines.put(line.strip())

    def line(self, timeout: float = 30) -> str:
        return self.lines.get(timeout=timeout)

    def kill(self) -> None:
        self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(10)
