"""The `ssd` command line: generate, bench, build-demo-models, and the subcommands other packages
register in the entry-point group "ssd.commands" (the serving package registers `serve`)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import UnionType
from typing import Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from ssd.core.config import DEMO_MODELS_DIR, EngineArgs
from ssd.core.sampling_params import SamplingParams

logger = logging.getLogger("ssd")


# Engine flags are stored under this dest prefix, apart from the request flags of `generate`.
ENGINE_DEST = "engine_"


def flag_options(name: str, field: FieldInfo) -> dict:
    """argparse options for one EngineArgs field. Every flag defaults to SUPPRESS, so only the
    flags a user gives reach EngineArgs and its defaults stay the single source of truth."""
    options: dict = {"dest": ENGINE_DEST + name, "default": argparse.SUPPRESS, "required": field.is_required()}
    # argparse %-formats help texts.
    options["help"] = (field.description or "").replace("%", "%%")
    annotation = field.annotation
    if get_origin(annotation) in (Union, UnionType):  # `X | None`: leaving the flag out keeps None
        rest = [a for a in get_args(annotation) if a is not type(None)]
        annotation = rest[0] if len(rest) == 1 else annotation  # other unions have no form below
    if annotation is bool:
        options["action"] = argparse.BooleanOptionalAction
        return options
    if get_origin(annotation) is Literal:
        options["choices"] = list(get_args(annotation))
        options["type"] = type(options["choices"][0])
    elif annotation in (int, float, str):
        options["type"] = annotation
        options["metavar"] = name.upper()  # not the dest's ENGINE_ prefix
    elif get_origin(annotation) is list and get_origin(get_args(annotation)[0]) is Literal:  # --flag a b c
        options["choices"] = list(get_args(get_args(annotation)[0]))
        options["type"] = type(options["choices"][0])
        options["nargs"] = "*"
        options["metavar"] = name.upper()
    elif annotation is dict or (isinstance(annotation, type) and issubclass(annotation, BaseModel)):  # as JSON
        options["type"] = _json_object
        options["metavar"] = "JSON"
    else:
        raise TypeError(
            f"config field {name}: {field.annotation} has no command-line form; teach ssd/cli.py flag_options it"
        )
    return options


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not JSON: {err}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object, e.g. '{\"num_cpus\": 1}'")
    return value


def engine_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineArgs field, --field-name, help = the field's description. A field
    whose flag a request flag already holds (seed) becomes --engine-field-name."""
    for name, field in EngineArgs.model_fields.items():
        flag = name.replace("_", "-")
        options = flag_options(name, field)
        try:
            parser.add_argument(f"--{flag}", **options)
        except argparse.ArgumentError:  # argparse checks conflicts before adding anything
            parser.add_argument(f"--engine-{flag}", **options)


def engine_args_from(args: argparse.Namespace) -> EngineArgs:
    """The EngineArgs of the engine flags given on the command line (validated: a bad value
    raises pydantic's ValidationError, a ValueError)."""
    given = {
        name: getattr(args, ENGINE_DEST + name) for name in EngineArgs.model_fields if hasattr(args, ENGINE_DEST + name)
    }
    return EngineArgs(**given)


def _cmd_generate(args: argparse.Namespace) -> int:
    from ssd.llm import LLM

    # Validate everything the user typed before loading any model.
    engine_args = engine_args_from(args)
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        stop=args.stop or [],
        seed=args.seed,
    )
    llm = LLM(**engine_args.model_dump(exclude_unset=True))
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
    from ssd.model.demo_models import DemoTrainingConfig, build_demo_models

    cfg = DemoTrainingConfig(target_steps=args.target_steps, draft_steps=args.draft_steps, threads=args.threads)
    report = build_demo_models(Path(args.out), cfg, progress=not args.no_progress, draft_only=args.draft_only)
    sys.stdout.write(json.dumps(report, indent=2) + "\n")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from ssd import bench

    bench.run(args)
    return 0


COMMAND_GROUP = "ssd.commands"


@dataclass(frozen=True)
class Command:
    """A subcommand another package registers (an entry point in COMMAND_GROUP names one)."""

    help: str  # one line, for `ssd --help`
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _registered_commands() -> list:
    """The subcommands installed packages register: entry points in COMMAND_GROUP, each naming an
    object with `help` (a line), `add_arguments(parser)` and `run(args) -> int`."""
    from importlib.metadata import entry_points

    return sorted(entry_points(group=COMMAND_GROUP), key=lambda ep: ep.name)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ssd", description="Speculative Speculative Decoding: generate, benchmark, build the demo models, serve."
    )
    parser.add_argument("--log-level", default="WARNING", help="Python logging level (DEBUG, INFO, WARNING, ...).")
    sub = parser.add_subparsers(dest="command", required=True)

    for entry in _registered_commands():
        command = entry.load()
        registered = sub.add_parser(entry.name, help=command.help)
        command.add_arguments(registered)
        registered.set_defaults(func=command.run)

    gen = sub.add_parser(
        "generate", help="Generate text offline with the engine and print it with speculation metrics."
    )
    gen.add_argument(
        "--prompt", action="append", help="A prompt; repeat for several (batched). Default: a Python function header."
    )
    gen.add_argument("--max-tokens", type=int, default=128, help="Tokens to generate per prompt (>= 1).")
    gen.add_argument(
        "--temperature", type=float, default=0.0, help=SamplingParams.model_fields["temperature"].description
    )
    gen.add_argument("--top-p", type=float, default=1.0, help="Nucleus sampling mass in (0, 1].")
    gen.add_argument("--top-k", type=int, default=0, help="Keep the k most likely tokens; 0 = off.")
    gen.add_argument("--stop", action="append", help="A stop string; repeat for several.")
    gen.add_argument("--seed", type=int, default=None, help=SamplingParams.model_fields["seed"].description)
    gen.add_argument("--stream", action="store_true", help="Print text as rounds finish (single prompt).")
    engine_arguments(gen)  # after the request flags: a name both use stays the request's
    gen.set_defaults(func=_cmd_generate)

    demo = sub.add_parser(
        "build-demo-models", help="Train the demo target/draft pair from the Python standard library (CPU ok)."
    )
    from ssd.model.demo_models import DemoTrainingConfig

    defaults = DemoTrainingConfig()
    demo.add_argument(
        "--out", default=str(DEMO_MODELS_DIR), help="Output directory (gets target/, draft/, training_report.json)."
    )
    demo.add_argument("--target-steps", type=int, default=defaults.target_steps, help="Optimizer steps for the target.")
    demo.add_argument("--draft-steps", type=int, default=defaults.draft_steps, help="Distillation steps for the draft.")
    demo.add_argument("--threads", type=int, default=defaults.threads, help="torch threads used for training.")
    demo.add_argument(
        "--draft-only", action="store_true", help="Keep the target in --out and distil only a new draft from it."
    )
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
