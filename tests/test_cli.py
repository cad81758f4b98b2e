"""The `ssd` console script: help texts and a real generation run."""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
from typing import Literal, get_args, get_origin

import pytest

from ssd.cli import build_parser, engine_args_from, main
from ssd.core.config import EngineArgs


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "ssd.cli", *args], capture_output=True, text=True, env=env, timeout=300
    )


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
    out = _run(
        "generate",
        "--target",
        tiny_pair[0],
        "--draft",
        tiny_pair[1],
        "--prompt",
        "def f():",
        "--max-tokens",
        "12",
        "--k",
        "3",
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("def f():")
    metrics = json.loads(out.stdout[out.stdout.index("{") :])["engine"]
    assert metrics["generated_tokens"] == 12 and metrics["rounds"] > 0


def test_generate_reports_bad_input_without_traceback(tiny_pair):
    out = _run("generate", "--target", tiny_pair[0], "--draft", tiny_pair[1], "--top-p", "0")
    assert out.returncode == 2
    assert "top_p must be in (0, 1]" in out.stderr and "Traceback" not in out.stderr


def _generate_parser() -> argparse.ArgumentParser:
    return next(a for a in build_parser()._actions if a.dest == "command").choices["generate"]


def test_every_engine_option_is_a_generate_flag():
    """Built from EngineArgs, so fields added later appear without touching the CLI."""
    flags = {opt: a for a in _generate_parser()._actions for opt in a.option_strings}
    for name, field in EngineArgs.model_fields.items():
        flag = "--" + name.replace("_", "-")
        # A name a request flag holds (--seed) moves to --engine-<name>.
        candidates = [flags[f] for f in (flag, "--engine-" + flag[2:]) if f in flags]
        action = next((a for a in candidates if a.help == field.description), None)
        assert action is not None, (
            f"EngineArgs.{name}: no generate flag {flag} (or --engine-{flag[2:]}) with its description as help"
        )
        assert action.default is argparse.SUPPRESS, f"{flag}: defaults must come from EngineArgs"
        annotation = field.annotation
        if annotation is bool:
            assert isinstance(action, argparse.BooleanOptionalAction), flag
        choices = [get_args(a) for a in (annotation, *get_args(annotation)) if get_origin(a) is Literal]
        if choices:
            assert tuple(action.choices) == choices[0], flag


def test_engine_flags_reach_engine_args():
    args = _generate_parser().parse_args(
        [
            "--ssd-budget",
            "3",
            "--no-lean-forward",
            "--saguaro-c",
            "0.5",
            "--draft-transport",
            "inprocess",
            "--seed",
            "7",
            "--engine-seed",
            "9",
        ]
    )
    engine = engine_args_from(args)
    assert (engine.ssd_budget, engine.lean_forward, engine.saguaro_c, engine.draft_transport) == (
        3,
        False,
        0.5,
        "inprocess",
    )
    assert engine.seed == 9 and args.seed == 7  # --seed is the request's, --engine-seed the engine's
    # Only the flags given are set; everything else is EngineArgs' own default.
    assert engine.model_fields_set == {"ssd_budget", "lean_forward", "saguaro_c", "draft_transport", "seed"}
    assert engine_args_from(_generate_parser().parse_args([])) == EngineArgs()


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--ssd-budget", "0"], "ssd_budget"),
        (["--engine-seed", "-1"], "seed"),
        (["--seed", str(2**64)], r"seed must be in [0, 2**64 - 1]"),
        (["--stop", "x" * 300], "stop strings must be at most 256 characters"),
    ],
)
def test_bad_engine_flag_exits_2_with_the_message(argv, message, caplog):
    """Checked before any model loads: main() returns 2 and logs the validation error."""
    with caplog.at_level(logging.ERROR, logger="ssd"):
        assert main(["generate", *argv]) == 2
    assert message in caplog.text
