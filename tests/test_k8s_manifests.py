"""KubeRay manifests (k8s/), rendered as kustomize would and validated offline (no Ray or
Kubernetes cluster): the KubeRay CRD schemas, Ray Serve's config schema, the application built
from its args (binds deployments, starts nothing), every replica at the most its autoscaling
reaches packed onto the pods of every group at its maxReplicas as Ray would count them, the
autoscaling settings, and (production overlay) the GCS kept in Redis. The broken copies at the end
show each check catching its mistake.
"""

from __future__ import annotations

import copy
import math
import re
import shutil
import subprocess
import typing
from functools import lru_cache
from pathlib import Path

import jsonpatch
import jsonschema
import pytest
import yaml
from pydantic import BaseModel

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "k8s"
KUBERAY = Path(__file__).resolve().parents[2] / "shared" / "kuberay"
TARGETS = ["base", "overlays/cpu-demo", "overlays/gpu-70b"]
PRODUCTION = "overlays/gpu-70b"  # k8s/README.md: the one that must survive the loss of its head
HAVE_CRDS = (KUBERAY / "ray.io_rayservices.yaml").is_file() and (KUBERAY / "ray.io_rayclusters.yaml").is_file()
needs_crds = pytest.mark.skipif(not HAVE_CRDS, reason=f"KubeRay CRDs not found in {KUBERAY}")


class ManifestError(AssertionError):
    pass


# ---- rendering: the subset of kustomize the manifests use, and nothing else -------------------


def render(kdir: Path) -> list[dict]:
    spec = yaml.safe_load((kdir / "kustomization.yaml").read_text())
    # A field this renderer ignores would make its output differ from kustomize's unseen.
    assert set(spec) <= {"apiVersion", "kind", "resources", "patches", "images"}, set(spec)
    docs = []
    for res in spec.get("resources", []):
        path = kdir / res
        docs += render(path) if path.is_dir() else [d for d in yaml.safe_load_all(path.read_text()) if d]
    for patch in spec.get("patches", []):
        ops = yaml.safe_load((kdir / patch["path"]).read_text())
        assert isinstance(ops, list), f"{patch['path']}: only JSON6902 patches (a list of ops) are rendered"
        hits = [i for i, d in enumerate(docs) if _targets(d, patch["target"])]
        assert hits, f"{patch['path']}: its target matches nothing"
        for i in hits:
            docs[i] = jsonpatch.apply_patch(docs[i], ops)
    for image in spec.get("images", []):
        for doc in docs:
            for container in _containers(doc):
                name, _, tag = container["image"].partition(":")
                if name == image["name"]:
                    container["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag)}"
    return docs


def _targets(doc: dict, target: dict) -> bool:
    group, _, version = doc["apiVersion"].rpartition("/")
    have = {"group": group, "version": version, "kind": doc["kind"], "name": doc["metadata"]["name"]}
    return all(have[k] == v for k, v in target.items())


def _containers(node):
    """Every container and init container, wherever the pod templates sit."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        yield from value if key in ("containers", "initContainers") else _containers(value)


@lru_cache
def rendered(target: str) -> tuple:
    return tuple(render(K8S / target))


def rayservice(docs) -> dict:
    found = [d for d in docs if d["kind"] == "RayService"]
    assert len(found) == 1, f"{len(found)} RayServices"
    return found[0]


# ---- KubeRay CRD schemas ----------------------------------------------------------------------


def _closed(schema):
    """Unknown fields fail, as with kubectl's strict field validation (its default since
    Kubernetes 1.27); without it the API server silently drops a misspelt field."""
    if isinstance(schema, dict):
        schema = {k: _closed(v) for k, v in schema.items()}
        if (
            "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            schema["additionalProperties"] = False
        return schema
    return [_closed(v) for v in schema] if isinstance(schema, list) else schema


@lru_cache
def crd_schema(name: str) -> dict:
    crd = yaml.load((KUBERAY / name).read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return _closed(version["schema"]["openAPIV3Schema"])


def crd_problems(rs: dict) -> list[str]:
    checks = [
        (rs, crd_schema("ray.io_rayservices.yaml"), "RayService"),
        (
            rs["spec"].get("rayClusterConfig", {}),
            crd_schema("ray.io_rayclusters.yaml")["properties"]["spec"],
            "RayCluster spec",
        ),
    ]
    out = []
    for obj, schema, what in checks:
        for err in jsonschema.Draft7Validator(schema).iter_errors(obj):
            out.append(f"{what} schema: /{'/'.join(map(str, err.absolute_path))}: {err.message}")
    return out


# ---- serveConfigV2: Ray Serve's schema, then the application itself ----------------------------


def _models(annotation):
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation
    for arg in typing.get_args(annotation):
        yield from _models(arg)


def unknown_keys(value, model: type[BaseModel], where: str) -> list[str]:
    """Keys Serve's schema would silently ignore (its models accept extra keys)."""
    if not isinstance(value, dict):
        return []
    fields = model.model_fields
    out = [f"{where}.{k}" for k in value if k not in fields and k not in {f.alias for f in fields.values()}]
    for key, sub in value.items():
        inner = next(_models(fields[key].annotation), None) if key in fields else None
        for item in (sub if isinstance(sub, list) else [sub]) if inner else []:
            out += unknown_keys(item, inner, f"{where}.{key}")
    return out


