"""The README and docs/ name files that exist: every relative link, and every path of the
repository written in backquotes (`ssd/...py`, `benchmarks/...py`, `tests/...py`, `serve_app/...`),
so a module that moves cannot leave its docs behind. The README stays a front page."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "k8s" / "README.md"]
# Paths written in backquotes, possibly followed by ::test or a space and more words.
PATH = re.compile(r"`((?:ssd|actors|serve_app|tests|loadtest|benchmarks|protos|dashboards|k8s|docs|models)/[\w./-]*)")
LINK = re.compile(r"\]\(([^)#:]+)(?:#[^)]*)?\)")
GENERATED = ("ssd/transport/_proto", "serve_app/_proto")


def _named_paths(doc: Path) -> set[str]:
    text = doc.read_text()
    return {m.group(1).rstrip(".") for m in PATH.finditer(text)}


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_every_path_a_doc_names_exists(doc):
    missing = sorted(
        p for p in _named_paths(doc) if not p.startswith(GENERATED) and not (ROOT / p).exists() and "*" not in p
    )
    assert not missing, f"{doc.relative_to(ROOT)} names paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_every_relative_link_resolves(doc):
    links = [m.group(1) for m in LINK.finditer(doc.read_text()) if not m.group(1).startswith("http")]
    missing = sorted(link for link in links if not (doc.parent / link).exists())
    assert not missing, f"{doc.relative_to(ROOT)} links to missing files: {missing}"


def test_the_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= 250, f"README.md has {lines} lines; move detail into docs/"


def test_the_check_catches_a_stale_path(tmp_path):
    stale = tmp_path / "stale.md"
    stale.write_text("see `ssd/transport/draft_worker.py` and `ssd/worker/main.py`")
    assert {p for p in _named_paths(stale) if not (ROOT / p).exists()} == {"ssd/transport/draft_worker.py"}
