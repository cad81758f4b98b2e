"""Graceful drain of one application: new generations refused with 503, the ones in flight
finished, then the shutdown.

Serve's own `serve.shutdown()` stops the proxies at once, which cuts every open stream. So
`ssd serve`, on SIGTERM or Ctrl-C, first marks the application draining in its DrainBoard (a
named actor); every ingress replica reports its in-flight count to the board a few times a
second and learns the flag in the same call. Draining, an ingress refuses new generations (HTTP
503 with Retry-After, gRPC UNAVAILABLE) and reports unhealthy on /health, so a load balancer
stops sending; `ssd serve` waits until nothing is in flight (see the invariant below), or the
drain timeout passes, and only then shuts Serve down.

The board is detached (an ingress replica creates it on first report, and replicas come and
go) and takes no CPU. Invariant: an ingress admits nothing once it has seen the flag, and every
report says whether its sender had seen the flag before sending; the drain ends only when every
replica that reports has sent a report after seeing the flag and those counts are all 0, so a
generation admitted just before the flag arrived is waited for.
"""

from __future__ import annotations

import asyncio
import logging
import time

import ray

logger = logging.getLogger(__name__)

BOARD_NAMESPACE = "ssd"
# How often an ingress replica reports (and so how soon it sees the flag), and how often the
# driver's drain reads the board.
REPORT_PERIOD_S = 0.25


def board_name(app_name: str) -> str:
    return f"ssd-drain-{app_name}"


@ray.remote(num_cpus=0)
class DrainBoard:
    """The drain flag of one application and the in-flight count of each of its ingress replicas."""

    def __init__(self) -> None:
        self.draining = False
        self.inflight: dict[str, tuple[int, bool, float]] = {}  # replica -> (count, had seen the flag, when)
        self.owner = ""  # the `ssd serve` whose deploy is the application's current one

    def report(self, replica: str, inflight: int, saw_flag: bool) -> bool:
        """An ingress replica's count, and whether it had seen the flag when it counted;
        -> whether the application is draining."""
        self.inflight[replica] = (inflight, saw_flag, time.monotonic())
        return self.draining

    def start_draining(self) -> None:
        self.draining = True

    def reset(self, owner: str = "") -> None:
        """Serving again, deployed by `owner` (a new `ssd serve`, on a cluster whose last drain
        left the board or whose running application it replaces)."""
        self.draining = False
        self.inflight.clear()
        self.owner = owner

    def deployed_by(self) -> str:
        return self.owner

    def left(self, fresh_s: float = 5.0) -> int | None:
        """In-flight generations over the replicas that reported within fresh_s (one that stopped
        reporting is gone, and so are its streams), or None while one of them has not yet
        reported after seeing the flag (it may have admitted more)."""
        now = time.monotonic()
        fresh = [(count, saw) for count, saw, when in self.inflight.values() if now - when <= fresh_s]
        if not all(saw for _, saw in fresh):
            return None
        return sum(count for count, _ in fresh)


def get_board(app_name: str):
    return DrainBoard.options(
        name=board_name(app_name), namespace=BOARD_NAMESPACE, get_if_exists=True, lifetime="detached"
    ).remote()


class DrainReporter:
    """An ingress replica's side: counts its generations in flight and keeps `draining` current."""

    def __init__(self, app_name: str, replica: str) -> None:
        self.app_name, self.replica = app_name, replica
        self.inflight = 0
        self.draining = False
        self._task: asyncio.Task | None = None

    async def ensure_started(self) -> None:
        """Report once now (so the flag is known before the first admission), then every
        REPORT_PERIOD_S in the background. Called from the replica's event loop."""
        if self._task is None:
            board = await self._report(None)
            if self._task is None:
                self._task = asyncio.get_running_loop().create_task(self._run(board))

    async def _report(self, board):
        try:
            board = board or get_board(self.app_name)
            saw = self.draining  # read before the count: admissions stop once it is True
            self.draining = await board.report.remote(self.replica, self.inflight, saw)
            return board
        except ray.exceptions.RayError as err:  # the board was removed: make a new one next time
            logger.warning("drain board of %s unreachable: %s", self.app_name, type(err).__name__)
            return None

    async def _run(self, board) -> None:
        while True:
            await asyncio.sleep(REPORT_PERIOD_S)
            board = await self._report(board)


def drain(app_name: str, timeout_s: float) -> tuple[int | None, float]:
    """Mark the application draining and wait until nothing is in flight or timeout_s passes
    (from the driver, before serve.shutdown()). -> (generations still in flight, None if not
    every ingress replica had confirmed the flag; seconds waited)."""
    board = get_board(app_name)
    started = time.monotonic()
    ray.get(board.start_draining.remote())
    while True:
        left = ray.get(board.left.remote())
        if left == 0 or time.monotonic() - started >= timeout_s:
            return left, time.monotonic() - started
        time.sleep(REPORT_PERIOD_S)


def reset_board(app_name: str, owner: str) -> None:
    """Before `owner` (one `ssd serve`) deploys the application: the board exists, marks it the
    current deploy's, and clears what an earlier drain left (its process was killed before it
    could remove the board), so the new ingress replicas do not start draining."""
    ray.get(get_board(app_name).reset.remote(owner))


def deployed_by(app_name: str) -> str | None:
    """The owner of the application's current deploy (reset_board), None without a board."""
    try:
        board = ray.get_actor(board_name(app_name), namespace=BOARD_NAMESPACE)
    except ValueError:  # none: never deployed through `ssd serve`, or removed
        return None
    try:
        return ray.get(board.deployed_by.remote())
    except ray.exceptions.RayActorError:  # being removed: ray.kill returns before the name is gone
        return None


def remove_board(app_name: str, wait_s: float = 10.0) -> None:
    """Kill the application's board and wait (up to wait_s) until its name is free: ray.kill
    returns before the actor is gone, and meanwhile a deploy's reset_board (get_if_exists) would
    be handed the dying board and deployed_by would still read it."""
    try:
        ray.kill(ray.get_actor(board_name(app_name), namespace=BOARD_NAMESPACE))
    except ValueError:  # never created: no ingress ever reported
        return
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            ray.get_actor(board_name(app_name), namespace=BOARD_NAMESPACE)
        except ValueError:
            return
        time.sleep(0.05)
    logger.warning("the drain board of %r was killed but its name was still taken after %.0f s", app_name, wait_s)
