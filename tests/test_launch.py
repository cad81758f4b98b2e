"""SSD's draft worker starts from any main module: stdin scripts, `python -c`, a script without a
`__main__` guard, a notebook-like main module with no file, and a Ray actor.

Regression: the worker was a multiprocessing "spawn" child, which re-imports the caller's main
module; `python - <<EOF` failed with "draft worker exited with code 1 before it was ready" and a
script without the guard re-ran itself in the child. Each case runs in a fresh interpreter and
prints the greedy token ids, which must equal Hugging Face `generate` on the target.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest
from refimpl import hf_greedy

PROMPT = "def add(a, b):"
MAX_TOKENS = 16

# Plain top-level code, as a user would type it: no function, no __main__ guard.
SCRIPT = """
import json, os
from ssd import LLM, SamplingParams
from workers import live_draft_workers
llm = LLM({target!r}, {draft!r}, mode="ssd", k=3, ssd_budget=6, max_num_seqs=2)
out = llm.generate({prompt!r}, SamplingParams(temperature=0, max_tokens={max_tokens}))[0]
metrics = llm.metrics()
workers = live_draft_workers()
llm.close()
print("RESULT " + json.dumps({{"tokens": out.token_ids, "hit_rate": metrics["cache_hit_rate"],
      "live": metrics["ssd"]["draft_workers_live"], "workers": len(workers), "left": len(live_draft_workers())}}))
"""

# A notebook kernel's main module has neither a file nor a spec; cells are exec'd in it.
NOTEBOOK = """
import sys, types
main = types.ModuleType("__main__")
sys.modules["__main__"] = main
exec(compile({cell!r}, "<cell 1>", "exec"), main.__dict__)
"""

RAY_ACTOR = """
import json, ray
ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)

@ray.remote(num_cpus=1)
class Generator:
    def run(self):
        import io, contextlib
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            exec(compile({cell!r}, "<actor>", "exec"), {{"__name__": "actor_code"}})
        return buf.getvalue()

print(ray.get(Generator.remote().run.remote()), end="")
ray.shutdown()
"""


@pytest.fixture(scope="module")
def script(tiny_pair) -> str:
    return SCRIPT.format(target=tiny_pair[0], draft=tiny_pair[1], prompt=PROMPT, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def expected(tiny_pair) -> list[int]:
    return hf_greedy(tiny_pair[0], [PROMPT], MAX_TOKENS)[0]


@pytest.fixture(scope="module")
def launched(script, tmp_path_factory):
    """Every case's interpreter, started at once (each spends most of its ~8 s importing and
    loading, on one core; one after another they took 44 s): case -> its run."""
    folder = tmp_path_factory.mktemp("no_guard")
    (folder / "no_guard.py").write_text(script)
    cases = {
        "stdin": Run(["-"], stdin=script),
        "python_c": Run(["-c", script]),
        "no_guard": Run([str(folder / "no_guard.py")], cwd=str(folder)),
        "notebook": Run(["-c", NOTEBOOK.format(cell=script)]),
    }
    if importlib.util.find_spec("ray") is not None:
        cases["ray_actor"] = Run(["-c", RAY_ACTOR.format(cell=script)], timeout=300)
    yield cases
    for run in cases.values():
        run.stop()


class Run:
    """One case: `python args` in a fresh interpreter, started now."""

    def __init__(self, args: list[str], stdin: str | None = None, cwd: str | None = None, timeout: float = 240) -> None:
        tests_dir = os.path.dirname(os.path.abspath(__file__))
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([tests_dir, os.environ.get("PYTHONPATH", "")]),
        }
        self.proc = subprocess.Popen(
            [sys.executable, *args],
            stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=cwd,
        )
        if stdin is not None:  # the whole script now (a few KB: the pipe holds it), so the case runs now
            self.proc.stdin.write(stdin)
            self.proc.stdin.close()
            self.proc.stdin = None  # communicate() then leaves it alone
        self.deadline = time.monotonic() + timeout

    def result(self) -> dict:
        """What the case printed after RESULT, once it exited 0."""
        out, err = self.proc.communicate(timeout=max(1.0, self.deadline - time.monotonic()))
        assert self.proc.returncode == 0, err[-3000:]
        line = next((ln for ln in out.splitlines() if ln.startswith("RESULT ")), None)
        assert line is not None, (out[-2000:], err[-3000:])
        return json.loads(line[len("RESULT ") :])

    def stop(self) -> None:
        if self.proc.poll() is None:  # a case that failed or timed out: no process outlives the module
            self.proc.kill()
            self.proc.communicate()


def check(result: dict, expected: list[int]) -> None:
    assert result["tokens"] == expected
    assert result["live"] == 1 and result["hit_rate"] > 0, result  # the drafter served the run
    assert result["workers"] == 1 and result["left"] == 0, result


def test_from_stdin(launched, expected):
    check(launched["stdin"].result(), expected)


def test_from_python_c(launched, expected):
    check(launched["python_c"].result(), expected)


def test_from_a_script_without_main_guard(launched, expected):
    check(launched["no_guard"].result(), expected)


def test_from_a_notebook_like_main_module(launched, expected):
    check(launched["notebook"].result(), expected)


def test_from_a_ray_actor(launched, expected):
    if "ray_actor" not in launched:
        pytest.skip("needs ray")
    result = launched["ray_actor"].result()
    assert result["tokens"] == expected
    assert result["live"] == 1 and result["hit_rate"] > 0, result
    assert result["left"] == 0, result