def _attempt(what: str, fn, *args):
    try:
        return fn(*args)
    except Exception as err:  # noqa: BLE001 - any failure is the manifest's
        raise ManifestError(f"{what}: {err!r}") from None


_GROUP_KEYS = ("placement_group_bundles", "placement_group_strategy")


def _group_demand(name: str, options: dict, placement_group_bundles, placement_group_strategy) -> dict:
    """A replica with a placement group -> actor options standing for what it takes of one node:
    all its bundles, packed on one node (the only strategy this fit check models)."""
    if placement_group_strategy != "STRICT_PACK":
        raise ManifestError(f"{name}: the fit check models STRICT_PACK placement groups only")
    if not _fits(_demand(options), placement_group_bundles[0]):
        raise ManifestError(f"{name}: ray_actor_options {options} do not fit placement_group_bundles[0]")
    total = {}
    for bundle in placement_group_bundles:
        for key, value in bundle.items():
            total[key] = total.get(key, 0) + value
    custom = {k: v for k, v in total.items() if k not in ("CPU", "GPU")}
    return {"num_cpus": total.get("CPU", 0), "num_gpus": total.get("GPU", 0), "resources": custom}


def _check_target(over: dict, dep, config) -> None:
    """The Target's overrides say what the args say: resources per rank, a bundle per rank."""
    import serve_app.placement

    reserved = serve_app.placement.target_actor_options(config)
    options = over.get("ray_actor_options", dep.ray_actor_options) or {}
    if (options.get("num_cpus", 1), options.get("num_gpus", 0)) != (reserved["num_cpus"], reserved["num_gpus"]):
        raise ManifestError(
            f"the Target override's num_cpus/num_gpus disagree with target_num_cpus/target_num_gpus ({reserved})"
        )
    ranks, bundles = (
        config.engine.tensor_parallel_size,
        over.get(_GROUP_KEYS[0], dep._replica_config.placement_group_bundles),
    )
    per_rank = {"CPU": reserved["num_cpus"], "GPU": reserved["num_gpus"]}
    if ranks > 1 and (
        len(bundles or []) != ranks or any({k: b.get(k, 0) for k in per_rank} != per_rank for b in bundles)
    ):
        raise ManifestError(
            f"the Target's placement_group_bundles must be engine.tensor_parallel_size ({ranks}) bundles of "
            f"target_num_cpus CPU and target_num_gpus GPU ({per_rank}) each: {bundles}"
        )
    strategy = over.get(_GROUP_KEYS[1], dep._replica_config.placement_group_strategy)
    if ranks > 1 and strategy != config.tensor_parallel_strategy:
        raise ManifestError(f"the Target's placement_group_strategy {strategy} is not tensor_parallel_strategy")


def most_replicas(dep) -> int:
    """The most replicas Serve runs of a built deployment: its autoscaling_config's max_replicas,
    or its fixed num_replicas."""
    scaling = dep._deployment_config.autoscaling_config
    return scaling.max_replicas if scaling else dep.num_replicas


def serve_checks(rs: dict):
    """Validates serveConfigV2; returns it, its AppConfig and, per deployment, (the most replicas,
    ray_actor_options) as the Serve controller will run them. Raises ManifestError."""
    from ray._common.utils import import_attr  # what Serve resolves import paths with
    from ray.serve._private.build_app import build_app as serve_build
    from ray.serve.schema import RayActorOptionsSchema, ServeDeploySchema

    import serve_app.app

    if not isinstance(rs["spec"].get("serveConfigV2"), str):
        raise ManifestError("serveConfigV2 must be a YAML string")
    cfg = yaml.safe_load(rs["spec"]["serveConfigV2"])
    _attempt("ServeDeploySchema", ServeDeploySchema.model_validate, cfg)
    if extra := unknown_keys(cfg, ServeDeploySchema, "serveConfigV2"):
        raise ManifestError(f"serveConfigV2: unknown key(s) {extra}")
    for path in cfg["grpc_options"]["grpc_servicer_functions"]:
        _attempt(f"grpc_servicer_functions: {path}", import_attr, path)
    if len(cfg["applications"]) != 1:
        raise ManifestError("one application expected (the cluster checks size for one)")
    app = cfg["applications"][0]
    if _attempt(f"import_path {app['import_path']}", import_attr, app["import_path"]) is not serve_app.app.build_app:
        raise ManifestError(f"import_path {app['import_path']} is not serve_app.app.build_app")
    if (app.get("args") or {}).get("api_key"):
        raise ManifestError("api_key is written in the manifest: use the ssd-serve-api-key Secret")
    config = _attempt("args", serve_app.app.parse_config, app.get("args"))
    # build_app binds the deployments (Serve checks their options there); nothing starts.
    built = _attempt("build_app", lambda: serve_build(serve_app.app.build_app(config), name=app["name"]))
    built = {d.name: d for d in built.deployments}
    overrides = {}
    for over in app.get("deployments", []):
        if over["name"] not in built:
            raise ManifestError(f"deployments: {over['name']} is not a deployment of the app ({sorted(built)})")
        if set(over) - {"name", "ray_actor_options", *_GROUP_KEYS}:  # replica counts come from args
            raise ManifestError(
                f"deployments.{over['name']}: override ray_actor_options (and the Target's placement group) only"
            )
        overrides[over["name"]] = over
    placement = {}
    for name, dep in built.items():
        over = overrides.get(name, {})
        options = over.get("ray_actor_options", dep.ray_actor_options) or {}
        if extra := unknown_keys(options, RayActorOptionsSchema, f"{name}.ray_actor_options"):
            raise ManifestError(f"unknown actor option(s) {extra}")
        _attempt(f"{name}.ray_actor_options", RayActorOptionsSchema.model_validate, options)
        group = {key: over.get(key, getattr(dep._replica_config, key)) for key in _GROUP_KEYS}
        placement[name] = (
            most_replicas(dep),
            _group_demand(name, options, **group) if group[_GROUP_KEYS[0]] else options,
        )
    _check_target(overrides.get("Target", {}), built["Target"], config)
    return cfg, config, placement


