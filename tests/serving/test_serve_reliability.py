"""Faults on a real Ray Serve deployment, each with its pass bar:

1. a draft worker killed while 16 greedy streams run: every stream completes with the text of the
   run without the fault, the pool is whole again within the draft deployment's health-check
   period plus a replica's start, and later requests hit the speculation cache again;
2. the whole draft pool (every DraftPool replica) killed while 16 streams run: zero failed
   requests, same texts, and SSD back once Serve has replaced them (the loss of the lease registry
   itself is tested in tests/test_ray_pool.py);
3. a target replica whose forward pass raises (a model with remote code that raises on a poison
   token): that request gets a 500 in the OpenAI envelope, the replica reports unhealthy and
   Serve replaces it, and requests sent meanwhile all succeed on the other replica (the ingress
   retries a replica that is down before its first chunk);
4. a barrage of bad inputs at HTTP and gRPC: only 4xx, the server healthy after, the ingress's
   and target's resident memory flat across repeats;
5. a target replica slow to close writes its threads' stacks to its log before Serve kills it.

Applications "rel" (SSD, a pool of 2 draft workers, 1 leased) and "faulty" (plain decoding, 2
target replicas) join the package's cluster for this module.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import pytest

requests = pytest.importorskip("requests")
grpc = pytest.importorskip("grpc")

import ray  # noqa: E402
from ray import serve  # noqa: E402

from loadtest.procs import rss_mb, serve_processes  # noqa: E402
from serve_app._proto import ssd_serve_pb2 as pb  # noqa: E402
from serve_app._proto import ssd_serve_pb2_grpc as pb_grpc
from serving.test_serve_limits import BAD  # noqa: E402
from serving.test_serve_metrics import scrape  # noqa: E402

PROMPTS = [f"def f{i}(x):\n    return" for i in range(16)]
MAX_TOKENS = 96
POISON = 7  # a token id whose presence in a forward pass makes the faulty model raise
FAULTY_CODE = f"""
from transformers import LlamaConfig, LlamaForCausalLM


class FaultyConfig(LlamaConfig):
    model_type = "ssd_test_faulty"


class FaultyForCausalLM(LlamaForCausalLM):
    config_class = FaultyConfig

    def forward(self, input_ids=None, **kwargs):
        if input_ids is not None and bool((input_ids == {POISON}).any()):
            raise RuntimeError("injected fault: poison token in the forward pass")
        return super().forward(input_ids=input_ids, **kwargs)
