"""The `ssd` command line: generate, bench, build-demo-models."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from ssd.config import DEMO_MODELS_DIR, EngineArgs

logger = logging.getLogger("ssd")


def _engine_arguments(parser: argparse.ArgumentParser) -> None:
    fields = EngineArgs.model_fields
    parser.add_argument("--target", default=None, help=fields["target"].description)
    parser.add_argument("--draft", default=None, help=fields["draft"].description)
    parser.add_argument("--mode", default="sd", choices=["ar", "sd", "ssd"], help=fields["mode"].description)
    parser.add_argument("--ssd-budget", type=int, default=fields["ssd_budget"].default, help=fields["ssd_budget"].description)
    parser.add_argument("--ssd-fanout", default="geometric", choices=["geometric", "uniform"], help=fields["ssd_fanout"].description)
    parser.add_argument("--saguaro-c", type=float, default=1.0, help=fields["saguaro_c"].description)
    parser.add_argument("--ssd-backup", default="auto", choices=["auto", "neural", "fast"], help=fields["ssd_backup"].description)
    parser.add_argument("--k", type=int, default=fields["k"].default, help=fields["k"].description)
    parser.add_argument("--dtype", default="float32", choices=["auto", "float32", "float16", "bfloat16"], help=fields["dtype"].description)
    parser.add_argument("--draft-dtype", default=None, choices=["auto", "float32", "float16", "bfloat16"], help=fields["draft_dtype"].description)
    parser.add_argument("--device", default="cpu", help=fields["device"].description)
    parser.add_argument("--num-threads", type=int, default=None, help=fields["num_threads"].description)
    parser.add_argument("--max-num-seqs", type=int, default=fields["max_num_seqs"].default, help=fields["max_num_seqs"].description)


def _cmd_generate(args: argparse.Namespace) -> int:
    from ssd import LLM, SamplingParams

    llm = LLM(
        target=args.target, draft=args.draft, mode=args.mode, k=args.k, dtype=args.dtype, draft_dtype=args.draft_dtype,
        device=args.device, num_threads=args.num_threads, max_num_seqs=args.max_num_seqs,
        ssd_budget=args.ssd_budget, ssd_fanout=args.ssd_fanout, saguaro_c=args.saguaro_c, ssd_backup=args.ssd_backup,
    )
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        max_tokens=args.max_tokens, stop=args.stop or [], seed=args.seed,
    )
    prompts = args.prompt or ["def fibonacci(n):\n"]
    if args.stream and len(prompts) == 1:
        sys.stdout.write(prompts[0])
        for out in llm.generate_stream(prompts[0], params):
            sys.stdout.write(out.delta_text)
            sys.stdout.flush()
        sys.stdout.write("\n")
    else:
        for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=len(prompts) > 1)):
            sys.stdout.write(f"{prompt}{out.text}\n[finish_reason={out.finish_reason}]\n")
    sys.stdout.write(json.dumps({"engine": llm.metrics()}, indent=2) + "\n")
    llm.close()
    return 0


def _cmd_build_demo_models(args: argparse.Namespace) -> int:
    from ssd.demo_models import DemoTrainingConfig, build_demo_models

    cfg = DemoTrainingConfig(target_steps=args.target_steps, draft_steps=args.draft_steps, threads=args.threads)
    report = build_demo_models(Path(args.out), cfg, progress=not args.no_progress, draft_only=args.draft_only)
    sys.stdout.write(json.dumps(report, indent=2) + "\n")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from ssd import bench

    bench.run(args)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ssd", description="Speculative Speculative Decoding: generate, benchmark, build the demo models.")
    parser.add_argument("--log-level", default="WARNING", help="Python logging level (DEBUG, INFO, WARNING, ...).")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="Generate text offline with the engine and print it with speculation metrics.")
    _engine_arguments(gen)
    gen.add_argument("--prompt", action="append", help="A prompt; repeat for several (batched). Default: a Python function header.")
    gen.add_argument("--max-tokens", type=int, default=128, help="Tokens to generate per prompt (>= 1).")
    gen.add_argument("--temperature", type=float, default=0.0, help="Sampling temperature; 0 = greedy.")
    gen.add_argument("--top-p", type=float, default=1.0, help="Nucleus sampling mass in (0, 1].")
    gen.add_argument("--top-k", type=int, default=0, help="Keep the k most likely tokens; 0 = off.")
    gen.add_argument("--stop", action="append", help="A stop string; repeat for several.")
    gen.add_argument("--seed", type=int, default=None, help="Random seed of the request.")
    gen.add_argument("--stream", action="store_true", help="Print text as rounds finish (single prompt).")
    gen.set_defaults(func=_cmd_generate)

    demo = sub.add_parser("build-demo-models", help="Train the demo target/draft pair from the Python standard library (CPU ok).")
    from ssd.demo_models import DemoTrainingConfig

    defaults = DemoTrainingConfig()
    demo.add_argument("--out", default=str(DEMO_MODELS_DIR), help="Output directory (gets target/, draft/, training_report.json).")
    demo.add_argument("--target-steps", type=int, default=defaults.target_steps, help="Optimizer steps for the target.")
    demo.add_argument("--draft-steps", type=int, default=defaults.draft_steps, help="Distillation steps for the draft.")
    demo.add_argument("--threads", type=int, default=defaults.threads, help="torch threads used for training.")
    demo.add_argument("--draft-only", action="store_true", help="Keep the target in --out and distil only a new draft from it.")
    demo.add_argument("--no-progress", action="store_true", help="Hide progress bars.")
    demo.set_defaults(func=_cmd_build_demo_models)

    bench_parser = sub.add_parser("bench", help="Benchmark ar, sd and Hugging Face assisted generation side by side.")
    from ssd import bench

    bench.add_arguments(bench_parser)
    bench_parser.set_defaults(func=_cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ValueError as err:
        logger.error("%s", err)
        return 2


if __name__ == "__main__":
    sys.exit(main())
