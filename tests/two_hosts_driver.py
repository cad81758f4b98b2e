"""The target side of tests/test_two_hosts.py, run inside the head's network namespace: joins the
two-node Ray cluster, decodes greedily with the target alone, then with SSD over draft workers
pinned to the other node, for each transport, with the link taken down mid-stream once, and
prints what it saw as one JSON line.

Before that, the target split over two tensor-parallel ranks, one on each host: a placement group of
two bundles, the second pinned to the other node by its custom resource; rank 0 runs in a task in
the first bundle and starts rank 1 as an actor in the second (actors/tp_ranks.py), their
collectives crossing the veth.

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


def tensor_parallel_run(args: dict) -> dict:
    """Greedy output of the target over two ranks on two hosts, and the address of each rank's node."""
    import ray
    from ray.util import placement_group, placement_group_table, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    def rank_0(args: dict) -> list[list[int]]:
        from actors.tp_ranks import RayRanks
        from ssd import LLM, SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=args["max_tokens"], ignore_eos=True)
        with LLM(args["target"], None, RayRanks({"num_cpus": 1}), mode="ar", tensor_parallel_size=2) as llm:
            return [o.token_ids for o in llm.generate(args["prompts"], params)]

    group = placement_group([{"CPU": 1}, {"CPU": 1, "draft_node": 1}], strategy="STRICT_SPREAD")
    try:
        ray.get(group.ready(), timeout=60)
        strategy = PlacementGroupSchedulingStrategy(group, 0, placement_group_capture_child_tasks=True)
        tokens = ray.get(ray.remote(rank_0).options(num_cpus=1, scheduling_strategy=strategy).remote(args))
        nodes = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        hosts = [nodes[node] for _, node in sorted(placement_group_table(group)["bundles_to_node_id"].items())]
    finally:
        remove_placement_group(group)
    return {"tokens": tokens, "hosts": hosts}


def main() -> None:
    import ray

    from ssd import LLM, SamplingParams

    args = json.loads(sys.argv[1])
    ray.init(address=args["address"], log_to_driver=False)
    params = SamplingParams(temperature=0.0, max_tokens=args["max_tokens"], ignore_eos=True)
    with LLM(args["target"], None, mode="ar") as alone:
        result = {"alone": [o.token_ids for o in alone.generate(args["prompts"], params)]}
    result["tensor_parallel"] = tensor_parallel_run(args)  # first: its ranks are gone before workers take the node
    for transport in args["transports"]:
        result[transport] = ssd_run(args, transport)
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
