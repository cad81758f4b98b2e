"""This project's log records in a Serve replica's own log.

Serve configures one logger in each replica, "ray.serve": its handlers write the replica's log
file (`logs/serve/replica_<app>_<deployment>_<id>.log` in the Ray session's directory, each line
tagged with the replica and, inside a request, its id) and stderr, at the level of the
deployment's `logging_config`. The loggers of `ssd`, `serve_app` and `actors` have no handler in
a replica: their INFO records (a worker joined, a session opened, a replica closed and how long
that took) were dropped, and a WARNING or an ERROR reached stderr bare, without time or replica,
through Python's last-resort handler. Each deployment therefore gives these loggers Serve's
handlers and level when it starts.
"""

from __future__ import annotations

import logging

PACKAGES = ("ssd", "serve_app", "actors")  # the top-level loggers of this project's code
SERVE_LOGGER = "ray.serve"  # the logger Serve configures in each replica


def use_replica_log() -> None:
    """Route this project's loggers to the replica's log (call in a deployment's __init__, after
    Serve configured its logger: it has by then)."""
    serve_logger = logging.getLogger(SERVE_LOGGER)
    for name in PACKAGES:
        logger = logging.getLogger(name)
        logger.handlers = list(serve_logger.handlers)
        logger.setLevel(serve_logger.level)
        logger.propagate = False  # the root logger's handlers, if any, would write each record twice
