"""Resident memory of a local Ray Serve deployment's processes, found by the titles Ray gives
them (`ray::ServeReplica:<app>:<deployment>`, `ray::ServeController`, `ray::ProxyActor`), for
the soak run and the reliability tests. Linux only (/proc)."""

from __future__ import annotations

import re
from pathlib import Path


def serve_processes(app: str | None = None) -> dict[int, str]:
    """pid -> title of every live Serve replica (of `app`, or of every application), controller
    and proxy on this machine, without the method a busy one runs."""
    out = {}
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            title = cmdline.read_bytes().split(b"\0")[0].decode(errors="replace").strip()
        except OSError:  # exited while we looked
            continue
        # A busy actor's title names the method it runs (ray::ServeReplica:app:Ingress.handle_request()).
        title = re.split(r"[.( ]", title, maxsplit=1)[0]
        if title.startswith("ray::ServeReplica:"):
            if app is None or title.split(":")[3:4] == [app]:
                out[int(cmdline.parent.name)] = title
        elif app is None and title.startswith(("ray::ServeController", "ray::ProxyActor")):
            out[int(cmdline.parent.name)] = title
    return out


def rss_mb(pid: int) -> float | None:
    """Resident set size of pid in MiB, or None when it has exited."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def slope_mb_per_min(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, MiB) samples, in MiB per minute (0 with fewer than 2)."""
    if len(samples) < 2:
        return 0.0
    n = len(samples)
    mt = sum(t for t, _ in samples) / n
    mm = sum(m for _, m in samples) / n
    var = sum((t - mt) ** 2 for t, _ in samples)
    if var == 0:
        return 0.0
    return 60 * sum((t - mt) * (m - mm) for t, m in samples) / var