# ---- the cluster: ports, env, probes, and whether every replica fits ---------------------------


def _node_resources(group) -> dict:
    """What Ray sees on one pod of the group (KubeRay derives num-cpus/num-gpus from the limits,
    rounding CPUs up)."""
    params, limits = group.get("rayStartParams", {}), group["template"]["spec"]["containers"][0]["resources"]["limits"]
    cpu = str(limits.get("cpu", 0))
    cpu = math.ceil(float(cpu[:-1]) / 1000 if cpu.endswith("m") else float(cpu))
    have = {
        "CPU": float(params.get("num-cpus", cpu)),
        "GPU": float(params.get("num-gpus", limits.get("nvidia.com/gpu", 0))),
    }
    return {
        **have,
        **(yaml.safe_load(yaml.safe_load(params["resources"])) if "resources" in params else {}),
    }  # '"{...}"'


def _demand(options: dict) -> dict:
    return {"CPU": options.get("num_cpus", 1), "GPU": options.get("num_gpus", 0), **options.get("resources", {})}


def _fits(demand, free) -> bool:
    return all(free.get(k, 0) >= v for k, v in demand.items() if v)


def cluster_problems(rs: dict, cfg: dict, config, placement: dict) -> list[str]:
    rc, out, nodes = rs["spec"]["rayClusterConfig"], [], []
    head = rc["headGroupSpec"]["rayStartParams"]
    want_head = {"num-cpus": "0", "metrics-export-port": "8080", "dashboard-host": "0.0.0.0"}
    out += [f"head rayStartParams.{k} must be {v!r}" for k, v in want_head.items() if head.get(k) != v]
    if cfg["http_options"].get("host") != "0.0.0.0":
        out.append("http_options.host must be 0.0.0.0 (the proxies are reached from other pods)")
    if f"ARG RAY_VERSION={rc.get('rayVersion')}\n" not in (REPO / "Dockerfile").read_text():
        out.append(f"rayVersion {rc.get('rayVersion')} differs from the Dockerfile's RAY_VERSION")
    want_ports = {"serve": cfg["http_options"]["port"], "grpc": cfg["grpc_options"]["port"], "metrics": 8080}
    # At full scale: every group at maxReplicas pods, every deployment at its most replicas.
    groups = [("head", rc["headGroupSpec"], 1)] + [
        (g["groupName"], g, g["maxReplicas"]) for g in rc.get("workerGroupSpecs", [])
    ]
    for name, group, replicas in groups:
        c = group["template"]["spec"]["containers"][0]
        ports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
        want = {**want_ports, **({"gcs-server": 6379, "dashboard": 8265} if name == "head" else {})}
        out += [f"{name}: container port {p} ({n}) not declared" for n, p in want.items() if ports.get(n) != p]
        if group.get("rayStartParams", {}).get("metrics-export-port") != "8080":
            out.append(f"{name}: rayStartParams.metrics-export-port must be '8080'")
        env = {e["name"]: e for e in c.get("env", [])}
        if env.get("RAY_SERVE_GRPC_MAX_MESSAGE_SIZE", {}).get("value") != str(config.max_grpc_message_bytes):
            out.append(
                f"{name}: env RAY_SERVE_GRPC_MAX_MESSAGE_SIZE must be {config.max_grpc_message_bytes} (= "
                "max_grpc_message_bytes)"
            )
        key = env.get("SSD_API_KEY", {})
        if "value" in key or not key.get("valueFrom", {}).get("secretKeyRef", {}).get("optional"):
            out.append(f"{name}: env SSD_API_KEY must come from a secretKeyRef with optional: true")
        # /health is readiness only where the Ingress runs, and never on the head: KubeRay
        # submits serveConfigV2 once the head is ready, so the app would never come up.
        probe, have = c.get("readinessProbe"), _node_resources(group)
        if name == "head":
            if probe:
                out.append("head: no readinessProbe (KubeRay submits serveConfigV2 only once the head is ready)")
        elif _fits(_demand(placement["Ingress"][1]), have):
            if (probe or {}).get("httpGet") != {"path": "/health", "port": "serve"}:
                out.append(f"{name}: the Ingress runs here: readinessProbe httpGet /health on port serve")
        elif probe:
            out.append(f"{name}: a readinessProbe replaces KubeRay's own; only the Ingress's groups get /health")
        nodes += [dict(have) for _ in range(replicas)]
    # First fit, largest CPU demand first: enough for these few, uniform replicas.
    for dep, (replicas, options) in sorted(placement.items(), key=lambda p: -_demand(p[1][1])["CPU"]):
        demand = _demand(options)
        if _fits(demand, nodes[0]):
            out.append(f"{dep} could be placed on the head (it needs {demand}); the head must run no replicas")
        for i in range(replicas):
            node = next((free for free in nodes[1:] if _fits(demand, free)), None)
            if node is None:
                out.append(
                    f"{dep} replica {i + 1}/{replicas} ({demand}) fits on no worker pod with every group at "
                    "maxReplicas: raise the group's maxReplicas (or its pods' resources), or lower max_replicas"
                )
                break
            node.update({k: node.get(k, 0) - v for k, v in demand.items()})
    return out


