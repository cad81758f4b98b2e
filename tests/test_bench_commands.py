"""Benchmark commands the docs quote (constraints and processing; the load benchmark's workload
offline) run as written (at small sizes here) and write the JSON they promise: a figure in the
docs must stay reproducible by its command."""

from __future__ import annotations

import json

from benchmarks import (
    constrained,
    exchange_steps,
    grammar_cost,
    pack_time,
    processing_cost,
    processing_share,
    vocab_speed,
)
from loadtest import offline
from loadtest.bench import median_cell


def test_processing_cost_writes_each_vocabulary_and_batch(tmp_path):
    out = tmp_path / "processing_cost.json"
    processing_cost.main(["--vocab", "64", "512", "--batch", "1", "3", "--repeats", "1", "--out", str(out)])
    rows = json.loads(out.read_text())
    assert [(r["vocab"], r["batch"]) for r in rows] == [(64, 1), (64, 3), (512, 1), (512, 3)]
    for row in rows:
        fields = (
            "carry_ms",
            "build_ms",
            "sd_draft_ms",
            "verify_extend_ms",
            "verify_apply_ms",
            "sampling_ms",
            "tree_ms",
        )
        assert all(row[f] > 0 for f in fields), row


def test_processing_share_times_the_engines_processing(demo_pair, tmp_path):
    out = tmp_path / "processing_share.json"
    processing_share.main(["--batch", "2", "--k", "3", "--repeats", "1", "--out", str(out)])
    (row,) = json.loads(out.read_text())
    assert row["batch"] == 2 and row["k"] == 3 and row["vocab"] == 258 and 0 < row["share"] < 1, row
    processing_share.main(["--batch", "1", "--k", "2", "--repeats", "1", "--vocab", "4096", "--out", str(out)])
    (row,) = json.loads(out.read_text())
    assert row["vocab"] == 4096 and 0 < row["share"] < 1, row


def test_pack_time_prints_each_form_and_a_rounds_messages(capsys):
    assert pack_time.main(["--vocab", "300", "--batch", "2", "--repeats", "2"]) == 0
    forms = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "ms" not in line]
    assert len(forms) == 4, forms
    assert pack_time.main(["--round", "--batch", "1", "--repeats", "3"]) == 0
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| ")][1:]
    assert [r[0] for r in rows] == ["| BEGIN_ROUND", "| RESOLVE", "| REPLY"], rows
    assert all(float(x.strip(" |")) > 0 for r in rows for x in r[1:]), rows


def test_vocab_speed_writes_each_mode_temperature_and_batch(tmp_path):
    out = tmp_path / "vocab_speed.json"
    args = ["--vocab", "1024", "--modes", "sd", "ssd", "--batch-sizes", "2", "--max-tokens", "6", "--repeats", "1"]
    vocab_speed.main([*args, "--out", str(out)])
    rows = json.loads(out.read_text())
    assert [(r["mode"], r["temperature"], r["batch"]) for r in rows] == [
        (m, t, 2) for m in ("sd", "ssd") for t in (0.0, 1.0)
    ]
    assert all(r["tokens_per_s"] > 0 and len(r["runs"]) == 1 for r in rows), rows


def test_grammar_cost_on_the_demo_tokenizer(tmp_path):
    out = tmp_path / "grammar_cost.json"
    grammar_cost.main(["--large-vocab", "0", "--out", str(out)])
    (row,) = json.loads(out.read_text())
    assert row["tokenizer"] == "demo" and set(row["round_ms"]) == {"b1", "b8"} and set(row["tree_ms"]) == {"b1", "b8"}
    assert isinstance(row["engines"]["llguidance"], dict)


def test_constrained_rows_for_every_mode_field_and_temperature(demo_pair, tmp_path):
    out = tmp_path / "constrained.json"
    constrained.main(["--requests", "2", "--max-tokens", "12", "--ssd-budget", "4", "--out", str(out)])
    rows = json.loads(out.read_text())
    rows = rows["rows"] if isinstance(rows, dict) else rows
    cells = {(r["mode"], r["fields"], r["temperature"]) for r in rows}
    assert cells == {(m, f, t) for m in ("sd", "ssd") for f in ("none", "json_schema", "penalties") for t in (0.0, 1.0)}
    assert all(r["tokens_per_round"] >= 1 for r in rows)


def test_the_load_benchmarks_workload_offline(demo_pair, tmp_path):
    out = tmp_path / "offline.json"
    offline.main(["--modes", "ar", "--users", "1,2", "--duration", "2", "--num-threads", "1", "--out", str(out)])
    cells = json.loads(out.read_text())["cells"]
    assert [(c["mode"], c["users"]) for c in cells] == [("ar", 1), ("ar", 2)]
    assert all(c["tok_per_s"] > 0 and c["req_per_s"] > 0 for c in cells)


def test_startup_times_each_mode_in_a_fresh_interpreter(demo_pair, tmp_path):
    from ssd.bench import startup

    out = tmp_path / "startup.json"
    startup.main(["--modes", "ssd", "--draft-workers", "1", "--repeats", "1", "--out", str(out)])
    (row,) = json.loads(out.read_text())
    assert row["mode"] == "ssd" and row["draft_workers"] == 1 and row["start_s"] > 0 and row["close_s"] > 0, row


def test_the_load_benchmarks_repeats_are_a_median_with_its_range():
    def run(tok: float, failures: int = 0) -> dict:
        return {"mode": "auto", "users": 4, "tok_per_s": tok, "req_per_s": tok / 50, "failures": failures}

    cell = median_cell([run(250.0), run(220.0, failures=1), run(265.0)])
    assert (cell["tok_per_s"], cell["req_per_s"], cell["failures"]) == (250.0, 5.0, 1)
    assert (cell["tok_per_s_min"], cell["tok_per_s_max"], len(cell["runs"])) == (220.0, 265.0, 3)


def test_exchange_steps_times_the_pool_steps_in_place_and_puts_them_back(tiny_pair, tmp_path):
    """Two workers (boards, where the host has them): each step is timed per call; the steps are
    the pool's own again afterwards."""
    from ssd.transport.pool_client import PoolClient

    before = PoolClient.resolve
    out = tmp_path / "exchange_steps.json"
    args = ["--target", tiny_pair[0], "--draft", tiny_pair[1], "--workers", "1,2", "--k", "3"]
    assert exchange_steps.main([*args, "--num-prompts", "2", "--max-tokens", "12", "--out", str(out)]) == 0
    one, two = json.loads(out.read_text())
    assert (one["draft_workers"], two["draft_workers"]) == (1, 2) and two["target_exchange_ms"] > 0
    for run in (one, two):
        steps = run["steps"]
        assert steps["resolve"]["calls"] == steps["reply"]["calls"] > 0, steps
        assert steps["resolve"]["wall_ms"] >= steps["resolve"]["cpu_ms"] * 0.5 > 0, steps
    assert PoolClient.resolve is before
    assert one["board_key_alone_ms"] is None  # no boards for a pool of one
    if "board_key" in two["steps"]:  # boards (x86-64 hosts)
        assert two["board_key_alone_ms"] > 0
