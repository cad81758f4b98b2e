"""The Locust load test (loadtest/locustfile.py) runs headless for a few seconds against the
served application with every speculation mode, streaming and not, chat and completions: no
failures, and its own TTFT / ITL / TOKPS / E2E events recorded."""

from __future__ import annotations

import csv
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

# Not imported here: importing locust monkey-patches this process with gevent.
if importlib.util.find_spec("locust") is None:
    pytest.skip("locust is not installed", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]


def test_a_short_headless_run_has_no_failures(served, tmp_path):
    prefix = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "locust",
        "-f",
        str(ROOT / "loadtest" / "locustfile.py"),
        "--host",
        served.http,
        "--headless",
        "-u",
        "3",
        "-r",
        "3",
        "-t",
        "6s",
        "--stop-timeout",
        "30",
        "--csv",
        str(prefix),
        "--only-summary",
        "--model",
        "tiny",
        "--api-key",
        served.api_key,
        "--spec-modes",
        "ssd,sd,off",
        "--stream-fraction",
        "0.7",
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    with open(f"{prefix}_stats.csv") as f:
        rows = list(csv.DictReader(f))
    total = next(r for r in rows if r["Name"] == "Aggregated")
    assert int(total["Request Count"]) > 0 and int(total["Failure Count"]) == 0
    kinds = {r["Type"] for r in rows}
    assert {"POST", "TTFT", "E2E", "TOKPS"} <= kinds, kinds
    assert not Path(f"{prefix}_failures.csv").read_text().strip().splitlines()[1:]


def test_the_soak_asks_only_for_modes_its_server_serves():
    """The soak once sent ssd to a server that served auto, sd and off (every ssd request a 400);
    serving ssd besides auto doubled the draft pool, and on 2 cores the target replica was never
    placed (one draft worker and the target fit)."""
    import argparse

    from loadtest.soak import MODES, serve_flags
    from serve_app.cli import add_arguments, app_config_from

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    settings = app_config_from(parser.parse_args(serve_flags(8000, 9000, 8080, []))).to_settings()
    assert set(MODES) <= set(settings.request_modes), (MODES, settings.request_modes)
    assert settings.draft_pool_size == 1
