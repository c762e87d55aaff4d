"""deploy/k8s: every overlay renders, passes the strict Kubernetes schemas, and matches the
services.

What a cluster would find at ``kubectl apply`` time or later (a probe on the wrong port, a
worker address no pod answers, a flag a service rejects, a ConfigMap key nothing reads) is
checked here against the rendered objects and the services' own parsers and constants.
"""

from __future__ import annotations

from importlib.metadata import version

import kubernetes_validate
import pytest
import yaml

from services.common.envs import MOONCAKE_ENV_VARS
from services.common.exposure import ExposureError, check_api_exposure
from services.common.server import LIVENESS_SERVICE
from services.router.config import STOP_AFTER_DRAIN_S
from tests.conftest import REPO
from tests.deploy.manifests import (
    DEPLOY,
    K8S,
    OVERLAYS,
    SERVICES,
    Container,
    assert_renders_like_kubectl,
    containers,
    dockerfile,
    find,
    flag,
    parse_service_args,
    render_kustomization,
    rendered_containers,
    workloads,
)

# The oldest Kubernetes these manifests claim (gRPC probes are GA since 1.27) and the newest
# schema kubernetes-validate ships.
K8S_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
WORKERS = ("tokenizer", "vision_encoder", "prefill", "decode")
ADDRESS_FLAGS = {
    "--tokenizer-address": "tokenizer",
    "--encoder-address": "vision_encoder",
    "--prefill-address": "prefill",
    "--decode-address": "decode",
}
GPU_WORKERS = ("vision_encoder", "prefill", "decode")
GRPC_PORT, METRICS_PORT, HTTP_PORT = 50051, 9090, 8000


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def docs(overlay) -> list[dict]:
    return render_kustomization(K8S / "overlays" / overlay)


@pytest.fixture(scope="module")
def by_service(docs) -> dict[str, Container]:
    found = {c.service: c for c in rendered_containers(docs)}
    assert sorted(found) == sorted(SERVICES)
    return found


@pytest.fixture
def gpu_mooncake(monkeypatch, overlay) -> None:
    """The GPU image's Mooncake moves GPU memory (test_dockerfiles checks it installs that
    build)."""
    if overlay == "gpu":
        monkeypatch.setattr(
            "services.common.kv_transfer.mooncake_moves_device_memory", lambda: True
        )


def test_renders_like_kubectl_kustomize(overlay, docs) -> None:
    assert_renders_like_kubectl(K8S / "overlays" / overlay, docs)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_passes_the_strict_schema(docs, version) -> None:
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(
                f"{doc['kind']}/{doc['metadata']['name']} (Kubernetes {version}): {exc.message} "
                f"at {'.'.join(map(str, exc.path))}"
            )


def test_every_service_accepts_its_arguments(by_service, gpu_mooncake) -> None:
    for service, container in by_service.items():
        parse_service_args(service, container.args[2:])


def test_ports_probes_and_annotations_match_the_flags(docs, by_service) -> None:
    for service, c in by_service.items():
        args = c.args
        assert flag(args, "--port") == [str(GRPC_PORT)] == [str(c.port("grpc"))]
        assert flag(args, "--metrics-port") == [str(METRICS_PORT)] == [str(c.port("metrics"))]
        assert c.pod["metadata"]["annotations"] == {
            "prometheus.io/scrape": "true",
            "prometheus.io/port": str(METRICS_PORT),
            "prometheus.io/path": "/metrics",
        }
        assert c.spec["livenessProbe"]["grpc"] == {"port": GRPC_PORT, "service": LIVENESS_SERVICE}
        if service == "router":
            assert flag(args, "--http-port") == [str(HTTP_PORT)] == [str(c.port("http"))]
            assert c.spec["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
            assert (
                "startupProbe" not in c.spec
            )  # it answers at once; readiness waits for the workers
        else:  # readiness and startup ask for the server's status: the model is loaded and warm
            assert (
                c.spec["readinessProbe"]["grpc"]
                == c.spec["startupProbe"]["grpc"]
                == {"port": GRPC_PORT}
            )
        for svc in (d for d in docs if d["kind"] == "Service"):
            if svc["spec"]["selector"] == c.pod["metadata"]["labels"]:
                for port in svc["spec"]["ports"]:
                    assert port["targetPort"] in {p["name"] for p in c.spec["ports"]}, svc[
                        "metadata"
                    ]["name"]


def test_router_health_path_exists() -> None:
    assert '"/health"' in (REPO / "services" / "router" / "http_api.py").read_text()


def _pod_names(docs: list[dict], service_name: str) -> list[str]:
    """The stable DNS names (``<pod>.<headless service>``) of the pods behind ``service_name``."""
    svc = find(docs, "Service", service_name)
    assert svc["spec"]["clusterIP"] == "None", f"{service_name}: a worker needs one address per pod"
    (sts,) = [
        w
        for w in workloads(docs)
        if w["spec"]["template"]["metadata"]["labels"] == svc["spec"]["selector"]
    ]
    assert sts["kind"] == "StatefulSet" and sts["spec"]["serviceName"] == service_name
    return [f"{sts['metadata']['name']}-{i}.{service_name}" for i in range(sts["spec"]["replicas"])]


def test_the_router_finds_each_kind_of_worker_by_its_headless_service(docs, by_service) -> None:
    """Each router address is the ``dns:///`` name of the kind's headless Service (every pod,
    however many replicas); prefill's encoder is the first encoder pod by its stable name."""
    for name, kind in ADDRESS_FLAGS.items():
        headless = by_service[kind].workload["spec"]["serviceName"]
        pods = _pod_names(docs, headless)
        assert flag(by_service["router"].args, name) == [f"dns:///{headless}:{GRPC_PORT}"], kind
        if kind == "vision_encoder":
            assert flag(by_service["prefill"].args, "--encoder-address") == [
                f"{pods[0]}:{GRPC_PORT}"
            ]


def test_every_workload_has_a_disruption_budget_of_one_pod(docs) -> None:
    budgets = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    for workload in workloads(docs):
        labels = workload["spec"]["template"]["metadata"]["labels"]
        (budget,) = [b for b in budgets if b["spec"]["selector"]["matchLabels"] == labels]
        assert budget["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": labels}}
    assert len(budgets) == len(workloads(docs))


