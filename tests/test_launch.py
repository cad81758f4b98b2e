"""SSD's draft worker starts from any main module: stdin scripts, `python -c`, a script without a
`__main__` guard, a notebook-like main module with no file, and a Ray actor.

Regression: the worker was a multiprocessing "spawn" child, which re-imports the caller's main
module; `python - <<EOF` failed with "draft worker exited with code 1 before it was ready" and a
script without the guard re-ran itself in the child. Each case runs in a fresh interpreter and
prints the greedy token ids, which must equal Hugging Face `generate` on the target.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

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


def run_python(args: list[str], stdin: str | None = None, cwd: str | None = None, timeout: float = 240) -> dict:
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([tests_dir, os.environ.get("PYTHONPATH", "")]),
    }
    out = subprocess.run(
        [sys.executable, *args], input=stdin, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout
    )
    assert out.returncode == 0, out.stderr[-3000:]
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, (out.stdout[-2000:], out.stderr[-3000:])
    return json.loads(line[len("RESULT ") :])


def check(result: dict, expected: list[int]) -> None:
    assert result["tokens"] == expected
    assert result["live"] == 1 and result["hit_rate"] > 0, result  # the drafter served the run
    assert result["workers"] == 1 and result["left"] == 0, result


def test_from_stdin(script, expected):
    check(run_python(["-"], stdin=script), expected)


def test_from_python_c(script, expected):
    check(run_python(["-c", script]), expected)


def test_from_a_script_without_main_guard(script, expected, tmp_path):
    path = tmp_path / "no_guard.py"
    path.write_text(script)
    check(run_python([str(path)], cwd=str(tmp_path)), expected)


def test_from_a_notebook_like_main_module(script, expected):
    check(run_python(["-c", NOTEBOOK.format(cell=script)]), expected)


def test_from_a_ray_actor(script, expected):
    pytest.importorskip("ray")
    result = run_python(["-c", RAY_ACTOR.format(cell=script)], timeout=300)
    assert result["tokens"] == expected
    assert result["live"] == 1 and result["hit_rate"] > 0, result
    assert result["left"] == 0, result
