"""Serving overhead: tokens per second and time to first token at batch 1, through HTTP
(streaming, the OpenAI endpoint) against the offline engine with the same options.

    python -m serve_app.bench --mode ssd --requests 8 --max-tokens 128

Runs the offline `LLM` first (then closes it), then starts a local Ray cluster with Serve and the
application on free ports (or uses --url), sends the same greedy requests one at a time, and
prints and writes (bench_results/serve_overhead.json) per-mode figures: tok/s = generated
tokens / wall time of the requests, TTFT = request sent to first text received. The offline
engine runs the drafts as local processes over the same transport; served, they are Ray actors.
"""

from __future__ import annotations

import argparse
import json
import logging
import socket
import statistics
import sys
import time
from pathlib import Path

import requests

from ssd.model.demo_models import heldout_prompts


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def offline(engine: dict, prompts: list[str], max_tokens: int) -> dict:
    from ssd import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    with LLM(**{**engine, "draft_launcher": "process"}) as llm:
        llm.generate(prompts[0], params)  # warm-up
        ttft, tokens, started = [], 0, time.perf_counter()
        for prompt in prompts:
            sent = time.perf_counter()
            first = None
            for out in llm.generate_stream(prompt, params):
                if first is None and out.delta_text:
                    first = time.perf_counter()
                if out.finished:
                    tokens += len(out.token_ids)
            ttft.append(first - sent)
        elapsed = time.perf_counter() - started
        verify_ms = llm.metrics()["verify_ms_per_round"]
    return {
        "tok_per_s": tokens / elapsed,
        "ttft_ms_p50": 1000 * statistics.median(ttft),
        "tokens": tokens,
        "verify_ms_per_round": verify_ms,
    }


def http(url: str, model: str, prompts: list[str], max_tokens: int, api_key: str | None) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    body = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    session = requests.Session()

    def one(prompt: str) -> tuple[float, int]:
        sent, first, tokens = time.perf_counter(), None, 0
        with session.post(
            f"{url}/v1/completions", json={**body, "prompt": prompt}, headers=headers, stream=True, timeout=600
        ) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if first is None and event["choices"] and event["choices"][0]["text"]:
                    first = time.perf_counter()
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
        return first - sent, tokens

    one(prompts[0])  # warm-up
    ttft, tokens, started = [], 0, time.perf_counter()
    for prompt in prompts:
        t, n = one(prompt)
        ttft.append(t)
        tokens += n
    elapsed = time.perf_counter() - started
    return {"tok_per_s": tokens / elapsed, "ttft_ms_p50": 1000 * statistics.median(ttft), "tokens": tokens}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m serve_app.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default="ssd,sd", help="Comma-separated engine modes to measure (ar, sd, ssd).")
    parser.add_argument("--k", type=int, default=6)
    parser.add_argument(
        "--num-threads",
        type=int,
        default=1,
        help="torch threads of the target in both runs (a Serve replica gets OMP_NUM_THREADS = its num_cpus from Ray, "
        "1 by default; "
        "the offline engine would take every core).",
    )
    parser.add_argument(
        "--stream-interval-ms", type=float, default=None, help="The app's stream_interval_ms (default: AppConfig's)."
    )
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--target", default=None, help="Target model (default: the demo pair).")
    parser.add_argument("--draft", default=None)
    parser.add_argument("--out", default="bench_results/serve_overhead.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    prompts = heldout_prompts(args.requests, prompt_bytes=96)
    results = {}
    for mode in args.modes.split(","):
        engine = {
            "target": args.target,
            "draft": args.draft,
            "mode": mode,
            "k": args.k,
            "max_num_seqs": 1,
            "num_threads": args.num_threads,
        }
        if mode == "ssd":
            engine["draft_transport"] = "torch"
        row = {"offline": offline(engine, prompts, args.max_tokens)}
        row["http"] = _served(engine, prompts, args.max_tokens, args.stream_interval_ms)
        row["http_over_offline"] = row["http"]["tok_per_s"] / row["offline"]["tok_per_s"]
        results[mode] = row
        sys.stdout.write(
            f"{mode:4s} offline {row['offline']['tok_per_s']:7.1f} tok/s (TTFT "
            f"{row['offline']['ttft_ms_p50']:6.1f} ms)   "
            f"HTTP {row['http']['tok_per_s']:7.1f} tok/s (TTFT {row['http']['ttft_ms_p50']:6.1f} ms)   "
            f"HTTP/offline {row['http_over_offline']:.3f}   verify ms/round offline "
            f"{row['offline']['verify_ms_per_round']:.2f} "
            f"HTTP {row['http']['verify_ms_per_round']:.2f}\n"
        )
        sys.stdout.flush()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    return 0


def _served(engine: dict, prompts: list[str], max_tokens: int, stream_interval_ms: float | None) -> dict:
    import ray
    from ray import serve
    from ray.serve.config import HTTPOptions

    from serve_app.app import build_app

    port = _free_port()
    ray.init(include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    try:
        serve.start(http_options=HTTPOptions(host="127.0.0.1", port=port))
        config = {
            "engine": {k: v for k, v in engine.items() if v is not None},
            "extra_modes": [],
            "model_name": "bench",
        }
        if stream_interval_ms is not None:
            config["stream_interval_ms"] = stream_interval_ms
        serve.run(build_app(config), name="bench", route_prefix="/")
        result = http(f"http://127.0.0.1:{port}", "bench", prompts, max_tokens, None)
        # The engine's own time per verification inside the replica (warm-up included, as offline).
        stats = serve.get_deployment_handle("Target", app_name="bench").stats.remote().result()
        result["verify_ms_per_round"] = stats[f"{engine['mode']}_metrics"]["verify_ms_per_round"]
        return result
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
