"""`ssd bench` end to end on a tiny random pair (both settings, both temperatures), plus its
argument checks and output helpers."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
from pathlib import Path

import pytest
import torch

from ssd import bench
from ssd.bench.modes import variants
from ssd.model.demo_models import DemoTrainingConfig, ModelShape, build_tokenizer, make_model

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MODES = ["ar", "sd", "ssd", "hf-assisted"]
SETTINGS = ["paper", "machine"]
TEMPERATURES = [0.0, 1.0]
MAX_TOKENS = 8
NUM_PROMPTS = 2
K = 3


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[str, str]:
    """A tiny random target/draft pair (embeddings scaled up so the outputs vary and the draft
    disagrees with the target sometimes)."""
    root = tmp_path_factory.mktemp("bench_pair")
    paths = []
    for seed, (name, shape) in enumerate([("target", ModelShape(64, 2, 2, 128)), ("draft", ModelShape(32, 1, 2, 64))]):
        torch.manual_seed(seed)
        model = make_model(shape, DemoTrainingConfig())
        with torch.no_grad():
            model.model.embed_tokens.weight.mul_(4.0)
        model.save_pretrained(root / name)
        build_tokenizer().save_pretrained(root / name)
        paths.append(str(root / name))
    return paths[0], paths[1]


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(argv)


@pytest.fixture(scope="module")
def bench_run(pair, tmp_path_factory) -> tuple[dict, Path]:
    target, draft = pair
    out_dir = tmp_path_factory.mktemp("bench_out")
    args = parse(
        [
            "--target",
            target,
            "--draft",
            draft,
            "--k",
            str(K),
            "--num-prompts",
            str(NUM_PROMPTS),
            "--max-tokens",
            str(MAX_TOKENS),
            "--temperatures",
            "0,1",
            "--settings",
            "paper,machine",
            "--modes",
            ",".join(MODES),
            "--batch-sizes",
            "1,2",
            "--pair-reps",
            "10",
            "--out-dir",
            str(out_dir),
            "--no-progress",
        ]
    )
    return bench.run(args), out_dir


def test_every_flag_has_help():
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    flags = {a.dest: a for a in parser._actions if a.dest != "help"}
    for required in [
        "target",
        "draft",
        "k",
        "num_prompts",
        "max_tokens",
        "temperatures",
        "settings",
        "modes",
        "batch_sizes",
        "out_dir",
        "pair_stats_only",
        "no_progress",
        "seed",
    ]:
        assert required in flags, required
    assert all(a.help for a in flags.values())
    defaults = parse([])
    assert (defaults.target, defaults.draft, defaults.k, defaults.num_prompts, defaults.max_tokens) == (
        None,
        None,
        6,
        8,
        128,
    )
    assert (defaults.temperatures, defaults.settings, defaults.modes, defaults.batch_sizes) == (
        "0,1",
        "paper,machine",
        "ar,sd,ssd,ssd-uniform,hf-assisted,hf-assisted-default",
        "1",
    )
    assert defaults.out_dir == "bench_results"


def test_end_to_end_json_png_and_ratios(bench_run, capsys):
    results, out_dir = bench_run
    on_disk = json.loads((out_dir / "bench.json").read_text())
    assert on_disk["runs"] == results["runs"]
    assert (out_dir / "bench.png").read_bytes()[:8] == PNG_MAGIC
    assert on_disk["environment"]["torch_version"] == torch.__version__
    assert on_disk["environment"]["cpu_count"] >= 1
    assert on_disk["config"]["settings"]["paper"]["threads"] == 1
    assert on_disk["config"]["settings"]["machine"]["threads"] == bench.available_cpus()

    runs = {(r["setting"], r["temperature"], r["batch_size"], r["mode"]): r for r in on_disk["runs"]}
    assert len(runs) == len(on_disk["runs"]) == len(SETTINGS) * len(TEMPERATURES) * 2 * len(MODES)
    for setting in SETTINGS:
        for temperature in TEMPERATURES:
            ar = runs[(setting, temperature, 1, "ar")]
            assert ar["threads"] == on_disk["config"]["settings"][setting]["threads"]
            for mode in MODES:
                r = runs[(setting, temperature, 1, mode)]
                assert r["supported"], r
                assert r["tokens_per_s"] > 0
                assert r["generated_tokens"] == NUM_PROMPTS * MAX_TOKENS
                assert math.isclose(r["ratio_to_ar"], r["tokens_per_s"] / ar["tokens_per_s"], rel_tol=1e-3)
                assert r["rounds"] > 0
                assert 0 <= r["mean_accepted_per_round"] <= K
                assert 1 <= r["tokens_per_round"] <= K + 1
            for mode in ("ar", "sd"):  # engine modes also report the engine's own counters
                r = runs[(setting, temperature, 1, mode)]
                assert r["counters"]["generated_tokens"] == r["generated_tokens"]
                assert r["counters"]["rounds"] == r["rounds"] and r["counters"]["finished_requests"] == NUM_PROMPTS
            # SSD's bound (Theorem 7, p_hit = 1) is the tokens/s of its all-hit steps; the
            # run's decode tokens/s over it is the share that misses leave.
            r = runs[(setting, temperature, 1, "ssd")]
            if r["counters"]["hit_steps"]:
                assert r["upper_bound_tokens_per_s"] > 0 and r["decode_tokens_per_s"] > 0
                assert math.isclose(
                    r["fraction_of_bound"], r["decode_tokens_per_s"] / r["upper_bound_tokens_per_s"], rel_tol=1e-2
                )
                assert r["decode_tokens_per_s"] >= r["tokens_per_s"] * 0.99  # prefill excluded
            else:  # no all-hit step, no bound: never a figure made up from nothing
                assert r["upper_bound_tokens_per_s"] is None and r["fraction_of_bound"] is None
            assert ar["ratio_to_ar"] == 1.0
            assert ar["mean_accepted_per_round"] == 0 and ar["tokens_per_round"] == 1
            # Each prompt's own tokens/s (batch 1), and its ratio to sd's run of the same prompt.
            r = runs[(setting, temperature, 1, "ssd")]
            assert len(r["batch_tokens_per_s"]) == NUM_PROMPTS and min(r["batch_tokens_per_s"]) > 0
            lo, hi = r["batch_spread"]["batch_ratio_to_sd"]
            assert 0 < lo <= hi and lo <= max(r["batch_ratio_to_sd"])
            # Batch 2: the engine modes run; HF assisted generation is reported unsupported.
            for mode in ("ar", "sd"):
                r = runs[(setting, temperature, 2, mode)]
                assert r["supported"] and r["tokens_per_s"] > 0 and r["num_requests"] == 2
            unsupported = runs[(setting, temperature, 2, "hf-assisted")]
            assert not unsupported["supported"] and "batch size 1" in unsupported["reason"]
            assert unsupported["ratio_to_ar"] is None

    pair = on_disk["pair_stats"]
    assert pair["target_decode_ms"] > 0 and pair["draft_decode_ms"] > 0
    assert math.isclose(pair["draft_to_target_ratio"], pair["draft_decode_ms"] / pair["target_decode_ms"], rel_tol=1e-2)
    assert 0 <= pair["greedy_acceptance"] <= 1
    assert pair["acceptance_positions"] == NUM_PROMPTS * MAX_TOKENS
    assert 1 <= pair["greedy_sd_tokens_per_round"] <= K + 1

    # Greedy SD follows the target's greedy path, so the engine's acceptance is what the
    # teacher-forced simulation along that path predicts (up to argmax near-ties).
    for setting in SETTINGS:
        sd_greedy = runs[(setting, 0.0, 1, "sd")]
        assert math.isclose(
            sd_greedy["mean_accepted_per_round"], pair["greedy_sd_mean_accepted_per_round"], abs_tol=0.2
        )
        assert math.isclose(sd_greedy["tokens_per_round"], pair["greedy_sd_tokens_per_round"], abs_tol=0.2)


def test_repeats_and_ssd_variants(pair, tmp_path):
    """--repeats runs every mode that many times, interleaved; --saguaro-c and --ssd-budget give
    SSD one row per (C, B); each figure is the median over repeats, with its range."""
    target, draft = pair
    results = bench.run(
        parse(
            [
                "--target",
                target,
                "--draft",
                draft,
                "--k",
                str(K),
                "--num-prompts",
                "2",
                "--max-tokens",
                "6",
                "--temperatures",
                "1",
                "--settings",
                "paper",
                "--modes",
                "ar,sd,ssd",
                "--saguaro-c",
                "1,0.5",
                "--ssd-budget",
                "4",
                "--repeats",
                "3",
                "--pair-reps",
                "2",
                "--out-dir",
                str(tmp_path),
                "--no-progress",
            ]
        )
    )
    runs = {r["mode"]: r for r in results["runs"]}
    assert list(runs) == ["ar", "sd", "ssd C=1 B=4", "ssd C=0.5 B=4"]
    assert results["config"]["repeats"] == 3 and results["config"]["saguaro_c"] == [1.0, 0.5]
    for label, r in runs.items():
        assert r["repeats"] == 3 and len(r["per_repeat"]["tokens_per_s"]) == 3, r
        values = r["per_repeat"]["tokens_per_s"]
        assert r["tokens_per_s"] == pytest.approx(sorted(values)[1], rel=1e-3)
        assert r["range"]["tokens_per_s"] == [min(values), max(values)]
        # Ratios are paired by repeat, then summarized: the median of the per-repeat ratios.
        sd = runs["sd"]["per_repeat"]["tokens_per_s"]
        paired = [v / s_ for v, s_ in zip(values, sd)]
        assert r["ratio_to_sd"] == pytest.approx(sorted(paired)[1], rel=1e-2)
    assert runs["ssd C=0.5 B=4"]["saguaro_c"] == 0.5 and runs["ssd C=0.5 B=4"]["ssd_budget"] == 4
    assert runs["ssd C=1 B=4"]["base_mode"] == "ssd" and 0 <= runs["ssd C=1 B=4"]["cache_hit_rate"] <= 1
    assert runs["ssd C=0.5 B=4"]["ssd"]["tree_branches"] == 4  # a swept budget is fixed (no adaptive sizing)
    table = bench.format_table(results["runs"])
    assert "ssd C=0.5 B=4" in table and table.splitlines()[0].split().count("range") == 2


def test_draft_workers_and_transport_rows(pair, tmp_path, caplog):
    """--draft-workers gives SSD one row per D (each worker builds ssd_budget branches, the tree
    covers D times as many), --draft-transports one per transport, --draft-splits one per split of D > 1
    workers, crossed (the labels from the
    variants alone; one crossed row runs); more workers than cores is said; an unknown transport
    is refused."""
    labels = [
        v.label
        for v in variants(
            ["sd", "ssd"], {"ssd_budget": [4], "draft_workers": [1, 2], "draft_transport": ["shm", "grpc"]}
        )
    ]
    assert labels == [
        "sd", "ssd B=4 D=1 tr=shm", "ssd B=4 D=1 tr=grpc", "ssd B=4 D=2 tr=shm", "ssd B=4 D=2 tr=grpc"
    ], labels  # fmt: skip
    splits = [v.label for v in variants(["ssd"], {"draft_workers": [1, 2], "draft_split": ["outcomes", "sequences"]})]
    assert splits == ["ssd D=1 split=outcomes", "ssd D=2 split=outcomes", "ssd D=2 split=sequences"], splits
    assert (
        variants(["ssd"], {"draft_workers": [2], "draft_split": ["sequences"]})[0].record["draft_split"] == "sequences"
    )
    cpus = variants(["ssd"], {"draft_workers": [1], "draft_worker_cpus": ["pinned", "shared"]})
    assert [v.label for v in cpus] == ["ssd D=1 cpus=pinned", "ssd D=1 cpus=shared"]
    assert cpus[0].record == {"base_mode": "ssd", "draft_workers": 1, "draft_worker_cpus": "pinned"}
    target, draft = pair
    caplog.set_level(logging.WARNING)
    argv = ["--target", target, "--draft", draft, "--k", str(K), "--num-prompts", "1", "--max-tokens", "6"]
    argv += ["--temperatures", "0", "--settings", "paper", "--modes", "ssd", "--draft-workers", "2"]
    argv += ["--draft-transports", "grpc", "--ssd-budget", "4", "--pair-reps", "2"]
    results = bench.run(parse([*argv, "--out-dir", str(tmp_path), "--no-progress"]))
    runs = {r["mode"]: r for r in results["runs"]}
    assert list(runs) == ["ssd B=4 D=2 tr=grpc"], list(runs)
    two = runs["ssd B=4 D=2 tr=grpc"]
    assert two["draft_workers"] == 2 and two["ssd"]["draft_workers"] == 2 and two["ssd"]["tree_branches"] == 8, two[
        "ssd"
    ]
    assert two["draft_transport"] == "grpc" and 0 <= two["cache_hit_rate"] <= 1
    assert "ssd B=4 D=2 tr=grpc" in bench.format_table(results["runs"])
    if os.cpu_count() < 3:
        assert any("share cores" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="--draft-transports: unknown"):
        bench.run(
            parse(["--target", target, "--draft", draft, "--draft-transports", "pigeon", "--out-dir", str(tmp_path)])
        )
    with pytest.raises(ValueError, match="--draft-splits: unknown"):
        bench.run(parse(["--target", target, "--draft", draft, "--draft-splits", "halves", "--out-dir", str(tmp_path)]))
    with pytest.raises(ValueError, match="--draft-worker-cpus: unknown.*choose from shared, pinned"):
        bench.run(
            parse(["--target", target, "--draft", draft, "--draft-worker-cpus", "own", "--out-dir", str(tmp_path)])
        )
    too_many = ["--draft-workers", f"1,{bench.available_cpus()}", "--draft-worker-cpus", "shared,pinned"]
    with pytest.raises(ValueError, match="--draft-worker-cpus pinned .* lower --draft-workers or leave out pinned"):
        bench.run(parse(["--target", target, "--draft", draft, *too_many, "--out-dir", str(tmp_path)]))


def test_tensor_parallel_rows(pair, tmp_path):
    target, draft = pair
    argv = ["--target", target, "--draft", draft, "--k", str(K), "--num-prompts", "1", "--max-tokens", "6"]
    argv += ["--temperatures", "0", "--settings", "paper", "--modes", "sd", "--tensor-parallel-size", "1,2"]
    results = bench.run(parse([*argv, "--pair-reps", "2", "--out-dir", str(tmp_path), "--no-progress"]))
    runs = {r["mode"]: r for r in results["runs"]}
    assert list(runs) == ["sd tp=1", "sd tp=2"], list(runs)
    assert runs["sd tp=2"]["tensor_parallel_size"] == 2 and runs["sd tp=2"]["generated_tokens"] > 0
    with pytest.raises(ValueError, match="--tensor-parallel-size values"):
        bench.run(
            parse(["--target", target, "--draft", draft, "--tensor-parallel-size", "0", "--out-dir", str(tmp_path)])
        )


def test_table_lists_every_run(bench_run):
    results, _ = bench_run
    table = bench.format_table(results["runs"])
    lines = [line for line in table.splitlines()[2:] if line.strip()]
    assert len(lines) == len(results["runs"])
    assert sum("unsupported" in line for line in lines) == len(SETTINGS) * len(TEMPERATURES)
    assert "pair stats" in bench.format_pair_stats(results["pair_stats"])


def test_pair_stats_only(pair, tmp_path, capsys):
    target, draft = pair
    results = bench.run(
        parse(
            [
                "--target",
                target,
                "--draft",
                draft,
                "--pair-stats-only",
                "--num-prompts",
                "1",
                "--max-tokens",
                "4",
                "--pair-reps",
                "5",
                "--out-dir",
                str(tmp_path),
                "--no-progress",
            ]
        )
    )
    assert results["runs"] == [] and results["pair_stats"]["acceptance_positions"] == 4
    assert json.loads((tmp_path / "bench.json").read_text())["pair_stats"] == results["pair_stats"]
    assert not (tmp_path / "bench.png").exists()
    out = capsys.readouterr().out
    assert "pair stats" in out and "tok/s" not in out


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--modes", "ar,nope"], "unknown mode"),
        (["--settings", "laptop"], "unknown setting"),
        (["--temperatures", "-1"], "temperatures"),
        (["--batch-sizes", "0"], "batch sizes"),
        (["--batch-sizes", "x"], "batch-sizes"),
        (["--k", "0"], "--k"),
        (["--saguaro-c", "1.5"], "saguaro-c"),
        (["--ssd-budget", "0"], "ssd-budget"),
        (["--repeats", "0"], "--repeats"),
    ],
)
def test_bad_arguments_raise_value_error(pair, tmp_path, argv, message):
    target, draft = pair
    with pytest.raises(ValueError, match=message):
        bench.run(parse(["--target", target, "--draft", draft, "--out-dir", str(tmp_path), *argv]))


def test_modes_needing_a_draft_are_refused_without_one(pair, tmp_path):
    with pytest.raises(ValueError, match="need a draft"):
        bench.run(parse(["--target", pair[0], "--modes", "ar,sd", "--out-dir", str(tmp_path)]))


def test_worker_failure_is_reported(tmp_path):
    missing = str(tmp_path / "no_such_model")
    with pytest.raises(RuntimeError, match="bench worker"):
        bench.run(parse(["--target", missing, "--draft", missing, "--out-dir", str(tmp_path), "--no-progress"]))


def test_modes_are_data_driven():
    assert set(MODES) | {"ssd-uniform", "hf-assisted-default"} <= set(bench.MODES)
    mode = bench.BenchMode("sd-again", "test entry", bench.engine_mode("sd"))
    try:
        bench.register_mode(mode)
        assert bench.MODES["sd-again"] is mode and mode.supports(64)
        assert not bench.MODES["hf-assisted"].supports(2)
    finally:
        bench.MODES.pop("sd-again", None)


def test_ratios_and_order():
    records = [
        {"setting": "s", "temperature": 0.0, "batch_size": 1, "mode": "sd", "supported": True, "tokens_per_s": 30.0},
        {"setting": "s", "temperature": 0.0, "batch_size": 1, "mode": "ar", "supported": True, "tokens_per_s": 10.0},
        {"setting": "s", "temperature": 0.0, "batch_size": 2, "mode": "sd", "supported": True, "tokens_per_s": 5.0},
        {"setting": "s", "temperature": 0.0, "batch_size": 2, "mode": "hf-assisted", "supported": False},
    ]
    bench._add_ratios(records)
    assert [r["ratio_to_ar"] for r in records] == [3.0, 1.0, None, None]  # no ar at batch 2
    ordered = bench._ordered(records)
    assert [(r["batch_size"], r["mode"]) for r in ordered] == [(1, "sd"), (1, "ar"), (2, "sd"), (2, "hf-assisted")]


def test_the_spread_over_prompts_pairs_each_prompt_with_sds_run_of_it():
    def run(mode: str, repeat: int, per_prompt: list[float]) -> dict:
        cell = dict(setting="s", threads=1, temperature=1.0, batch_size=1, supported=True, repeat=repeat)
        cell.update(tokens_per_round=2.0, draft_ms_per_round=1.0, verify_ms_per_round=1.0)
        return dict(cell, mode=mode, tokens_per_s=sum(per_prompt) / len(per_prompt), batch_tokens_per_s=per_prompt)

    records = [run("sd", 0, [10.0, 20.0, 40.0]), run("ssd", 0, [20.0, 20.0, 20.0])]
    records += [run("sd", 1, [10.0, 10.0, 10.0]), run("ssd", 1, [11.0, 12.0, 13.0])]
    out = {r["mode"]: r for r in bench._aggregate(records)}
    # Per prompt: 2.0, 1.0, 0.5 in repeat 0; 1.1, 1.2, 1.3 in repeat 1. Deciles over all six.
    lo, hi = out["ssd"]["batch_spread"]["batch_ratio_to_sd"]
    assert math.isclose(lo, 0.75) and math.isclose(hi, 1.65), (lo, hi)
    assert out["sd"]["batch_spread"]["batch_ratio_to_sd"] == [1.0, 1.0]
    assert "p10-p90" in bench.format_table(list(out.values()))


def test_ratio_to_best_is_paired_per_repeat():
    """auto's goal is measured against the best of ar, sd and ssd in the same repeat: the modes'
    runs are minutes apart at most, while this VM's speed drifts between repeats."""

    def run(mode: str, repeat: int, tps: float) -> dict:
        cell = dict(setting="s", temperature=1.0, batch_size=8)
        return dict(cell, mode=mode, supported=True, tokens_per_s=tps, repeat=repeat)

    records = [run("sd", 0, 100.0), run("ssd", 0, 80.0), run("auto", 0, 95.0)]  # a fast repeat
    records += [run("sd", 1, 60.0), run("ssd", 1, 70.0), run("auto", 1, 63.0)]  # a slow one: ssd best
    records += [run("hf-assisted", 1, 200.0)]  # not a mode auto chooses among
    bench._add_ratios(records)
    assert [r["ratio_to_best"] for r in records] == [1.0, 0.8, 0.95, 0.8571, 1.0, 0.9, 2.8571]