"""


def save_faulty_target(tiny_target: str, root: Path) -> str:
    """The tiny target with custom modeling code (loaded with trust_remote_code) that raises when
    the poison token enters a forward pass; any other input runs the Llama forward unchanged."""
    path = root / "faulty"
    shutil.copytree(tiny_target, path)
    config = json.loads((path / "config.json").read_text())
    config.update(
        model_type="ssd_test_faulty",
        architectures=["FaultyForCausalLM"],
        auto_map={
            "AutoConfig": "modeling_faulty.FaultyConfig",
            "AutoModelForCausalLM": "modeling_faulty.FaultyForCausalLM",
        },
    )
    (path / "config.json").write_text(json.dumps(config))
    (path / "modeling_faulty.py").write_text(FAULTY_CODE)
    return str(path)


@pytest.fixture(scope="module")
def apps(served, tiny_pair, tmp_path_factory):
    from serve_app.app import build_app

    target, draft = tiny_pair
    rel = {
        "engine": {
            "target": target,
            "draft": draft,
            "mode": "ssd",
            "k": 4,
            "ssd_budget": 12,
            "ssd_autobudget": False,
            "draft_transport": "torch",
            "max_num_seqs": 16,
            "draft_deadline_s": 2.0,
        },
        "extra_modes": [],
        "draft_pool_size": 2,
        "max_queue": 16,
        "health_check_period_s": 1.0,  # replicas replaced in seconds, not 15
        "model_name": "tiny-rel",
        "api_key": served.api_key,
    }
    faulty = {
        "engine": {
            "target": save_faulty_target(target, tmp_path_factory.mktemp("faulty")),
            "mode": "ar",
            "trust_remote_code": True,
            "max_num_seqs": 4,
        },
        "extra_modes": [],
        "target_replicas": 2,
        "max_queue": 16,
        "health_check_period_s": 1.0,
        "model_name": "tiny-faulty",
        "api_key": served.api_key,
    }
    serve.run(build_app(rel), name="rel", route_prefix="/rel")
    serve.run(build_app(faulty), name="faulty", route_prefix="/faulty")
    yield
    serve.delete("rel")
    serve.delete("faulty")


def post(served, path: str, body: dict, **kw):
    return requests.post(
        served.http + path, json=body, headers={"Authorization": f"Bearer {served.api_key}"}, timeout=120, **kw
    )


def stream_all(
    served, on_started=None, app: str = "rel", model: str = "tiny-rel", prompts=PROMPTS, max_tokens: int = MAX_TOKENS
) -> list[tuple[str, str | None]]:
    """The prompts as concurrent greedy streams on `app` -> (text, finish_reason) of each;
    on_started() runs once every stream has its first chunk."""
    out: list = [None] * len(prompts)
    barrier = threading.Barrier(len(prompts) + 1)

    def one(i: int) -> None:
        body = {
            "model": model,
            "prompt": prompts[i],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        text, finish, first = "", None, True
        try:
            with post(served, f"/{app}/v1/completions", body, stream=True) as r:
                assert r.status_code == 200, r.text
                for line in r.iter_lines():
                    if not line.startswith(b"data: ") or line == b"data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    assert "error" not in event, event
                    if first:
                        first = False
                        barrier.wait(60)
                    text += event["choices"][0]["text"]
                    finish = event["choices"][0].get("finish_reason") or finish
        finally:
            if first:
                barrier.abort()
        out[i] = (text, finish)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    barrier.wait(60)
    if on_started is not None:
        on_started()
    for t in threads:
        t.join(180)
    return out


def replicas(app: str, deployment: str) -> dict[str, object]:
    """replica id -> actor handle of a deployment's live replicas."""
    out = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name = entry["name"]
        if name.startswith(f"SERVE_REPLICA::{app}#{deployment}#"):
            try:
                out[name.rsplit("#", 1)[1]] = ray.get_actor(name, namespace=entry["namespace"])
            except ValueError:  # gone meanwhile
                continue
    return out


def pool_actor():
    from actors.lease_registry import get_or_create_registry

    return get_or_create_registry()


def pool_workers(app: str) -> list[dict]:
    """The lease registry's entries for the app's live draft replicas."""
    ids = {f"serve-{tag}" for tag in replicas(app, "DraftPool")}
    return [w for w in ray.get(pool_actor().snapshot.remote()) if w["worker_id"] in ids]


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.25)
    return value


def cache_hits_after(served) -> int:
    body = {"model": "tiny-rel", "prompt": "def g(y):", "max_tokens": 48, "temperature": 0, "ignore_eos": True}
    r = post(served, "/rel/v1/completions", body)
    assert r.status_code == 200, r.text
    return r.json()["speculation"][0]["cache_hits"]


@pytest.fixture(scope="module")
def reference(served, apps) -> list[tuple[str, str | None]]:
    """The 16 greedy streams on "rel" with its whole pool, before any fault: what each fault test's
    streams must equal (greedy, so the same whatever the pool did in between)."""
    wait_for(lambda: len(pool_workers("rel")) == 2, 60, "both draft workers registered")
    texts = stream_all(served)
    assert all(finish == "length" for _, finish in texts)
    return texts