def test_secrets_config_and_volumes_are_wired(docs, by_service) -> None:
    config_maps = {d["metadata"]["name"] for d in docs if d["kind"] == "ConfigMap"}
    claims = {d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"}
    for service, c in by_service.items():
        env = {e["name"]: e for e in c.spec["env"]}
        token = env["STAGESERVE_INTERNAL_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert token == {"name": "stageserve-secrets", "key": "internal-token"}
        if service == "router":
            api_key = env["STAGESERVE_API_KEY"]["valueFrom"]["secretKeyRef"]
            assert api_key == {"name": "stageserve-secrets", "key": "api-key"}  # required
            args = parse_service_args("router", c.args[2:])
            hosts = (args.host, args.http_host)
            check_api_exposure(hosts, True, args.insecure_no_api_key)
            with pytest.raises(ExposureError, match="without an API key"):  # 0.0.0.0
                check_api_exposure(hosts, False, args.insecure_no_api_key)
        assert {s["configMapRef"]["name"] for s in c.spec["envFrom"]} == {
            "stageserve-env",
            "stageserve-flags",
        }
        assert {s["configMapRef"]["name"] for s in c.spec["envFrom"]} <= config_maps
        volumes = {v["name"]: v for v in c.pod["spec"]["volumes"]}
        for mount in c.spec["volumeMounts"]:
            claim = volumes[mount["name"]].get("persistentVolumeClaim")
            assert claim is None or claim["claimName"] in claims
        if "models" in volumes:
            assert volumes["models"]["persistentVolumeClaim"]["readOnly"] is True
        assert "OTEL_EXPORTER_OTLP_ENDPOINT" in c.env


def test_the_cpu_overlay_mounts_no_read_write_many_claim(docs, by_service, overlay) -> None:
    """kind's and k3s's default storage classes offer ReadWriteOnce only: a pod that mounts a
    ReadWriteMany claim stays Pending there. The CPU model is inside the image."""
    modes = {
        d["metadata"]["name"]: d["spec"]["accessModes"]
        for d in docs
        if d["kind"] == "PersistentVolumeClaim"
    }
    for service, c in by_service.items():
        claims = [
            v["persistentVolumeClaim"]["claimName"]
            for v in c.pod["spec"]["volumes"]
            if "persistentVolumeClaim" in v
        ]
        shared = [claim for claim in claims if "ReadWriteMany" in modes[claim]]
        if overlay == "cpu":
            assert not shared, f"{service} mounts {shared}"
        else:  # the checkpoint comes from the models claim
            assert "stageserve-models" in shared, service
            assert c.env["ARG_MODEL"].startswith("/models/")


def test_every_config_key_is_read(docs, by_service) -> None:
    env_source = (REPO / "services" / "common" / "envs.py").read_text()
    for key in find(docs, "ConfigMap", "stageserve-env")["data"]:
        assert f'"{key}"' in env_source or key in MOONCAKE_ENV_VARS, f"no process reads {key}"
    raw_args = " ".join(" ".join(c.spec["args"]) for c in by_service.values())
    for key in find(docs, "ConfigMap", "stageserve-flags")["data"]:
        assert f"$({key})" in raw_args, f"no container argument uses {key}"


def test_timeouts_agree(by_service, gpu_mooncake) -> None:
    decode = parse_service_args("decode", by_service["decode"].args[2:])
    router = parse_service_args("router", by_service["router"].args[2:])
    prefill = parse_service_args("prefill", by_service["prefill"].args[2:])
    assert decode.kv_quarantine_s > float(by_service["decode"].env["MC_TRANSFER_TIMEOUT"])
    assert decode.max_reservation_s >= router.request_timeout_s
    assert decode.page_size == prefill.page_size


def test_decode_and_prefill_have_time_to_drain(by_service, gpu_mooncake) -> None:
    """Their drain budget (default: the longest a request lives there), then the rest of their
    shutdown, within the pod's grace period; no preStop (the routers poll their health)."""
    for service in ("decode", "prefill"):
        container = by_service[service]
        config = parse_service_args(service, container.args[2:])
        assert "lifecycle" not in container.spec, service
        assert container.pod["spec"]["terminationGracePeriodSeconds"] >= config.stop_s, service


def test_the_router_has_time_to_drain(by_service) -> None:
    """preStop, then the drain budget (default: the request deadline), then the rest of the
    router's shutdown, all within the pod's grace period."""
    container = by_service["router"]
    router = parse_service_args("router", container.args[2:])
    drain_s = router.request_timeout_s if router.drain_timeout_s is None else router.drain_timeout_s
    command = container.spec["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    needed_s = float(command[1]) + drain_s + STOP_AFTER_DRAIN_S
    assert container.pod["spec"]["terminationGracePeriodSeconds"] >= needed_s


def test_containers_are_non_root_with_resources(by_service, overlay) -> None:
    (user,) = [i.value for i in dockerfile(DEPLOY / f"Dockerfile.{overlay}") if i.keyword == "USER"]
    uid = int(user.split(":")[0])
    for service, c in by_service.items():
        pod = c.pod["spec"]
        assert (
            pod["securityContext"]["runAsNonRoot"] is True
            and pod["securityContext"]["runAsUser"] == uid
        )
        assert pod["automountServiceAccountToken"] is False
        assert c.spec["securityContext"] == {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        }
        for kind in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(c.spec["resources"][kind]), (service, kind)
        gpus = c.spec["resources"]["limits"].get("nvidia.com/gpu")
        assert gpus == (1 if overlay == "gpu" and service in GPU_WORKERS else None), service


def test_the_images_are_named_in_each_overlay_and_only_model_workers_run_gpu(
    overlay, by_service
) -> None:
    """The overlay's ``images:`` name every image; the router and the tokenizer (no model on a
    device) run the CPU image in both overlays."""
    base = render_kustomization(K8S / "base")
    assert {c["image"] for c in containers(base)} == {"stageserve"}  # a bare name, set by images:
    kustomization = yaml.safe_load((K8S / "overlays" / overlay / "kustomization.yaml").read_text())
    images = {i["name"]: f"{i['newName']}:{i['newTag']}" for i in kustomization["images"]}
    assert len({i["newName"] for i in kustomization["images"]}) == 1
    ours = images["stageserve"]
    assert "/" in ours and ours.endswith(f":{version('stageserve')}-{overlay}")
    cpu_image = ours.removesuffix(f"-{overlay}") + "-cpu"
    for service, c in by_service.items():
        expected = cpu_image if service in ("router", "tokenizer") else ours
        assert c.spec["image"] == expected, service


def test_the_models_and_the_jit_cache_are_where_the_images_put_them(overlay, by_service) -> None:
    image = {
        i.keyword: i.value
        for i in dockerfile(DEPLOY / f"Dockerfile.{overlay}")
        if i.keyword != "RUN"
    }
    model = by_service["decode"].env["ARG_MODEL"]
    if overlay == "cpu":
        assert model in " ".join(
            i.value for i in dockerfile(DEPLOY / "Dockerfile.cpu") if i.keyword == "RUN"
        )
    else:
        assert model.startswith("/models/")
        assert "FLASHINFER_WORKSPACE_BASE=/var/cache/stageserve" in image["ENV"]
        for service in GPU_WORKERS:
            mounts = {m["mountPath"]: m["name"] for m in by_service[service].spec["volumeMounts"]}
            assert mounts["/var/cache/stageserve"] == "jit-cache"


def test_network_policies_keep_internal_ports_to_stageserve_pods(docs) -> None:
    policies = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "NetworkPolicy"}
    stageserve = {"app.kubernetes.io/name": "stageserve"}
    internal = policies["stageserve-internal"]
    assert internal["podSelector"]["matchLabels"] == stageserve
    assert internal["ingress"] == [{"from": [{"podSelector": {"matchLabels": stageserve}}]}]
    for workload in workloads(docs):
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert stageserve.items() <= labels.items(), workload["metadata"]["name"]
    for name, policy in policies.items():  # any rule open to all sources names its ports
        for rule in policy["ingress"]:
            assert "from" in rule or name == "stageserve-router-public", name
    (metrics,) = policies["stageserve-metrics"]["ingress"]
    assert metrics["ports"] == [{"protocol": "TCP", "port": METRICS_PORT}]


def test_clients_reach_the_routers_http_and_grpc_ports(docs, by_service) -> None:
    """The rule that admits API clients to the router opens its public gRPC port (the Router
    API) as well as HTTP, and nothing else."""
    policies = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "NetworkPolicy"}
    public = policies["stageserve-router-public"]
    router = by_service["router"]
    assert public["podSelector"]["matchLabels"].items() <= router.pod["metadata"]["labels"].items()
    (rule,) = public["ingress"]
    opened = {p["port"] for p in rule["ports"]}
    assert opened == {router.port("http"), router.port("grpc")} == {HTTP_PORT, GRPC_PORT}
    assert all(p["protocol"] == "TCP" for p in rule["ports"])
