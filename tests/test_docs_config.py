"""docs/operations.md stays in step with the code: its configuration reference has one table row
per AppConfig and per EngineArgs field and none for a field that no longer exists, and its
metrics reference has one row per exported metric (serve_app/metrics.py PROMETHEUS_NAMES)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from serve_app.config import AppConfig
from ssd.core.config import EngineArgs

DOC = Path(__file__).resolve().parent.parent / "docs" / "operations.md"
HEADING = re.compile(r"^#{1,3} ", re.M)


def section(title: str) -> str:
    """The text under the heading that starts with `title`, up to the next heading."""
    text = DOC.read_text(encoding="utf-8")
    starts = [m.start() for m in HEADING.finditer(text)] + [len(text)]
    for begin, end in zip(starts, starts[1:]):
        if text[begin:].lstrip("#").lstrip().startswith(title):
            return text[begin:end]
    raise AssertionError(f"{DOC.name} has no heading starting with {title!r}")


def table_names(text: str) -> list[str]:
    """The first cell of each table row, when it is one name in backquotes."""
    return re.findall(r"^\| `([A-Za-z_][A-Za-z0-9_]*)` \|", text, re.M)


@pytest.mark.parametrize("model, title", [(AppConfig, "AppConfig"), (EngineArgs, "EngineArgs")])
def test_every_config_field_has_exactly_one_row(model, title):
    rows = table_names(section(title))
    fields = list(model.model_fields)
    missing = [f for f in fields if f not in rows]
    stale = [r for r in rows if r not in fields]
    doubled = sorted({r for r in rows if rows.count(r) > 1})
    assert not (missing or stale or doubled), (
        f"{DOC.name}, {title} table: add rows (type, default, description) for {missing}; "
        f"remove the rows of fields that no longer exist {stale}; rows listed twice {doubled}"
    )


def test_every_metric_has_a_row():
    from serve_app.metrics import PROMETHEUS_NAMES

    rows = table_names(section("4. Metrics reference"))
    assert sorted(rows) == sorted(PROMETHEUS_NAMES), (
        f"{DOC.name} metrics table: missing {sorted(set(PROMETHEUS_NAMES) - set(rows))}, "
        f"stale {sorted(set(rows) - set(PROMETHEUS_NAMES))}"
    )
