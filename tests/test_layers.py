"""The import structure the README draws: ssd/ is a stack of subpackages whose imports only point
down, and nothing in it names the Ray layer (actors/) or the Serve layer (serve_app/), not even
in a string: those packages pass what they add into ssd (a worker provider, a subcommand). Nor
does it import the investigation scripts of benchmarks/, which import ssd and are not shipped.

An import counts wherever it is written (module top, inside a function, under TYPE_CHECKING),
and so does a module named in a string ("ssd.worker" for `python -m`, importlib.import_module).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SSD = ROOT / "ssd"

# Lower numbers are lower layers; a module may import its own subpackage and strictly lower
# layers only (so two subpackages of one layer never import each other). processing/ is below
# core/: core's types (SamplingParams, Sequence, SequenceSampling) hold its values. The modules at the top
# of ssd/ are layers of their own: the Python API (llm), the bench over it, the command line, and
# the package's lazy exports.
LAYERS = {
    "processing": 0, "core": 1, "model": 2, "drafting": 3, "transport": 3, "worker": 4, "engine": 5,
    "llm": 6, "bench": 7, "cli": 8, "": 9,
}  # fmt: skip
# A module path or name of the upper layers (prose may say "Ray actors", not "actors/x.py").
FORBIDDEN = re.compile(r"\bserve_app\b|\bactors(?:[./][A-Za-z_]|['\"])")
MODULE_STRING = re.compile(r"^ssd(\.[A-Za-z_]\w*)+$")


def subpackage(module: str) -> str:
    """'ssd.core.config' -> 'core'; 'ssd.llm' -> 'llm' (a top module); 'ssd' -> '' (__init__)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] != "__init__" else ""


def is_module(name: str) -> bool:
    path = SSD.parent / name.replace(".", "/")
    return path.is_dir() or path.with_suffix(".py").exists()


def imported_modules(source: str, module: str) -> set[str]:
    """Every module `source` (the text of `module`) imports or names: import statements anywhere,
    relative ones resolved, and string constants that are dotted ssd module names."""
    found = set()
    package = module if module.endswith("__init__") else module.rsplit(".", 1)[0]
    package = package.removesuffix(".__init__")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from package import module` imports the module (its package's __init__ runs for
            # any import from it); `from module import name` imports the module.
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if is_module(f"{base}.{alias.name}") else base)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and MODULE_STRING.match(node.value):
            if is_module(node.value):
                found.add(node.value)
    return found


def violations(source: str, module: str) -> list[str]:
    """What is wrong with `module`'s imports (empty when it keeps to its layer)."""
    problems = [f"{module} names {m.group(0)!r}" for m in FORBIDDEN.finditer(source)]
    own = subpackage(module)
    if own not in LAYERS:
        return [*problems, f"{module}: subpackage {own!r} has no layer in tests/test_layers.py"]
    for target in sorted(imported_modules(source, module)):
        if target.split(".")[0] in ("actors", "serve_app", "benchmarks"):
            problems.append(f"{module} imports {target}")
            continue
        if not target.startswith("ssd.") and target != "ssd":
            continue
        theirs = subpackage(target)
        if theirs == own:
            continue
        if theirs not in LAYERS or LAYERS[theirs] >= LAYERS[own]:
            problems.append(f"{module} ({own or 'top'}, layer {LAYERS[own]}) imports {target} ({theirs or 'top'})")
    return problems


def ssd_modules() -> list[tuple[str, str]]:
    out = []
    for path in sorted(SSD.rglob("*.py")):
        rel = path.relative_to(SSD.parent)
        if "_proto" in rel.parts:
            continue
        out.append((".".join(rel.with_suffix("").parts), path.read_text()))
    return out


def test_every_ssd_module_imports_only_its_own_subpackage_and_lower_layers():
    problems = [p for module, source in ssd_modules() for p in violations(source, module)]
    assert not problems, "\n".join(problems)


def test_every_subpackage_and_top_module_of_ssd_has_a_layer():
    packages = {p.name for p in SSD.iterdir() if (p / "__init__.py").exists()}
    modules = {p.stem for p in SSD.glob("*.py") if p.stem != "__init__"}
    assert packages | modules == set(LAYERS) - {""}


@pytest.mark.parametrize(
    "module,source,expected",
    [
        ("ssd.core.config", "from ssd.model.loader import load_model\n", "imports ssd.model.loader"),
        ("ssd.transport.pool_client", "def f():\n    from ssd.drafting import tree\n", "imports ssd.drafting"),
        ("ssd.drafting.tree", "import importlib\nimportlib.import_module('ssd.transport.wire')\n", "ssd.transport"),
        ("ssd.engine.proposers", "x = 'actors.leased_workers'\n", "names 'actors."),
        ("ssd.engine.proposers", "import actors\n", "imports actors"),
        ("ssd.cli", "# see serve_app/cli.py\n", "names 'serve_app'"),
        ("ssd.engine.llm_engine", "from ..bench import plan\n", "imports ssd.bench"),
        ("ssd.bench.cli", "def f():\n    from benchmarks.contention import main\n", "imports benchmarks"),
        ("ssd.bench.modes", "from ssd import LLM\n", "imports ssd (top)"),
        ("ssd.model.runner", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import ssd.llm\n", "ssd.llm"),
    ],
)
def test_the_check_finds_upward_and_forbidden_imports(module, source, expected):
    """The check itself, on sources that break the rules (it must not pass them)."""
    found = violations(source, module)
    assert any(expected in p for p in found), found


def test_the_check_passes_downward_imports_and_plain_words():
    source = "from ssd.core.protocol import MsgType\n# Ray actors: they place the workers.\nWORKER = 'ssd.worker'\n"
    assert violations(source, "ssd.engine.proposers") == []


def mutual_imports(modules: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Pairs of modules that import each other (type-checking imports included)."""
    graph = {module: imported_modules(source, module) for module, source in modules}
    return sorted((a, b) for a, targets in graph.items() for b in targets if a < b and a in graph.get(b, ()))


def test_no_two_ssd_modules_import_each_other():
    assert mutual_imports(ssd_modules()) == []


def test_the_check_finds_two_modules_that_import_each_other():
    modules = [
        ("ssd.core.sequence", "from ssd.core.speculation import SpecMetrics"),
        ("ssd.core.speculation", "if TYPE_CHECKING:\n    from ssd.core.sequence import Sequence"),
    ]
    assert mutual_imports(modules) == [("ssd.core.sequence", "ssd.core.speculation")]
