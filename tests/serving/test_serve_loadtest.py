"""The Locust load test (loadtest/locustfile.py) runs headless for a few seconds against the
served application with every speculation mode, streaming and not, chat and completions: no
failures, and its own TTFT / ITL / TOKPS / E2E events recorded. `make loadtest`'s command, as the
Makefile gives it, against `make serve`'s application draws only from the modes that serves."""

from __future__ import annotations

import argparse
import csv
import importlib.util
import os
import shlex
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
        "ssd,sd,ar",
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
    """The soak once sent ssd to a server that served auto, sd and ar (every ssd request a 400);
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


def make_loadtest_command(host: str, out: Path, seconds: int = 4, users: int = 2) -> list[str]:
    """The locust command of the Makefile's `loadtest` target, with its host, run time, users and
    report paths replaced (each must be there: a changed recipe fails here, not silently)."""
    text = (ROOT / "Makefile").read_text().replace("\\\n", " ")  # continued lines joined
    recipe = text.split("\nloadtest:", 1)[1].split("\n\n", 1)[0]  # up to the blank line after it
    args = shlex.split(next(line for line in recipe.splitlines() if "locust -f" in line))
    assert args[0] == "$(BIN)/locust", args
    values = {
        "--host": host,
        "-t": f"{seconds}s",
        "-u": str(users),
        "-r": str(users),
        "--csv": str(out),
        "--html": f"{out}.html",
    }
    for flag, value in values.items():
        args[args.index(flag) + 1] = value
    return [sys.executable, "-m", "locust", *args[1:]]


@pytest.fixture(scope="module")
def make_serve(served):
    """`make serve`'s application (`ssd serve` with no flags: the demo pair, mode auto, ar served
    too, no API key) beside the package's on its cluster, at /make-serve -> (its URL, settings)."""
    from ray import serve

    from serve_app.app import build_app
    from serve_app.cli import add_arguments, app_config_from

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = app_config_from(parser.parse_args([]))
    serve.run(build_app(config), name="make-serve", route_prefix="/make-serve")
    url, settings = served.http + "/make-serve", config.to_settings()
    _warm(url, settings.request_modes)
    yield url, settings
    serve.delete("make-serve")


def _warm(url: str, modes) -> None:
    """One request per served mode, as an operator's smoke test would send before load: on a
    busy 2-core machine a cold application (its first forwards, its draft workers starting)
    once answered nothing within a 4 s run, which then counted no request."""
    import requests

    for mode in modes:
        body = {"model": "ssd-demo", "prompt": "Once upon a time", "max_tokens": 8, "speculation": {"mode": mode}}
        response = requests.post(url + "/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text


def _run(cmd: list[str], timeout: int = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "SSD_API_KEY"}  # as `make serve` has none
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_make_loadtest_against_make_serve_draws_only_served_modes(make_serve, tmp_path):
    """Reported: `make loadtest` beside `make serve` got 400 for 194 of 701 requests (it asked for
    ssd and sd; the server serves auto and ar, then spelled off). Its command as the Makefile gives it: no failure,
    every mode drawn is one the model card lists, and the card lists what the server serves."""
    import requests

    url, settings = make_serve
    served = list(settings.request_modes)  # auto and ar (then spelled off) when this was written
    (card,) = requests.get(url + "/v1/models", timeout=30).json()["data"]
    assert card["id"] == "ssd-demo" and card["speculation_modes"] == served, card
    prefix = tmp_path / "loadtest"
    run = _run(make_loadtest_command(url, prefix))
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"speculation modes drawn from: {', '.join(served)}" in run.stderr, run.stderr[-3000:]
    with open(f"{prefix}_stats.csv") as f:
        rows = list(csv.DictReader(f))
    total = next(r for r in rows if r["Name"] == "Aggregated")
    assert int(total["Request Count"]) > 0 and int(total["Failure Count"]) == 0, total
    posts = [r["Name"].split(" ")[1] for r in rows if r["Type"] == "POST"]
    assert posts and set(posts) <= set(served), posts


def test_a_mode_the_server_does_not_serve_is_refused_before_any_request(make_serve, tmp_path, capsys):
    url, settings = make_serve
    assert "ssd" not in settings.request_modes and "sd" not in settings.request_modes
    prefix = tmp_path / "refused"
    run = _run([*make_loadtest_command(url, prefix), "--spec-modes", f"{settings.request_modes[0]},ssd"])
    assert run.returncode != 0
    served = ", ".join(settings.request_modes)
    assert f"speculation mode(s) ssd not served by {url}, which serves {served}" in run.stderr, run.stderr
    stats = Path(f"{prefix}_stats.csv")
    with open(stats) if stats.exists() else open(os.devnull) as f:
        assert not [r for r in csv.DictReader(f) if int(r["Request Count"])]  # stopped before its first request
    from loadtest import bench

    with pytest.raises(SystemExit):  # the benchmark refuses too, before its first run
        bench.main(["--host", url, "--modes", "sd", "--out", str(tmp_path / "bench.json")])
    assert "speculation mode(s) sd not served by" in capsys.readouterr().err
    assert not (tmp_path / "bench.json").exists()


def test_pick_modes_defaults_to_every_served_mode_and_refuses_others():
    from loadtest.served_modes import pick_modes

    assert pick_modes("", ["auto", "ar"]) == ["auto", "ar"]
    assert pick_modes(" ar ,auto,ar", ["auto", "ar"]) == ["ar", "auto"]
    assert pick_modes("default,ar", ["auto", "ar"]) == ["default", "ar"]
    assert pick_modes("", None) == ["default"] and pick_modes("ssd", None) == ["ssd"]  # a server that does not say
    with pytest.raises(ValueError, match="ssd, sd not served"):
        pick_modes("ssd,sd,ar", ["auto", "ar"])
