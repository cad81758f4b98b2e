"""The Grafana dashboard (dashboards/grafana-ssd-serve.json) is valid JSON whose every query names
only metrics the server exports (serve_app/metrics.py PROMETHEUS_NAMES, with Prometheus'
histogram suffixes), and it covers each of them."""

from __future__ import annotations

import json
import re
from pathlib import Path

from serve_app.metrics import PROMETHEUS_NAMES

DASHBOARD = Path(__file__).resolve().parent.parent / "dashboards" / "grafana-ssd-serve.json"
PROMQL_WORDS = {
    "sum",
    "by",
    "rate",
    "histogram_quantile",
    "avg",
    "le",
    "application",
    "status",
    "kind",
    "mode",
    "replica",
    "label_values",
}


def metric_names(expr: str) -> set[str]:
    words = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", re.sub(r'"[^"]*"|\[[^\]]*\]', "", expr)))
    return {w for w in words if w.startswith("ray_")} | {w for w in words - PROMQL_WORDS if not w.startswith("ray_")}


def base(name: str) -> str:
    return re.sub(r"_(bucket|sum|count)$", "", name) if name not in PROMETHEUS_NAMES else name


def test_every_query_names_an_exported_metric_and_every_metric_has_a_panel():
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [v["query"] for v in dash["templating"]["list"] if v["type"] == "query"]
    used = set()
    for expr in exprs:
        names = metric_names(expr)
        unknown = {n for n in names if base(n) not in PROMETHEUS_NAMES}
        assert not unknown, (expr, unknown)
        used |= {base(n) for n in names}
    assert used == set(PROMETHEUS_NAMES)
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])


def test_the_check_catches_a_misspelt_metric():
    assert {base(n) for n in metric_names('sum(rate(ray_ssd_request_total{application=~"$application"}[1m]))')} - set(
        PROMETHEUS_NAMES
    )
