"""Speed at real model shapes on a GPU (`python -m ssd.bench.real_shapes`).

Builds a random-weight target and draft of Llama-3.1-8B's and Llama-3.2-1B's shapes in bfloat16
on the GPU (random weights decide nothing about speed; they do make the draft's guesses
worthless, so acceptance and hit rates here are not the pair's), and reports:
- the device's copy bandwidth (bytes read plus written per second, a 2 GiB copy) and the
  bandwidth bound of plain decoding: one token reads every weight but the input embedding once,
  so tokens/s <= bandwidth / those bytes;
- ar: tokens/s at batch 1, greedy, and its share of the bound;
- sd and ssd: the wall time of a round against the time of its forwards, timed alone on the same
  runners (sd: the verification of K+1 tokens and K one-token draft steps; ssd: the verification,
  the draft runs elsewhere): what a round costs beyond its forwards.
The target is built in memory and handed to the engine; the draft is saved to a temporary
directory, since SSD's draft workers load it themselves. Writes --out as JSON.
For a pair at these shapes whose acceptance is real, see matched_pair.py and matched_bench.py
(which reuse SHAPES and save_for_engine).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

SHAPES = {  # the configs' sizes, from the models' published config.json files
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, tie_word_embeddings=False),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, tie_word_embeddings=True),
}  # fmt: skip


def build(shape: str, device: str, max_positions: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128256, max_position_embeddings=max_positions, rope_theta=500000.0, rms_norm_eps=1e-5,
        eos_token_id=0, bos_token_id=0, **SHAPES[shape],
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)
    return model.eval()


def copy_bandwidth(device: str, gib: float = 2.0) -> float:
    """Bytes read plus written per second by a device-to-device copy (the best of 10)."""
    src = torch.empty(int(gib * 2**30), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(10):
        torch.cuda.synchronize()
        started = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    return 2 * src.numel() / best


def streamed_bytes(model) -> int:
    """Bytes one decoding step reads: every parameter but the input embedding (unless tied)."""
    embed = model.model.embed_tokens.weight
    tied = model.lm_head.weight.data_ptr() == embed.data_ptr()
    return sum(p.nbytes for p in model.parameters()) - (0 if tied else embed.nbytes)


def forward_ms(runner, n: int, context: int, reps: int = 30) -> float:
    """One forward of n tokens per row at batch 1 after `context` cached tokens (graphs
    captured first), in ms: the mean of reps, the cache rolled back after each."""
    cache = runner.new_cache(1)
    runner.forward(cache, torch.randint(0, 250, (1, context)), with_logits=False)
    tokens = torch.randint(0, 250, (1, n))
    for _ in range(3):
        runner.forward(cache, tokens, on_host=False)
        cache.drop_last(torch.tensor([n]))
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(reps):
        runner.forward(cache, tokens, on_host=False)
        cache.drop_last(torch.tensor([n]))
    torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - started) / reps


def decode(engine, prompt: list[int], tokens: int, temperature: float) -> tuple[float, float, dict]:
    """Generate `tokens` tokens for one prompt, after a warm-up generate that captures the graphs
    -> (seconds, ms per round, the engine's metrics), of the second generate alone."""
    from ssd.core.sampling_params import SamplingParams

    params = SamplingParams(temperature=temperature, max_tokens=tokens, ignore_eos=True, seed=0)
    for _ in range(2):  # a warm-up generate (it captures the graphs), then the timed one
        before = engine.engine_metrics()
        torch.cuda.synchronize()
        started = time.perf_counter()
        rid = engine.add_request(prompt, params)
        while not any(o.finished and o.request_id == rid for o in engine.step()):
            pass
    metrics = engine.engine_metrics()
    rounds = metrics["rounds"] - before["rounds"]
    round_ms = 1000 * (metrics["step_seconds_total"] - before["step_seconds_total"]) / max(1, rounds)
    return time.perf_counter() - started, round_ms, metrics


def save_for_engine(root: Path, target, draft) -> None:
    """The draft in full (SSD's workers load it) and the target's config alone (its weights stay
    in memory, handed to the engine), each with the demo tokenizer."""
    from ssd.model.demo_models import build_tokenizer

    draft.save_pretrained(root / "draft")
    target.config.save_pretrained(root / "target")
    for name in ("target", "draft"):
        build_tokenizer().save_pretrained(root / name)


def measure_mode(args, root: Path, mode: str, target, draft, prompt: list[int]) -> dict:
    """One mode's engine over the built models -> its tokens/s, round time and forwards' time."""
    from ssd.core.config import EngineArgs
    from ssd.engine.factory import engines_over
    from ssd.model.demo_models import build_tokenizer
    from ssd.model.loader import LoadedPair

    config = EngineArgs(
        target=str(root / "target"), draft=str(root / "draft"), mode=mode, k=args.k, dtype="bfloat16",
        device=args.device, max_num_seqs=1, ssd_autobudget=False, enforce_eager=args.enforce_eager,
    ).to_config()  # fmt: skip
    pair = LoadedPair(target, draft if mode == "sd" else None, build_tokenizer(), args.context * 4)
    engine = engines_over(pair, {mode: config})[mode]
    try:
        seconds, round_ms, metrics = decode(engine, prompt, args.tokens, args.temperature)
        forwards_ms = forward_ms(engine.target, args.k + 1 if mode != "ar" else 1, args.context)
        if mode == "sd":
            forwards_ms += args.k * forward_ms(engine.proposers["sd"].runner, 1, args.context)
    finally:
        engine.close()
    return {"mode": mode, "tok_s": args.tokens / seconds, "round_ms": round_ms, "forwards_ms": forwards_ms,
            "beyond_forwards": round_ms / forwards_ms - 1, "hit_rate": metrics.get("cache_hit_rate"),
            "cuda_graphs": metrics.get("cuda_graphs")}  # fmt: skip


def run(args) -> dict:
    positions = args.context + 2 * args.tokens + 64
    target = build(args.target_shape, args.device, positions)
    draft = build(args.draft_shape, args.device, positions)
    bandwidth = copy_bandwidth(args.device)
    streamed = streamed_bytes(target)
    out = {"device": torch.cuda.get_device_name(), "copy_bandwidth_gb_s": bandwidth / 1e9,
           "target_streamed_gb": streamed / 1e9, "bound_tok_s": bandwidth / streamed, "runs": []}  # fmt: skip
    prompt = torch.randint(0, 250, (args.context,)).tolist()
    with tempfile.TemporaryDirectory(prefix="ssd-real-shapes-") as root:
        save_for_engine(Path(root), target, draft)
        for mode in args.modes.split(","):
            row = measure_mode(args, Path(root), mode, target, draft, prompt)
            out["runs"].append(row)
            share = f", {row['tok_s'] / out['bound_tok_s']:.0%} of the bound" if mode == "ar" else ""
            sys.stdout.write(
                f"{mode}: {row['tok_s']:.1f} tok/s{share}; round {row['round_ms']:.2f} ms, its forwards "
                f"{row['forwards_ms']:.2f} ms (+{row['beyond_forwards']:.1%})\n"
            )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ssd.bench.real_shapes", description=__doc__.split("\n")[0])
    parser.add_argument("--target-shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    parser.add_argument("--draft-shape", default="llama-3.2-1b", choices=sorted(SHAPES))
    parser.add_argument("--modes", default="ar,sd,ssd", help="Comma-separated: ar, sd, ssd.")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--k", type=int, default=6)
    parser.add_argument("--context", type=int, default=128, help="Prompt tokens before decoding.")
    parser.add_argument("--tokens", type=int, default=128, help="Tokens decoded per mode.")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--enforce-eager", action="store_true", help="Run without CUDA graphs.")
    parser.add_argument("--out", default="bench_results/real_shapes.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    out = run(args)
    sys.stdout.write(
        f"{out['device']}: copy bandwidth {out['copy_bandwidth_gb_s']:.0f} GB/s, target streams "
        f"{out['target_streamed_gb']:.2f} GB per token: bound {out['bound_tok_s']:.1f} tok/s\n"
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