# ---- growing and shrinking, and the loss of the head ----------------------------------------------


def scaling_problems(rs: dict) -> list[str]:
    """Ray's autoscaler is on, every worker group can grow, and Serve scales the targets."""
    rc, out = rs["spec"]["rayClusterConfig"], []
    if rc.get("enableInTreeAutoscaling") is not True:
        out.append("enableInTreeAutoscaling must be true (Ray's autoscaler adds and removes worker pods)")
    options = rc.get("autoscalerOptions") or {}
    for key in ("upscalingMode", "idleTimeoutSeconds"):
        if key not in options:
            out.append(f"autoscalerOptions.{key} must be set")
    sidecar = options.get("resources") or {}
    if any(key not in sidecar.get(kind, {}) for kind in ("requests", "limits") for key in ("cpu", "memory")):
        out.append("autoscalerOptions.resources must give the autoscaler sidecar cpu and memory requests and limits")
    for g in rc.get("workerGroupSpecs", []):
        low, now, high = g.get("minReplicas", 0), g.get("replicas", 0), g.get("maxReplicas")
        if high is None or not low <= now <= high:
            out.append(f"{g['groupName']}: minReplicas <= replicas <= maxReplicas must hold ({low}, {now}, {high})")
        elif high <= low:
            out.append(f"{g['groupName']}: maxReplicas ({high}) must exceed minReplicas ({low}): the group cannot grow")
    if not isinstance(rs["spec"].get("serveConfigV2"), str):
        return out  # serve_checks names it
    args = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"][0].get("args") or {}
    scaling = args.get("target_autoscaling")
    if not isinstance(scaling, dict):
        out.append("args.target_autoscaling must be set: the targets follow the load, not a fixed count")
        return out
    out += [
        f"args.{key} must be left out with target_autoscaling"
        for key in ("target_replicas", "draft_pool_size")
        if key in args
    ]
    from ssd.core.config import EngineArgs

    batch = (args.get("engine") or {}).get("max_num_seqs", EngineArgs.model_fields["max_num_seqs"].default)
    if not 0 < scaling.get("target_ongoing_requests", 0) <= batch:
        out.append(
            f"target_autoscaling.target_ongoing_requests ({scaling.get('target_ongoing_requests')}) must be above 0 "
            f"and at most engine.max_num_seqs ({batch}): beyond it a replica queues before Serve adds one"
        )
    return out


