"""Memory and speed of a tensor-parallel target (`python -m benchmarks.tensor_parallel`).

Builds a random Llama-architecture target of a real layer shape (random weights are fine for
memory and speed), saves it as a safetensors checkpoint, and for each tensor_parallel_size t
starts `LLM(mode="ar", tensor_parallel_size=t)` in a fresh process and reports:
- each rank's peak resident memory (VmHWM) and its resident memory after decoding (VmRSS:
  weights, packed copies, cache), next to what the process held before loading (torch and
  transformers imported); t = 1 loads through Hugging Face's from_pretrained, as the engine does;
  with pack_target_weights on (the CPU default) the projections are held twice, as prepacked
  oneDNN copies beside the originals, so both settings are run;
- greedy decode tokens/s at batch 1 (plain decoding: every token one target forward).
Each rank runs cores/t torch threads. Writes --out as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository root, holding benchmarks/ and ssd/


def build_target(directory: Path, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, vocab: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from ssd.model.demo_models import build_tokenizer

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096,
        tie_word_embeddings=False, eos_token_id=0, bos_token_id=0,
    )  # fmt: skip
    with torch.device("cpu"):
        model = LlamaForCausalLM(config)
    model.save_pretrained(directory)
    build_tokenizer().save_pretrained(directory)  # its ids lie within any vocabulary of 258 tokens or more
    return sum(p.nbytes for p in model.parameters())


def _status_mib(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} for pid {pid}")


def measure(directory: str, world: int, tokens: int, pack: bool) -> dict:
    """In this process: load with `world` ranks, decode, read every rank's peak resident memory
    (VmHWM: anonymous and file-backed pages, the checkpoint's pages mapped while they are read
    included) and its resident memory after decoding (VmRSS: the weights, whether copied or mapped
    from the checkpoint, packed copies, cache)."""
    import torch  # noqa: F401  (imported before the baseline, as the engine's process has it)
    import transformers  # noqa: F401

    from ssd.core.sampling_params import SamplingParams
    from ssd.llm import LLM

    baseline = _status_mib(os.getpid(), "VmHWM")
    llm = LLM(directory, None, mode="ar", tensor_parallel_size=world, max_num_seqs=1, pack_target_weights=pack)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
    started = time.perf_counter()
    llm.generate([[5, 6, 7, 8]], params)
    seconds = time.perf_counter() - started
    pids = [os.getpid()]
    if world > 1:
        pids += [p.pid for p in llm.engine.target.ranks.processes.values()]
    peaks = [_status_mib(pid, "VmHWM") for pid in pids]
    resident = [_status_mib(pid, "VmRSS") for pid in pids]
    llm.close()
    return {
        "ranks": world, "pack_target_weights": pack, "baseline_mib": baseline, "peak_mib": peaks,
        "resident_mib": resident, "tokens_per_s": tokens / seconds,
    }  # fmt: skip


def _mib(values: list[float]) -> str:
    return ", ".join(f"{v:.0f}" for v in values)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tensor_parallel", description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", default="1,2", help="tensor_parallel_size values, comma-separated.")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--tokens", type=int, default=32, help="Tokens decoded per measurement.")
    parser.add_argument("--out", default="bench_results/tensor_parallel.json")
    parser.add_argument(
        "--pack", default="on,off", help="pack_target_weights settings to run, comma-separated (on: packed copies)."
    )
    parser.add_argument("--_measure", nargs=4, metavar=("DIR", "RANKS", "TOKENS", "PACK"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args._measure:
        directory, world, tokens, pack = args._measure
        sys.stdout.write(json.dumps(measure(directory, int(world), int(tokens), pack == "on")) + "\n")
        return 0
    with tempfile.TemporaryDirectory(prefix="ssd-tp-bench-") as root:
        directory = Path(root) / "target"
        weights = build_target(
            directory, args.hidden, args.layers, args.heads, args.kv_heads, args.intermediate, args.vocab
        )
        rows = []
        for pack in args.pack.split(","):
            for world in [int(r) for r in args.ranks.split(",")]:
                command = [sys.executable, "-m", "benchmarks.tensor_parallel", "--_measure", str(directory)]
                # From the repository root, where `benchmarks` is found, wherever this was started.
                done = subprocess.run(
                    command + [str(world), str(args.tokens), pack], capture_output=True, text=True, cwd=ROOT
                )
                if done.returncode:
                    raise RuntimeError(f"t={world} pack {pack} failed:\n{done.stderr[-3000:]}")
                row = json.loads(done.stdout.strip().splitlines()[-1])
                rows.append(row)
                sys.stdout.write(
                    f"t={world} pack {pack}: weights {weights / 2**20:.0f} MiB in all; per rank: peak "
                    f"{_mib(row['peak_mib'])} MiB, resident after decoding {_mib(row['resident_mib'])} MiB "
                    f"(the process held {row['baseline_mib']:.0f} MiB before loading); "
                    f"{row['tokens_per_s']:.1f} tok/s\n"
                )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"weights_mib": weights / 2**20, "runs": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