def test_draft_worker_killed_under_16_streams(served, apps, reference):
    wait_for(lambda: len(pool_workers("rel")) == 2, 60, "both draft workers registered")
    killed = {}

    def kill_leased():
        leased = [w["worker_id"].removeprefix("serve-") for w in pool_workers("rel") if w["lessee"]]
        assert len(leased) == 1, pool_workers("rel")
        ray.kill(replicas("rel", "DraftPool")[leased[0]], no_restart=True)
        killed["at"], killed["id"] = time.monotonic(), leased[0]

    assert stream_all(served, kill_leased) == reference
    # Serve notices the dead replica at once and starts another, which registers once it
    # listens: the bar is the draft deployment's health-check period (5 s) plus a replica's
    # start (8-10 s on an idle 2-core machine, more under load). The dead one's entry is gone
    # (the target reported it failed).
    wait_for(lambda: len(pool_workers("rel")) == 2, 5 + 25, "the pool whole again")
    assert f"serve-{killed['id']}" not in {w["worker_id"] for w in ray.get(pool_actor().snapshot.remote())}
    assert cache_hits_after(served) > 0  # SSD resumed on a re-leased worker


def test_whole_draft_pool_killed_under_16_streams(served, apps, reference):
    wait_for(lambda: len(pool_workers("rel")) == 2, 60, "both draft workers registered")

    def kill_all():
        for handle in replicas("rel", "DraftPool").values():
            ray.kill(handle, no_restart=True)

    assert stream_all(served, kill_all) == reference  # zero failed, same texts: the backup drafted
    wait_for(lambda: len(pool_workers("rel")) == 2, 5 + 25, "the pool back")
    wait_for(lambda: cache_hits_after(served) > 0, 30, "SSD back on the new pool")


