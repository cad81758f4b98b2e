"""scripts/gpu_check.sh runs only where there is a GPU, which CI lacks: these checks keep the commands
it lists in step with the modules they call, so that a borrowed GPU's minutes are not lost to a
renamed flag or a moved test file."""

import importlib
import re
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def _listed_commands() -> list[list[str]]:
    """The Python commands the script would run, as argument lists (interpreter first)."""
    listed = subprocess.run(["bash", str(SCRIPT), "--list"], capture_output=True, text=True, check=True).stdout
    commands = []
    for line in listed.splitlines():
        words = shlex.split(line.replace("{out}", "/tmp/out"))
        if "-m" in words:  # the MPS line wraps its bench in a shell group
            commands.append(words[words.index("-m") - 1 :])
    return commands


def _flags(module: str, capsys) -> set[str]:
    """The options the module's argparse help lists, from its own main (in-process: no second
    torch import). Whole names: `--out` is not taken for `--out-dir`."""
    entry = importlib.import_module("ssd.bench.cli" if module == "ssd.bench" else module)
    with pytest.raises(SystemExit) as exited:
        entry.main(["--help"])
    assert exited.value.code == 0
    return set(re.findall(r"--[\w-]+", capsys.readouterr().out))


def test_the_script_parses_and_lists_every_part():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    listed = subprocess.run(["bash", str(SCRIPT), "--list"], capture_output=True, text=True, check=True).stdout
    assert [line for line in listed.splitlines() if line.startswith("[")] == [
        "[env]",
        "[tests]",
        "[demo]",
        "[demo-mps]",
        "[shapes]",
        "[matched]",
        "[contention]",
        "[dsweep]",
    ]


def test_an_unknown_part_is_refused_before_anything_runs(tmp_path):
    run = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out"), "demo", "bogus"], capture_output=True, text=True)
    assert run.returncode == 2
    assert "unknown part 'bogus'" in run.stderr
    assert not (tmp_path / "out").exists()


def test_every_listed_command_names_a_module_and_flags_that_exist(capsys):
    commands = _listed_commands()
    assert len(commands) >= 5
    for words in commands:
        module = words[2]
        if module == "pytest":
            for path in (w for w in words[3:] if w.startswith("tests/")):
                assert (ROOT / path).is_file(), path
            continue
        flags = _flags(module, capsys)
        for flag in (w for w in words[3:] if w.startswith("--")):
            assert flag in flags, f"{module} has no {flag}"
