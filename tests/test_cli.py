"""The `ssd` console script: help texts and a real generation run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ssd.cli import build_parser


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "ssd.cli", *args], capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.parametrize("command", ["generate", "bench", "build-demo-models"])
def test_every_flag_has_help(command):
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    for action in sub._actions:
        if action.dest != "help":
            assert action.help, f"{command} {action.option_strings} has no help text"


def test_help_runs():
    out = _run("--help")
    assert out.returncode == 0 and "generate" in out.stdout and "bench" in out.stdout


def test_generate_prints_text_and_metrics(tiny_pair):
    out = _run("generate", "--target", tiny_pair[0], "--draft", tiny_pair[1], "--prompt", "def f():", "--max-tokens", "12", "--k", "3")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("def f():")
    metrics = json.loads(out.stdout[out.stdout.index("{") :])["engine"]
    assert metrics["generated_tokens"] == 12 and metrics["rounds"] > 0


def test_generate_reports_bad_input_without_traceback(tiny_pair):
    out = _run("generate", "--target", tiny_pair[0], "--draft", tiny_pair[1], "--top-p", "0")
    assert out.returncode == 2
    assert "top_p must be in (0, 1]" in out.stderr and "Traceback" not in out.stderr
