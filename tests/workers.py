"""Finding draft worker processes from tests (they are plain subprocesses, not multiprocessing children)."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

from ssd.worker.main import PROCESS_NAME


def live_draft_workers(parent: int | None = None) -> list[int]:
    """Pids of running (not zombie) draft workers whose parent is `parent` (default: this process)."""
    parent = os.getpid() if parent is None else parent
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # the process ended while we looked
            continue
        name = text[text.index("(") + 1 : text.rindex(")")]
        state, ppid = text[text.rindex(")") + 2 :].split()[:2]
        if name == PROCESS_NAME[:15] and int(ppid) == parent and state != "Z":
            found.append(int(stat.parent.name))
    return found


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
