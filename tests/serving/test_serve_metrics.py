"""Every metric serve_app/metrics.py defines reaches Ray's Prometheus endpoint, with values that
follow the traffic: after greedy requests, requests and generated tokens counted, cache hits
recorded for SSD, a live draft worker."""

from __future__ import annotations

import glob
import os
import re
import time

import pytest

requests = pytest.importorskip("requests")

from serve_app.metrics import PROMETHEUS_NAMES  # noqa: E402


def scrape(url: str) -> dict[str, float]:
    """Sum of each metric family's samples (histograms by their _count)."""
    out: dict[str, float] = {}
    for line in requests.get(url, timeout=10).text.splitlines():
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)", line)
        if not m:
            continue
        name, value = m.group(1), float(m.group(3))
        family = name[: -len("_count")] if name.endswith("_count") else name
        if name.endswith(("_bucket", "_sum")):
            continue
        out[family] = out.get(family, 0.0) + value
    return out


def test_every_metric_is_exported_and_follows_the_traffic(served):
    headers = {"Authorization": f"Bearer {served.api_key}"}
    for mode in ("ssd", "auto"):  # the default engine, and the auto one's counters
        # 96 tokens: enough rounds for the auto engine to probe past its first mode (a switch)
        tokens = 24 if mode == "ssd" else 96
        body = {"model": "tiny", "prompt": "def f(x):", "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
        r = requests.post(
            served.http + "/v1/completions", headers=headers, timeout=60, json={**body, "speculation": {"mode": mode}}
        )
        assert r.status_code == 200
        assert sum(r.json()["speculation"][0]["rounds_by_mode"].values()) == r.json()["speculation"][0]["rounds"]
    deadline = time.monotonic() + 90
    while True:
        values = scrape(served.metrics)
        # The retry counter appears at the first retry: test_serve_reliability.py scrapes it.
        missing = [n for n in PROMETHEUS_NAMES if n not in values and n != "ray_ssd_target_retries_total"]
        if not missing and values["ray_ssd_generation_tokens_total"] >= 48:
            break
        assert time.monotonic() < deadline, missing
        time.sleep(1)
    assert values["ray_ssd_requests_total"] >= 2 and values["ray_ssd_time_to_first_token_seconds"] >= 2
    assert values["ray_ssd_cache_hits_total"] > 0 and values["ray_ssd_draft_workers_live"] >= 1


def test_the_replicas_write_this_projects_log_records_to_their_own_log(served):
    """A target replica's INFO record from the engine's loader (logger ssd.model.loader) is in
    the replica's own Serve log, formatted and tagged as Serve's own lines are: without the
    replica's handlers it had no handler there and was dropped."""
    files = glob.glob(os.path.join(served.serve_logs, "replica_main_Target_*.log"))
    assert files, f"no log of the main application's Target replica in {served.serve_logs}"
    lines = [line for path in files for line in open(path, encoding="utf-8") if "loaded target" in line]
    assert lines, "the loader's INFO record is not in the Target replica's log"
    assert re.match(r"INFO \S+ \S+ main_Target \S+ -- loaded target ", lines[0]), lines[0]
