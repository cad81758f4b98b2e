"""The load benchmark's workload without the server: the same prompt mix in a closed loop of N
users, through the engine in this process (no HTTP, no Serve, no Ray), for the served/offline
ratio of each mode.

    python -m loadtest.offline --users 1,4 --duration 20 --modes sd,ar

Compare with `python -m loadtest.bench --think-ms 0` (its users also send their next request the
moment the last one ends) against `ssd serve` with the same engine settings. Prompts are drawn
as the locustfile draws them (chat items rendered by the server's chat template), greedy, each
with its own max_tokens. Reported per (mode, users): generated tokens per second over the run
and requests per second. Writes bench_results/loadtest_offline.json.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from loadtest.bench import write_cells
from serve_app.config import REQUEST_MODES
from serve_app.openai_api import DEFAULT_CHAT_TEMPLATE
from ssd import LLM, SamplingParams

PROMPTS = Path(__file__).with_name("prompts.jsonl")


def rendered(items: list[dict], tokenizer) -> list[tuple[str, int]]:
    """(prompt text, max_tokens) per item, chat items through the chat template the server uses."""
    template = getattr(tokenizer, "chat_template", None) or DEFAULT_CHAT_TEMPLATE
    out = []
    for item in items:
        text = item["prompt"]
        if item.get("kind") == "chat":
            messages = [{"role": "user", "content": text}]
            text = tokenizer.apply_chat_template(
                messages, chat_template=template, tokenize=False, add_generation_prompt=True
            )
        out.append((text, item.get("max_tokens", 64)))
    return out


def closed_loop(llm: LLM, prompts: list[tuple[str, int]], users: int, duration: float, seed: int) -> dict:
    """`users` requests in flight at all times for `duration` seconds; -> tok/s and req/s of the
    requests that finished within it."""
    engine, rng = llm.engine, random.Random(seed)
    in_flight, tokens, requests = 0, 0, 0
    start = time.perf_counter()
    while time.perf_counter() - start < duration:
        while in_flight < users:
            text, max_tokens = rng.choice(prompts)
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
            engine.add_request(engine.check_request(text, params), params)
            in_flight += 1
        for out in engine.step():
            if out.finished:
                in_flight -= 1
                tokens += len(out.token_ids)
                requests += 1
    elapsed = time.perf_counter() - start
    engine.abort([s.request_id for s in engine.running + engine.waiting])
    return {"tok_per_s": tokens / elapsed, "req_per_s": requests / elapsed}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.offline", description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=None, help="Target model directory (default: the demo pair's).")
    parser.add_argument("--draft", default=None, help="Draft model directory (default: the demo pair's).")
    parser.add_argument("--modes", default="sd,ar", help=f"Comma-separated, of: {', '.join(REQUEST_MODES)}.")
    parser.add_argument("--users", default="1,4", help="Comma-separated closed-loop user counts.")
    parser.add_argument("--duration", type=float, default=20.0, help="Seconds per cell.")
    parser.add_argument(
        "--num-threads",
        type=int,
        default=None,
        help="Torch threads of the engine (a served target replica runs with its target_num_cpus: 1 by default).",
    )
    parser.add_argument("--prompts-file", default=str(PROMPTS))
    parser.add_argument("--out", default="bench_results/loadtest_offline.json")
    args = parser.parse_args(argv)
    if (args.target is None) != (args.draft is None):
        parser.error("--target and --draft go together (neither: the demo pair)")
    unknown = [m for m in args.modes.split(",") if m not in REQUEST_MODES]
    if unknown:
        parser.error(f"--modes: unknown {unknown}; choose from {', '.join(REQUEST_MODES)}")
    from ssd.bench.plan import demo_pair

    target, draft = (args.target, args.draft) if args.target else demo_pair()
    items = [json.loads(line) for line in Path(args.prompts_file).read_text().splitlines() if line.strip()]
    users = [int(u) for u in args.users.split(",")]
    cells = []
    for mode in args.modes.split(","):
        engine = dict(mode=REQUEST_MODES[mode], max_num_seqs=max(users), num_threads=args.num_threads)
        with LLM(target, draft, **engine) as llm:
            prompts = rendered(items, llm.tokenizer)
            closed_loop(llm, prompts, 1, min(3.0, args.duration), seed=1)  # warm-up: first shapes, first rounds
            for n in users:
                cell = {"mode": mode, "users": n, **closed_loop(llm, prompts, n, args.duration, seed=0)}
                cells.append(cell)
                sys.stdout.write(
                    f"{mode:4s} users {n:3d}: {cell['tok_per_s']:7.1f} tok/s  {cell['req_per_s']:5.2f} req/s\n"
                )
                sys.stdout.flush()
    write_cells(args, cells)
    return 0


if __name__ == "__main__":
    sys.exit(main())
