"""The target side of tests/test_two_hosts.py, run inside the head's network namespace: joins the
two-node Ray cluster, decodes greedily with the target alone, then with SSD over draft workers
pinned to the other node, for each transport, with the link taken down mid-stream once, and
prints what it saw as one JSON line.

argv[1]: JSON {"address", "target", "draft", "link", "prompts", "max_tokens", "down_s",
"transports"}; link is this namespace's end of the veth pair.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time


def set_link(link: str, state: str) -> None:
    subprocess.run(["ip", "link", "set", "dev", link, state], check=True)


def ssd_run(args: dict, transport: str) -> dict:
    from actors.leased_workers import leased_workers
    from ssd import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args["max_tokens"], ignore_eos=True)
    options = dict(
        mode="ssd", k=4, ssd_budget=8, ssd_autobudget=False, ssd_backup="neural", draft_launcher="ray",
        draft_transport=transport, draft_worker_resources={"num_cpus": 1, "resources": {"draft_node": 1}},
        draft_deadline_s=args["deadline_s"], max_num_seqs=len(args["prompts"]),
    )  # fmt: skip
    out: dict = {}
    with LLM(args["target"], args["draft"], worker_provider=leased_workers, **options) as llm:
        provider = llm.engine.proposer.client.provider
        out["peers"] = sorted(address for _, address in provider.held.values())
        out["connected"] = [o.token_ids for o in llm.generate(args["prompts"], params)]
        out["hits_connected"] = llm.metrics()["cache_hits"]
        # The partition: the link goes down after the first round and comes back down_s later.
        before = llm.metrics()
        tokens: dict[str, list[int]] = {}
        rounds: list[float] = []
        down = threading.Event()
        last = time.monotonic()
        for piece in llm.generate_stream(args["prompts"], params):
            now = time.monotonic()
            if not down.is_set():
                set_link(args["link"], "down")
                down.set()
                threading.Timer(args["down_s"], set_link, (args["link"], "up")).start()
            rounds.append(now - last)
            last = now
            tokens.setdefault(piece.request_id, []).extend(piece.delta_token_ids)
        after = llm.metrics()
        out["partitioned"] = list(tokens.values())
        out["backup_rounds"] = sum(
            after[k] - before[k] for k in ("backup_neural_rounds", "backup_fast_rounds") if k in after
        )
        out["longest_output_gap_s"] = max(rounds)
        # Back together: SSD hits again once the worker is reached (it may be re-leased first).
        deadline = time.monotonic() + 60
        hits = 0
        while hits == 0 and time.monotonic() < deadline:
            start = llm.metrics()["cache_hits"]
            llm.generate(args["prompts"], params)
            hits = llm.metrics()["cache_hits"] - start
        out["hits_after"] = hits
        out["peers_after"] = sorted(address for _, address in provider.held.values())
    return out


def main() -> None:
    import ray

    from ssd import LLM, SamplingParams

    args = json.loads(sys.argv[1])
    ray.init(address=args["address"], log_to_driver=False)
    params = SamplingParams(temperature=0.0, max_tokens=args["max_tokens"], ignore_eos=True)
    with LLM(args["target"], None, mode="ar") as alone:
        result = {"alone": [o.token_ids for o in alone.generate(args["prompts"], params)]}
    for transport in args["transports"]:
        result[transport] = ssd_run(args, transport)
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