def test_target_whose_forward_raises_is_replaced(served, apps):
    before = set(wait_for(lambda: (r := replicas("faulty", "Target")) and len(r) == 2 and r, 60, "2 target replicas"))
    body = {"model": "tiny-faulty", "prompt": [1, POISON, 2], "max_tokens": 4, "temperature": 0}
    r = post(served, "/faulty/v1/completions", body)
    assert r.status_code == 500, r.text
    assert r.json()["error"]["code"] == "engine_failed" and "retry" in r.json()["error"]["message"]
    # Meanwhile every request succeeds: on the healthy replica, or retried there by the ingress.
    statuses = []
    ok = {"model": "tiny-faulty", "prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        statuses.append(post(served, "/faulty/v1/completions", ok).status_code)
        now = set(replicas("faulty", "Target"))
        if len(now) == 2 and now != before and len(statuses) >= 10:
            break
    assert statuses and set(statuses) == {200}, statuses
    assert len(now) == 2 and len(now - before) == 1, (before, now)  # exactly the broken one replaced
    assert requests.get(served.http + "/faulty/health", timeout=30).status_code == 200
    # With two idle replicas the router picks the broken one about half the time: retried.
    wait_for(lambda: "ray_ssd_target_retries_total" in scrape(served.metrics), 60, "the retry counter exported")


def rss_of(app: str, samples: int = 6) -> dict[str, float]:
    """Resident MiB of the app's ingress and target: the least of a few readings 0.1 s apart, as
    a target's single readings swing by tens of MiB with its transient buffers."""
    out: dict[str, float] = {}
    for i in range(samples):
        if i:
            time.sleep(0.1)
        for pid, title in serve_processes(app).items():
            if title.endswith((":Ingress", ":Target")):
                out[title] = min(out.get(title, float("inf")), rss_mb(pid) or 0.0)
    return out


def test_bad_input_barrage_http_and_grpc_leaves_memory_flat(served):
    headers = {"Authorization": f"Bearer {served.api_key}", "Content-Type": "application/json"}
    bad_grpc = [
        pb.GenerateRequest(model="tiny", prompt="x", max_tokens=2, temperature=float("nan")),
        pb.GenerateRequest(model="tiny", prompt="x", max_tokens=2**31 - 1),
        pb.GenerateRequest(model="tiny", prompt="x", max_tokens=2, stop=["s"] * 5000),
        pb.GenerateRequest(model="tiny", prompt="", prompt_token_ids=[10**9], max_tokens=2),
        pb.GenerateRequest(model="tiny", prompt="x", max_tokens=2, top_p=float("inf")),
        pb.GenerateRequest(model="tiny", prompt="\U0001f600\u202e" * 40000, max_tokens=2),
        pb.GenerateRequest(model="nope", prompt="x", max_tokens=2),
    ]
    # Warm-up: a replica that has served nothing yet grows by tens of MiB over its first requests
    # (lazy initialisation, allocator pools), whatever they are; in the suite, earlier modules
    # have already done this, but the module must hold alone too.
    for _ in range(4):
        r = requests.post(
            served.http + "/v1/completions",
            headers=headers,
            timeout=60,
            json={"model": "tiny", "prompt": "def f(x):", "max_tokens": 32, "temperature": 0, "ignore_eos": True},
        )
        assert r.status_code == 200
    sizes = []
    with grpc.insecure_channel(served.grpc) as channel:
        stub = pb_grpc.GenerationStub(channel)
        metadata = [("application", "main"), ("authorization", f"Bearer {served.api_key}")]
        for _ in range(9):
            for body, status, _ in BAD:
                if status == 200:
                    continue
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                r = requests.post(served.http + "/v1/completions", data=data, headers=headers, timeout=60)
                assert 400 <= r.status_code < 500, (body, r.status_code, r.text[:200])
            r = requests.post(served.http + "/v1/completions", data=b"{" * (2 << 20), headers=headers, timeout=60)
            assert r.status_code == 413
            for req in bad_grpc:
                for call in (
                    lambda r=req: stub.Generate(r, metadata=metadata),
                    lambda r=req: list(stub.GenerateStream(r, metadata=metadata)),
                ):
                    with pytest.raises(grpc.RpcError) as info:
                        call()
                    assert info.value.code() in (
                        grpc.StatusCode.INVALID_ARGUMENT,
                        grpc.StatusCode.NOT_FOUND,
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                    ), (req.model, info.value)
            sizes.append(rss_of("main"))
    assert requests.get(served.http + "/health", timeout=30).status_code == 200
    assert (
        requests.post(
            served.http + "/v1/completions",
            headers=headers,
            timeout=60,
            json={"model": "tiny", "prompt": "x", "max_tokens": 2},
        ).status_code
        == 200
    )
    # Flat after two repeats of warm-up (allocator pools, compiled regexes, imports). The ingress,
    # which refuses nearly all of the barrage, within 24 MiB. A target replica that had served
    # little before (this module run alone) takes one step of 35-50 MiB at a varying moment
    # within its first minute, then stays flat (readings taken alone: 542, 582, 582, 582, 585,
    # 585, 585). One reading can also be high for a moment and fall back: a CI run read 577, 588,
    # 569, 559, 592, 591, 638, so each end is the lower of two readings (repeats 2-3 and the
    # last two). A leak of L MiB per repeat grows that by 5 L: the bound of 64 MiB catches 13.
    assert set(sizes[0]) == set(sizes[-1]) and len(sizes[0]) == 2, sizes
    for title in sizes[0]:
        growth = min(s[title] for s in sizes[-2:]) - min(s[title] for s in sizes[2:4])
        assert growth < (24 if title.endswith(":Ingress") else 64), (title, [s[title] for s in sizes])


class _SlowLoop:
    """An engine loop whose close outlasts the stack-dump delay."""

    def close(self) -> None:
        time.sleep(0.5)


def test_a_target_replica_slow_to_close_writes_its_threads_stacks(monkeypatch, capfd):
    """Serve force-kills a replica still closing after graceful_shutdown_timeout_s; before that,
    the replica's log gets every thread's stack, so a close that hangs says where."""
    from serve_app import deployments

    monkeypatch.setattr(deployments, "CLOSE_STACKS_AFTER_S", 0.1)
    replica = object.__new__(deployments.TargetDeployment.func_or_class)
    replica.loop = _SlowLoop()
    replica.__del__()
    err = capfd.readouterr().err
    assert "Timeout (0:00:00.100000)!" in err and "in close" in err  # the stack names the blocking call
    replica.loop = None  # not closed twice when the object goes