def fault_tolerance_problems(docs) -> list[str]:
    """The GCS keeps its tables in Redis, whose password comes from a Secret; a Redis named by a
    bare Service name is deployed with the manifests and reads the same Secret."""
    rs = rayservice(docs)
    ft = rs["spec"]["rayClusterConfig"].get("gcsFaultToleranceOptions")
    if not isinstance(ft, dict):
        return ["rayClusterConfig.gcsFaultToleranceOptions is missing: the head's loss would take the cluster along"]
    out = []
    password = ft.get("redisPassword") or {}
    ref = (password.get("valueFrom") or {}).get("secretKeyRef") or {}
    if "value" in password or not (ref.get("name") and ref.get("key")):
        out.append(
            "gcsFaultToleranceOptions.redisPassword must come from a Secret (valueFrom.secretKeyRef), not a literal"
        )
    if "externalStorageNamespace" in ft:
        out.append(
            "gcsFaultToleranceOptions.externalStorageNamespace must be left out: the old and new clusters of a "
            "RayService upgrade would share the GCS's tables (KubeRay's default, the RayCluster's UID, keeps "
            "them apart)"
        )
    legacy = {"ray.io/ft-enabled", "ray.io/external-storage-namespace"} & set(rs["metadata"].get("annotations") or {})
    out += [f"annotation {a}: gcsFaultToleranceOptions replaces it (KubeRay refuses both)" for a in sorted(legacy)]
    host, _, port = str(ft.get("redisAddress", "")).rpartition(":")
    if not host or not port.isdigit():
        return [*out, f"gcsFaultToleranceOptions.redisAddress must be host:port ({ft.get('redisAddress')!r})"]
    if "." in host:  # outside the manifests (another namespace, or a managed Redis): not checked here
        return out
    svc = next((d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == host), None)
    if svc is None or int(port) not in [p["port"] for p in svc["spec"]["ports"]]:
        return [*out, f"redisAddress {host}:{port} is no Service port of the manifests"]
    pods = [
        d["spec"]["template"]
        for d in docs
        if d["kind"] in ("Deployment", "StatefulSet")
        and svc["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()
    ]
    reads = {
        (r.get("name"), r.get("key"))
        for pod in pods
        for c in pod["spec"]["containers"]
        for e in c.get("env", [])
        if (r := (e.get("valueFrom") or {}).get("secretKeyRef"))
    }
    if not pods:
        out.append(f"Service {host} selects no Deployment or StatefulSet of the manifests")
    elif (ref.get("name"), ref.get("key")) not in reads:
        out.append(f"the Redis behind {host} does not read its password from the Secret the RayService names ({ref})")
    return out


def validate(docs, crds: bool, production: bool = False) -> None:
    rs = rayservice(docs)
    problems = [f"apiVersion {rs['apiVersion']}"] if rs["apiVersion"] != "ray.io/v1" else []
    problems += crd_problems(rs) if crds else []
    if not problems:  # the checks below assume a well-typed object
        problems += scaling_problems(rs) + (fault_tolerance_problems(docs) if production else [])
        try:
            problems += cluster_problems(rs, *serve_checks(rs))
        except ManifestError as err:
            problems.append(str(err))
    if problems:
        raise ManifestError("\n".join(problems))


# ---- the manifests as written -------------------------------------------------------------------


@pytest.mark.parametrize("target", TARGETS)
def test_serve_config_and_layout(target):
    validate(rendered(target), crds=False, production=target == PRODUCTION)


@pytest.mark.parametrize("target", TARGETS)
def test_autoscaling_is_on_and_every_group_can_grow(target):
    rs = rayservice(rendered(target))
    assert rs["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] is True
    for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        assert g["minReplicas"] <= g["replicas"] <= g["maxReplicas"] and g["maxReplicas"] > g["minReplicas"], g
    assert scaling_problems(rs) == []


def test_the_production_overlay_keeps_the_gcs_in_redis():
    assert "production" in (K8S / "README.md").read_text().split(PRODUCTION)[1].splitlines()[0]
    ft = rayservice(rendered(PRODUCTION))["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"]
    assert "value" not in ft["redisPassword"] and ft["redisPassword"]["valueFrom"]["secretKeyRef"]["key"]
    assert fault_tolerance_problems(rendered(PRODUCTION)) == []


@pytest.mark.parametrize("target", TARGETS)
def test_no_secret_is_committed(target):
    """Passwords and keys are Secrets the operator creates (k8s/README.md), never manifests."""
    assert [d["metadata"]["name"] for d in rendered(target) if d["kind"] == "Secret"] == []


@needs_crds
@pytest.mark.parametrize("target", TARGETS)
def test_kuberay_crd_schemas(target):
    assert crd_problems(rayservice(rendered(target))) == []


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (for `kubectl kustomize`) not installed")
@pytest.mark.parametrize("target", TARGETS)
def test_renderer_matches_kustomize(target):
    out = subprocess.run(
        ["kubectl", "kustomize", str(K8S / target)], capture_output=True, text=True, timeout=60, check=True
    )
    key = lambda d: (d["kind"], d["metadata"]["name"])  # noqa: E731
    assert sorted(yaml.safe_load_all(out.stdout), key=key) == sorted(copy.deepcopy(rendered(target)), key=key)


def test_overlays_are_what_they_claim():
    base, gpu = rayservice(rendered("base")), rayservice(rendered("overlays/gpu-70b"))
    demo = yaml.safe_load(rayservice(rendered("overlays/cpu-demo"))["spec"]["serveConfigV2"])["applications"][0]["args"]
    assert "target" not in demo["engine"] and (demo["engine"]["mode"], demo["engine"]["draft_transport"]) == (
        "auto",
        "torch",
    )
    args = yaml.safe_load(gpu["spec"]["serveConfigV2"])["applications"][0]["args"]
    assert "70B" in args["engine"]["target"] and args["engine"]["device"] == args["engine"]["draft_device"] == "cuda"
    assert args["engine"]["draft_worker_resources"]["num_gpus"] == 1 and args["target_num_gpus"] == 1
    assert args["engine"]["tensor_parallel_size"] == 4
    for group, gpus in zip(gpu["spec"]["rayClusterConfig"]["workerGroupSpecs"], ["4", "1"]):
        c = group["template"]["spec"]["containers"][0]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == gpus
        assert {"name": "models", "mountPath": "/models", "readOnly": True} in c["volumeMounts"]
    assert {c["image"] for c in _containers(gpu)} == {"ssd-serve:cuda"}
    assert {c["image"] for c in _containers(base)} == {"ssd-serve:latest"}
    svc = next(d for d in rendered("base") if d["kind"] == "Service")  # gRPC: the Ingress's pods
    assert (
        svc["spec"]["selector"].items()
        <= base["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["metadata"]["labels"].items()
    )
    assert [(p["port"], p["targetPort"]) for p in svc["spec"]["ports"]] == [(9000, "grpc")]


# ---- broken copies: each validator catches its own kind of mistake -------------------------------


def _serve(fn):
    def mutate(rs):
        cfg = yaml.safe_load(rs["spec"]["serveConfigV2"])
        fn(cfg, cfg["applications"][0])
        rs["spec"]["serveConfigV2"] = yaml.safe_dump(cfg)

    return mutate


def _group(i, fn):  # i: a worker group's index, or None for the head
    rc = lambda rs: rs["spec"]["rayClusterConfig"]  # noqa: E731
    return lambda rs: fn(rc(rs)["headGroupSpec"] if i is None else rc(rs)["workerGroupSpecs"][i])


def _ray(group):
    return group["template"]["spec"]["containers"][0]


def _cluster(fn):
    return lambda rs: fn(rs["spec"]["rayClusterConfig"])


def _scaling(**change):
    return _serve(lambda c, a: a["args"]["target_autoscaling"].update(change))


BROKEN = {  # name: (mutation of the base RayService, what the error names, needs the CRDs)
    "import path typo": (_serve(lambda c, a: a.update(import_path="serve_app.app:build_ap")), "import_path", False),
    "unknown args key": (_serve(lambda c, a: a["args"].update(draft_pool=2)), "draft_pool", False),
    "args value of the wrong type": (
        _serve(lambda c, a: a["args"].update(target_replicas="two")),
        "target_replicas",
        False,
    ),
    "unknown engine key": (_serve(lambda c, a: a["args"]["engine"].update(drafts=2)), "engine.drafts", False),
    "api key in the manifest": (_serve(lambda c, a: a["args"].update(api_key="sk-123")), "api_key", False),
    "servicer function typo": (
        _serve(lambda c, a: c["grpc_options"]["grpc_servicer_functions"].append("serve_app._proto.nope")),
        "grpc_servicer_functions",
        False,
    ),
    "grpc port not an int": (_serve(lambda c, a: c["grpc_options"].update(port="grpc")), "ServeDeploySchema", False),
    "serve key Serve would ignore": (_serve(lambda c, a: a.update(deployment=[])), "deployment", False),
    "override of a missing deployment": (
        _serve(lambda c, a: a["deployments"][0].update(name="Targets")),
        "Targets",
        False,
    ),
    "override disagrees with args": (
        _serve(lambda c, a: a["deployments"][0]["ray_actor_options"].update(num_cpus=3)),
        "target_num_cpus",
        False,
    ),
    "actor option typo": (
        _serve(lambda c, a: a["args"]["engine"]["draft_worker_resources"].update(num_gpu=1)),
        "num_gpu",
        False,
    ),
    "max_replicas beyond the target pods": (_scaling(max_replicas=5), "Target replica 5/5", False),
    "draft group too small for the pool": (
        _group(1, lambda g: g.update(maxReplicas=3)),
        "DraftPool replica 4/4",
        False,
    ),
    "autoscaler off": (_cluster(lambda rc: rc.update(enableInTreeAutoscaling=False)), "enableInTreeAutoscaling", False),
    "autoscaler sidecar unsized": (
        _cluster(lambda rc: rc["autoscalerOptions"].pop("resources")),
        "autoscalerOptions.resources",
        False,
    ),
    "no idle timeout": (
        _cluster(lambda rc: rc["autoscalerOptions"].pop("idleTimeoutSeconds")),
        "autoscalerOptions.idleTimeoutSeconds",
        False,
    ),
    "group that cannot grow": (
        _group(1, lambda g: g.update(maxReplicas=1)),
        "draft: maxReplicas (1) must exceed minReplicas (1)",
        False,
    ),
    "replicas above maxReplicas": (
        _group(0, lambda g: g.update(replicas=5)),
        "target: minReplicas <= replicas <= maxReplicas must hold (1, 5, 4)",
        False,
    ),
    "replicas below minReplicas": (
        _group(1, lambda g: g.update(minReplicas=2)),
        "draft: minReplicas <= replicas <= maxReplicas must hold (2, 1, 4)",
        False,
    ),
    "fixed target count": (
        _serve(lambda c, a: (a["args"].pop("target_autoscaling"), a["args"].update(target_replicas=2))),
        "args.target_autoscaling must be set",
        False,
    ),
    "pool size beside autoscaling": (
        _serve(lambda c, a: a["args"].update(draft_pool_size=4)),
        "args.draft_pool_size must be left out",
        False,
    ),
    "scaling target beyond the batch": (
        _scaling(target_ongoing_requests=32),
        "target_ongoing_requests (32) must be above 0 and at most engine.max_num_seqs (16)",
        False,
    ),
    "upscaling mode KubeRay lacks": (
        _cluster(lambda rc: rc["autoscalerOptions"].update(upscalingMode="Fast")),
        "upscalingMode: 'Fast' is not one of",
        True,
    ),
    "misspelt autoscaler option": (
        _cluster(lambda rc: rc["autoscalerOptions"].update(idleTimeoutSecond=60)),
        "idleTimeoutSecond",
        True,
    ),
    "http host loopback": (_serve(lambda c, a: c["http_options"].update(host="127.0.0.1")), "http_options.host", False),
    "head may run replicas": (_group(None, lambda g: g["rayStartParams"].update({"num-cpus": "8"})), "num-cpus", False),
    "metrics port missing": (_group(None, lambda g: _ray(g)["ports"].pop()), "8080", False),
    "grpc size env differs": (
        _group(0, lambda g: _ray(g)["env"][0].update(value="1024")),
        "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE",
        False,
    ),
    "no /health where the Ingress runs": (
        _group(0, lambda g: _ray(g).pop("readinessProbe")),
        "target: the Ingress runs here",
        False,
    ),
    "probe on the draft pods": (
        _group(1, lambda g: _ray(g).update(readinessProbe={"httpGet": {"path": "/health", "port": "serve"}})),
        "draft: a readinessProbe",
        False,
    ),
    "probe on the head": (
        _group(None, lambda g: _ray(g).update(readinessProbe={"httpGet": {"path": "/health", "port": 8000}})),
        "head: no readinessProbe",
        False,
    ),
    "replicas of the wrong type": (
        _group(0, lambda g: g.update(replicas="two")),
        "replicas: 'two' is not of type 'integer'",
        True,
    ),
    "rayStartParams value unquoted": (
        _group(None, lambda g: g["rayStartParams"].update({"num-cpus": 0})),
        "num-cpus: 0 is not of type 'string'",
        True,
    ),
    "misspelt pod field": (_group(1, lambda g: _ray(g).update(imagePullPolicyy="Always")), "imagePullPolicyy", True),
    "bad memory quantity": (
        _group(1, lambda g: _ray(g)["resources"]["limits"].update(memory="4GB")),
        "does not match",
        True,
    ),
    "serveConfigV2 not a string": (
        lambda rs: rs["spec"].update(serveConfigV2={"applications": []}),
        "serveConfigV2",
        True,
    ),
}


@pytest.mark.parametrize("name", list(BROKEN))
def test_broken_copy_fails(name):
    mutate, expected, crds = BROKEN[name]
    if crds and not HAVE_CRDS:
        pytest.skip(f"KubeRay CRDs not found in {KUBERAY}")
    docs = copy.deepcopy(list(rendered("base")))
    mutate(rayservice(docs))
    with pytest.raises(ManifestError, match=re.escape(expected)):
        validate(docs, crds=HAVE_CRDS)


def _ft(fn):
    return lambda docs: fn(rayservice(docs)["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"])


def _redis_password_ref(docs):
    redis = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "ssd-serve-redis")
    return next(e for e in _ray(redis["spec"])["env"] if e["name"] == "REDIS_PASSWORD")["valueFrom"]["secretKeyRef"]


PRODUCTION_BROKEN = {  # name: (mutation of the production overlay's documents, what the error names, needs CRDs)
    "no GCS fault tolerance": (
        lambda docs: rayservice(docs)["spec"]["rayClusterConfig"].pop("gcsFaultToleranceOptions"),
        "gcsFaultToleranceOptions is missing",
        False,
    ),
    "Redis password written in": (
        _ft(lambda ft: ft.update(redisPassword={"value": "not-a-secret"})),
        "redisPassword must come from a Secret",
        False,
    ),
    "fixed storage namespace": (
        _ft(lambda ft: ft.update(externalStorageNamespace="ssd-serve")),
        "externalStorageNamespace must be left out",
        False,
    ),
    "legacy FT annotation": (
        lambda docs: rayservice(docs)["metadata"].update(annotations={"ray.io/ft-enabled": "true"}),
        "annotation ray.io/ft-enabled",
        False,
    ),
    "Redis port not the Service's": (
        _ft(lambda ft: ft.update(redisAddress="ssd-serve-redis:6380")),
        "ssd-serve-redis:6380 is no Service port",
        False,
    ),
    "Redis without its Deployment": (
        lambda docs: docs.remove(next(d for d in docs if d["kind"] == "Deployment")),
        "selects no Deployment",
        False,
    ),
    "Redis reads another Secret": (
        lambda docs: _redis_password_ref(docs).update(name="redis"),
        "does not read its password from the Secret",
        False,
    ),
    "misspelt FT option": (_ft(lambda ft: ft.update(redisAdress=ft.pop("redisAddress"))), "redisAdress", True),
    "secret reference without its key": (
        _ft(lambda ft: ft["redisPassword"]["valueFrom"]["secretKeyRef"].pop("key")),
        "'key' is a required property",
        True,
    ),
}


@pytest.mark.parametrize("name", list(PRODUCTION_BROKEN))
def test_broken_production_copy_fails(name):
    mutate, expected, crds = PRODUCTION_BROKEN[name]
    if crds and not HAVE_CRDS:
        pytest.skip(f"KubeRay CRDs not found in {KUBERAY}")
    docs = copy.deepcopy(list(rendered(PRODUCTION)))
    mutate(docs)
    with pytest.raises(ManifestError, match=re.escape(expected)):
        validate(docs, crds=HAVE_CRDS, production=True)


def test_overlay_patch_refuses_a_reordered_base(tmp_path):
    """The overlays' `test` ops stop a patch from landing on the wrong worker group."""
    shutil.copytree(K8S, tmp_path / "k8s")
    base = tmp_path / "k8s" / "base" / "rayservice.yaml"
    rs = yaml.safe_load(base.read_text())
    rs["spec"]["rayClusterConfig"]["workerGroupSpecs"].reverse()
    base.write_text(yaml.safe_dump(rs))
    with pytest.raises(jsonpatch.JsonPatchTestFailed):
        render(tmp_path / "k8s" / "overlays" / "gpu-70b")


# Llama-3.1-70B-Instruct's config.json, the shapes that size it (written here: nothing is downloaded).
LLAMA_31_70B = dict(
    hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
    head_dim=128, vocab_size=128256, tie_word_embeddings=False,
)  # fmt: skip
H100_BYTES = 80 * 10**9  # the layout's GPUs: H100 80GB (the README's and the paper's)


def test_the_70b_layout_fits_its_gpus_per_rank():
    """Each rank of the gpu-70b overlay's target holds its weights (bf16, cut as shards.py cuts
    them) and its share of the KV cache the config asks for (max_num_seqs x max_model_len), with
    a tenth of the GPU left for activations and the allocator."""
    from types import SimpleNamespace

    import serve_app.app
    from ssd.model.shards import ShardPlan, planned_elements

    args = yaml.safe_load(rayservice(rendered("overlays/gpu-70b"))["spec"]["serveConfigV2"])["applications"][0]["args"]
    config = serve_app.app.parse_config(args)  # it validates
    engine, shapes = config.engine, SimpleNamespace(**LLAMA_31_70B)
    assert engine.dtype == "bfloat16" and config.target_num_gpus == 1
    ranks = engine.tensor_parallel_size
    weights = [2 * planned_elements(shapes, ShardPlan.of(shapes, r, ranks)) for r in range(ranks)]
    assert abs(sum(weights) / 2 - 70.55e9) < 0.01e9  # the model's parameter count (LM head not padded: 128256 / 4)
    kv_per_token = shapes.num_hidden_layers * 2 * (shapes.num_key_value_heads // ranks) * shapes.head_dim * 2
    cache = engine.max_num_seqs * engine.max_model_len * kv_per_token
    for w in weights:
        assert w + cache <= 0.9 * H100_BYTES, (w / 1e9, cache / 1e9)
    assert 2 * sum(weights) / ranks > H100_BYTES / 2 and sum(weights) > H100_BYTES  # it needs the split


@pytest.mark.parametrize(
    "mutate, expected",
    [
        (lambda target: target["placement_group_bundles"].pop(), "tensor_parallel_size (4) bundles"),
        (lambda target: target["placement_group_bundles"][1].update(GPU=2), "tensor_parallel_size (4) bundles"),
        (lambda target: target.update(placement_group_strategy="PACK"), "STRICT_PACK placement groups only"),
        (lambda target: target["placement_group_bundles"][0].pop("target_node"), "do not fit placement_group_bundles"),
    ],
    ids=["a bundle short", "a bundle of other size", "strategy not modelled", "replica outside bundle 0"],
)
def test_a_70b_target_whose_placement_group_disagrees_fails(mutate, expected):
    """The gpu-70b overlay's Target override repeats the placement group build_app reserves (one
    bundle per rank, the replica inside bundle 0); a copy that disagrees is refused."""
    docs = copy.deepcopy(list(rendered("overlays/gpu-70b")))
    _serve(lambda c, a: mutate(next(d for d in a["deployments"] if d["name"] == "Target")))(rayservice(docs))
    with pytest.raises(ManifestError, match=re.escape(expected)):
        validate(docs, crds=False)
