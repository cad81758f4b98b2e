"""Tokens/s of SSD with the draft on a device of its own, projected from parts measured elsewhere.

Why: with one device, target and draft share its cores or its memory bus, so a measured ssd run
shows what sharing costs, not what the paper's layout (the draft on its own GPU) would give. The
parts of a round can be measured on one device, though, and the SSD paper's Theorem 7 (its
speedup over plain decoding, in absolute times) puts them together:

    tokens/s = 1000 * [p E_hit + (1 - p) E_miss] / [p (max(t_v, t_p) + t_x) + (1 - p) (t_v + t_x + t_b)]

- p: the hit rate (the share of rounds whose outcome was in the speculation cache);
- E_hit, E_miss: tokens per round on a hit and on a miss;
- t_v: the target's verification of K + 1 tokens (ms), t_p: the primary speculation (the draft's
  glue decode and fork, then K tree depths), t_b: the backup speculation a miss waits for (the
  neural backup: K draft steps just in time), t_x: the exchange per round (outcome out,
  speculation back).
On a hit the next round starts once both the verification and the tree are done; on a miss the
target waits for the backup after its verification. With t_x = 0 and every time in units of
t_v this is Theorem 7's speedup over ar, [p E_hit + (1-p) E_miss] / [p max(1, T_p) + (1-p)(1 + T_b)],
times ar's rate 1 / t_v: the exchange is the one term added, since here it is measured.

`project_runs` takes the inputs from `ssd bench`'s records at batch 1 (a round is then one
sequence's): t_v and t_b from sd (its verification, and its K draft steps, which is what a
neural backup runs), E_miss as sd's tokens per round (a round after a neural backup is an sd
round), t_p, t_x, p and E_hit from ssd. Both ssd inputs err low where the draft was slow on the
shared device: the exchange as measured includes any wait for a late tree, and E_hit counts the
trees the engine cut short rather than wait for.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

FORMULA = "1000 [p E_hit + (1-p) E_miss] / [p (max(t_v, t_p) + t_x) + (1-p) (t_v + t_x + t_b)]"


@dataclass(frozen=True)
class ProjectionInputs:
    verify_ms: float  # t_v: the target's verification of K + 1 tokens
    primary_ms: float  # t_p: the primary speculation, prepared and K depths deep
    backup_ms: float  # t_b: the backup speculation a miss waits for
    exchange_ms: float  # t_x: the exchange per round
    p_hit: float  # p
    e_hit: float  # tokens per round on a hit
    e_miss: float  # tokens per round on a miss


def projected_tokens_per_s(inputs: ProjectionInputs) -> float:
    """Theorem 7 in absolute times (module docstring): expected tokens over expected ms per round."""
    p = inputs.p_hit
    if not 0 <= p <= 1:
        raise ValueError(f"p_hit must be in [0, 1], got {p}")
    tokens = p * inputs.e_hit + (1 - p) * inputs.e_miss
    hit_ms = max(inputs.verify_ms, inputs.primary_ms) + inputs.exchange_ms
    miss_ms = inputs.verify_ms + inputs.exchange_ms + inputs.backup_ms
    return 1000 * tokens / (p * hit_ms + (1 - p) * miss_ms)


def inputs_from_records(sd: dict, ssd: dict, k: int) -> ProjectionInputs | None:
    """The inputs from an sd and an ssd record of the same batch-1 run (bench.json's field names;
    module docstring), or None where one is missing."""
    gauges = ssd.get("ssd") or {}
    counters = ssd.get("counters") or {}
    needed = (sd.get("verify_ms_per_round"), sd.get("draft_ms_per_round"), sd.get("tokens_per_round"),
              ssd.get("cache_hit_rate"), gauges.get("drafter_prepare_ms"), gauges.get("drafter_depth_ms"))  # fmt: skip
    if any(v is None for v in needed):
        return None
    if counters.get("hit_steps"):  # at batch 1 a step is a round: the run's own totals
        e_hit = counters["hit_step_tokens"] / counters["hit_steps"]
    else:
        e_hit = gauges.get("tokens_per_round_on_hit") or ssd.get("tokens_per_round") or 0.0
    return ProjectionInputs(
        verify_ms=sd["verify_ms_per_round"],
        primary_ms=gauges["drafter_prepare_ms"] + k * gauges["drafter_depth_ms"],
        backup_ms=sd["draft_ms_per_round"],
        exchange_ms=ssd.get("target_exchange_ms") or 0.0,
        p_hit=ssd["cache_hit_rate"],
        e_hit=e_hit,
        e_miss=sd["tokens_per_round"],
    )


def project(sd: dict, ssd: dict, k: int) -> dict | None:
    """One projection: its inputs, the projected tokens/s and its ratio to sd's measured decode
    tokens/s (prefill excluded on both sides), or None without inputs."""
    inputs = inputs_from_records(sd, ssd, k)
    if inputs is None:
        return None
    projected = projected_tokens_per_s(inputs)
    measured = sd.get("decode_tokens_per_s")
    return {
        "projected_tokens_per_s": round(projected, 3),
        "sd_decode_tokens_per_s": measured,
        "ratio_to_sd": round(projected / measured, 4) if measured else None,
        "inputs": {name: round(value, 4) for name, value in asdict(inputs).items()},
        "formula": FORMULA,
    }


def project_runs(runs: list[dict], k: int) -> list[dict]:
    """A projection for every supported ssd record at batch 1 that has an sd record beside it
    (same setting and temperature)."""
    batch_1 = [r for r in runs if r["batch_size"] == 1 and r.get("supported")]
    sd = {(r["setting"], r["temperature"]): r for r in batch_1 if r["mode"] == "sd"}
    out = []
    for r in batch_1:
        base = sd.get((r["setting"], r["temperature"]))
        row = project(base, r, k) if base and r.get("base_mode", r["mode"]) == "ssd" else None
        if row is not None:
            out.append({"setting": r["setting"], "temperature": r["temperature"], "mode": r["mode"], **row})
    return out


def format_projection(row: dict, label: str) -> str:
    """Two lines: the projection, labelled as one, and the inputs it came from."""
    i = row["inputs"]
    measured = row["sd_decode_tokens_per_s"]
    ratio = f" = {row['ratio_to_sd']:.2f}x sd's measured {measured:.1f}" if row["ratio_to_sd"] else ""
    return (
        f"  {label}: PROJECTED {row['projected_tokens_per_s']:.1f} tok/s with the draft on its own device{ratio}\n"
        f"    from t_v {i['verify_ms']:.2f} ms, t_p {i['primary_ms']:.2f} ms, t_b {i['backup_ms']:.2f} ms, "
        f"t_x {i['exchange_ms']:.2f} ms, p {i['p_hit']:.3f}, E_hit {i['e_hit']:.2f}, E_miss {i['e_miss']:.2f}"
    )


def format_projections(rows: list[dict]) -> str:
    head = f"projection, not a measurement (Theorem 7: tokens/s = {FORMULA}; batch 1):"
    lines = [format_projection(r, f"{r['setting']} T={r['temperature']:g} {r['mode']}") for r in rows]
    return "\n".join([head, *lines])
