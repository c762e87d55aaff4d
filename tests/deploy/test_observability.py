"""deploy/k8s/components (autoscaling, monitoring) and deploy/grafana: what they reference exists.

Each component renders on each overlay (kubectl kustomize agrees where it is installed); the
built-in objects pass the strict schemas; every autoscaler targets a real StatefulSet on a
saturation gauge that service exports, scales down slower than the slowest drain, and the
PodMonitor and the dashboard name only ports, labels and metrics that exist.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tests.deploy import manifests
from tests.deploy.manifests import (
    COMPONENTS,
    DEPLOY,
    K8S,
    OVERLAYS,
    find,
    normalized,
    render_kustomization,
    workloads,
)
from tests.deploy.metric_names import exported_series, selected_metrics

AUTOSCALING = ("keda", "hpa")
DASHBOARD = DEPLOY / "grafana" / "stageserve.json"
# Series a dashboard may use from outside stageserve (kube-state-metrics).
EXTERNAL_SERIES = {"kube_pod_container_status_restarts_total"}
SCALED_OBJECT_SPEC = {
    "scaleTargetRef",
    "minReplicaCount",
    "maxReplicaCount",
    "pollingInterval",
    "cooldownPeriod",
    "advanced",
    "triggers",
    "fallback",
}
COMPONENT_LABEL = "app.kubernetes.io/component"


@pytest.fixture(scope="module")
def series() -> set[str]:
    return exported_series()


def render(overlay: str, *components: str) -> list[dict]:
    return render_kustomization(
        K8S / "overlays" / overlay, tuple(COMPONENTS / c for c in components)
    )


def kubectl_kustomize_with(tmp_path: Path, overlay: str, components: tuple[str, ...]) -> list[dict]:
    """``kubectl kustomize`` of an overlay that lists ``components`` (paths relative, as
    kustomize requires)."""
    relative = lambda path: os.path.relpath(path, tmp_path)  # noqa: E731
    kustomization = {
        "resources": [relative(K8S / "overlays" / overlay)],
        "components": [relative(COMPONENTS / c) for c in components],
    }
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return manifests.kubectl_kustomize(tmp_path)


def drain_bound_s(docs: list[dict]) -> float:
    """The longest a pod of the system may take to go: its preStop sleep plus its grace."""
    bounds = []
    for workload in workloads(docs):
        pod = workload["spec"]["template"]["spec"]
        sleeps = [
            float(c["lifecycle"]["preStop"]["exec"]["command"][1])
            for c in pod["containers"]
            if "preStop" in c.get("lifecycle", {})
        ]
        bounds.append(max(sleeps, default=0.0) + pod["terminationGracePeriodSeconds"])
    return max(bounds)


def autoscalers(docs: list[dict]) -> list[tuple[dict, dict, dict]]:
    """(autoscaler, its target, its behavior) of every ScaledObject and HPA in ``docs``."""
    found = []
    for doc in docs:
        if doc["kind"] == "ScaledObject":
            behavior = doc["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        elif doc["kind"] == "HorizontalPodAutoscaler":
            behavior = doc["spec"]["behavior"]
        else:
            continue
        ref = doc["spec"]["scaleTargetRef"]
        target = find(docs, ref["kind"], ref["name"])
        assert ref["apiVersion"] == target["apiVersion"] == "apps/v1"
        found.append((doc, target, behavior))
    return found


def saturation_metric(target: dict) -> str:
    return (
        f"stageserve_{target['spec']['template']['metadata']['labels'][COMPONENT_LABEL]}_saturation"
    )


# --- PromQL reading ---------------------------------------------------------------------------
def test_selected_metrics_reads_names_not_functions_labels_or_numbers() -> None:
    expr = (
        'histogram_quantile(0.9, sum by (le, pod) (rate(stageserve_a_bucket{x=~"y|z"}'
        "[$__rate_interval]))) / ignoring(pod) group_left sum(stageserve_b offset 5m) > bool 1e3"
    )
    assert selected_metrics(expr) == {"stageserve_a_bucket", "stageserve_b"}
    assert selected_metrics("max by (kind) (up)") == {"up"}


# --- components ---------------------------------------------------------------------------------
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_components_are_off_unless_listed(overlay) -> None:
    kinds = {d["kind"] for d in render(overlay)}
    assert not kinds & {"ScaledObject", "HorizontalPodAutoscaler", "PodMonitor"}
    for component in (*AUTOSCALING, "monitoring"):
        component_file = yaml.safe_load((COMPONENTS / component / "kustomization.yaml").read_text())
        assert component_file["kind"] == "Component"
        assert f"components: [../../components/{component}]" in component_file_text(component)


def component_file_text(component: str) -> str:
    return (COMPONENTS / component / "kustomization.yaml").read_text()


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("components", [("keda", "monitoring"), ("hpa",)])
def test_components_render_like_kubectl_kustomize_and_pass_the_schemas(
    tmp_path, overlay, components
) -> None:
    docs = render(overlay, *components)
    version = kubernetes_validate.latest_version()
    for doc in docs:
        if doc["apiVersion"].split("/")[0] in ("keda.sh", "monitoring.coreos.com"):
            continue  # custom resources: checked field by field below
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']}: {exc.message}")
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed: rendered by this test's own renderer only")
    key = lambda d: (d["kind"], d["metadata"]["name"])  # noqa: E731
    theirs = sorted(kubectl_kustomize_with(tmp_path, overlay, components), key=key)
    assert [normalized(d) for d in sorted(docs, key=key)] == [normalized(d) for d in theirs]


@pytest.mark.parametrize("component", AUTOSCALING)
def test_autoscalers_own_the_prefill_and_decode_replicas(component) -> None:
    docs = render("gpu", component)
    found = autoscalers(docs)
    targets = sorted(target["metadata"]["name"] for _, target, _ in found)
    assert targets == ["stageserve-decode", "stageserve-prefill"]
    for workload in workloads(docs):
        is_scaled = workload["metadata"]["name"] in targets
        assert ("replicas" in workload["spec"]) is not is_scaled, workload["metadata"]["name"]
    for autoscaler, target, _ in found:
        assert target["kind"] == "StatefulSet"
        labels = target["spec"]["template"]["metadata"]["labels"]
        assert autoscaler["metadata"]["labels"] == labels


def test_keda_scales_each_kind_on_its_own_saturation(series) -> None:
    for scaled, target, _ in autoscalers(render("gpu", "keda")):
        spec = scaled["spec"]
        assert set(spec) <= SCALED_OBJECT_SPEC, set(spec) - SCALED_OBJECT_SPEC
        assert 1 <= spec["minReplicaCount"] < spec["maxReplicaCount"]
        (trigger,) = spec["triggers"]
        assert trigger["type"] == "prometheus"
        metadata = trigger["metadata"]
        assert set(metadata) == {"serverAddress", "query", "threshold"}
        assert re.fullmatch(r"https?://[\w.-]+(:\d+)?", metadata["serverAddress"])
        assert all(isinstance(v, str) for v in metadata.values())  # KEDA's metadata is strings
        assert selected_metrics(metadata["query"]) == {saturation_metric(target)}
        assert saturation_metric(target) in series
        assert 0 < float(metadata["threshold"]) < 1  # a share of one pod's saturation


def test_hpa_scales_each_kind_on_its_own_saturation_served_by_the_adapter(series) -> None:
    values = yaml.safe_load((COMPONENTS / "hpa" / "prometheus-adapter-values.yaml").read_text())
    (rule,) = values["rules"]["custom"]
    (series_name,) = re.findall(r'__name__=~"([^"]+)"', rule["seriesQuery"])
    assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}
    for hpa, target, _ in autoscalers(render("gpu", "hpa")):
        spec = hpa["spec"]
        assert 1 <= spec["minReplicas"] < spec["maxReplicas"]
        (metric,) = spec["metrics"]
        assert metric["type"] == "Pods"
        name = metric["pods"]["metric"]["name"]
        assert name == saturation_metric(target) and name in series
        assert re.fullmatch(series_name, name)
        replacement = re.sub(r"\$\{(\d+)\}", r"\\\1", rule["name"]["as"])  # ${1} -> \1
        assert re.sub(rule["name"]["matches"], replacement, name) == name  # the name HPA asks
        target_value = metric["pods"]["target"]
        assert target_value["type"] == "AverageValue"
        assert 0 < int(target_value["averageValue"].removesuffix("m")) < 1000  # milli: < 1


@pytest.mark.parametrize("component", AUTOSCALING)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_scale_down_gives_each_pod_its_whole_drain(overlay, component) -> None:
    """One pod at a time, and only after the slowest pod of the system could have drained."""
    docs = render(overlay, component)
    bound_s = drain_bound_s(docs)
    assert (
        bound_s
        >= find(docs, "Deployment", "stageserve-router")["spec"]["template"]["spec"][
            "terminationGracePeriodSeconds"
        ]
    )
    for autoscaler, _, behavior in autoscalers(docs):
        down = behavior["scaleDown"]
        assert down["stabilizationWindowSeconds"] >= bound_s, autoscaler["metadata"]["name"]
        for policy in down["policies"]:
            assert policy["type"] == "Pods" and policy["value"] == 1
            assert policy["periodSeconds"] >= bound_s


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_pod_monitor_scrapes_every_pod_where_the_policy_lets_prometheus_in(overlay) -> None:
    docs = render(overlay, "monitoring")
    monitor = find(docs, "PodMonitor", "stageserve")
    selector = monitor["spec"]["selector"]["matchLabels"]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    policy = find(docs, "NetworkPolicy", "stageserve-metrics")["spec"]
    (rule,) = policy["ingress"]
    (source,) = rule["from"]
    allowed_ports = {p["port"] for p in rule["ports"]}
    assert source["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "prometheus"}
    (relabel,) = endpoint["relabelings"]
    (source_label,) = relabel["sourceLabels"]
    for workload in workloads(docs):
        pod = workload["spec"]["template"]
        assert selector.items() <= pod["metadata"]["labels"].items()
        assert source_label == "__meta_kubernetes_pod_label_" + re.sub(
            r"[^a-zA-Z0-9_]", "_", COMPONENT_LABEL
        )
        assert COMPONENT_LABEL in pod["metadata"]["labels"]
        assert endpoint["path"] == pod["metadata"]["annotations"]["prometheus.io/path"]
        for container in pod["spec"]["containers"]:
            (port,) = [p for p in container["ports"] if p["name"] == endpoint["port"]]
            assert port["containerPort"] in allowed_ports


# --- the Grafana dashboard -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(dashboard: dict) -> list[dict]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def expressions(dashboard: dict) -> list[str]:
    return [t["expr"] for p in panels(dashboard) for t in p["targets"]]


def test_every_dashboard_metric_is_one_the_services_export(dashboard, series) -> None:
    used = set().union(*(selected_metrics(e) for e in expressions(dashboard)))
    ours = {name for name in used if name.startswith("stageserve_")}
    assert ours - series == set(), "the services export no such series"
    assert used - ours <= EXTERNAL_SERIES
    for variable in dashboard["templating"]["list"]:  # Grafana's label_values(metric, label)
        if variable["type"] == "query":
            (name,) = re.findall(r"^label_values\((\w+), *\w+\)$", variable["query"]["query"])
            assert name in series


def test_the_dashboard_shows_every_saturation_gauge_and_the_request_latencies(
    dashboard, series
) -> None:
    used = set().union(*(selected_metrics(e) for e in expressions(dashboard)))
    assert {s for s in series if s.endswith("_saturation")} <= used
    for histogram in (
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "e2e_request_latency_seconds",
    ):
        assert f"stageserve_{histogram}_bucket" in used
    assert {"stageserve_kv_cache_usage_perc", "stageserve_router_requests_total"} <= used


def test_the_dashboard_is_well_formed(dashboard) -> None:
    assert dashboard["uid"] and dashboard["title"] and isinstance(dashboard["schemaVersion"], int)
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["w"] > 0 and grid["x"] + grid["w"] <= 24, panel["title"]
    for panel in panels(dashboard):
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert ref_ids and len(ref_ids) == len(set(ref_ids)), panel["title"]
        for target in panel["targets"]:
            used = set(re.findall(r"\$(\w+)", target["expr"])) - {"__rate_interval"}
            assert used <= set(variables), panel["title"]
            assert target["expr"].count("(") == target["expr"].count(")"), panel["title"]
