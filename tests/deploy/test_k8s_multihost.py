"""deploy/k8s/overlays/gpu-multihost: prefill's rank group over several nodes, one pod per rank,
as a LeaderWorkerSet in place of the gpu overlay's prefill StatefulSet.

The render passes the strict schemas (the LeaderWorkerSet, a custom resource, field by field and
its pod templates as Pods); the leader pod is the gpu overlay's prefill pod with its group opened
(no drift between the two); the leader's arguments pass prefill's own parser, and the workers'
pass ``join-rank``'s with the variables the LWS controller sets, all naming one group.
"""

from __future__ import annotations

import kubernetes_validate
import pytest

from services.common.envs import INTERNAL_TOKEN_ENV
from services.common.ranks.join import build_parser, check_args
from tests.deploy.manifests import (
    K8S,
    Container,
    assert_renders_like_kubectl,
    container_env,
    find,
    flag,
    parse_service_args,
    render_kustomization,
)
from tests.deploy.test_k8s import K8S_VERSIONS

LWS_API = "leaderworkerset.x-k8s.io/v1"
NAME = "stageserve-prefill-group"
NAMESPACE = "stageserve"


@pytest.fixture(scope="module")
def docs() -> list[dict]:
    return render_kustomization(K8S / "overlays" / "gpu-multihost")


@pytest.fixture(scope="module")
def gpu() -> list[dict]:
    return render_kustomization(K8S / "overlays" / "gpu")


@pytest.fixture(scope="module")
def lws(docs) -> dict:
    return find(docs, "LeaderWorkerSet", NAME)


def templates(lws: dict) -> tuple[dict, dict]:
    group = lws["spec"]["leaderWorkerTemplate"]
    return group["leaderTemplate"], group["workerTemplate"]


def container(docs: list[dict], template: dict, lws: dict, lws_env: dict[str, str]) -> Container:
    config_maps = {
        d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"
    }
    [spec] = template["spec"]["containers"]
    return Container(lws, spec, {**container_env(spec, config_maps), **lws_env})


def lws_env(lws: dict, worker_index: int) -> dict[str, str]:
    """What the LWS controller sets in group 0's pod of ``worker_index`` (0: the leader)."""
    size = lws["spec"]["leaderWorkerTemplate"]["size"]
    return {
        "LWS_LEADER_ADDRESS": f"{NAME}-0.{NAME}.{NAMESPACE}",
        "LWS_GROUP_SIZE": str(size),
        "LWS_WORKER_INDEX": str(worker_index),
    }


def test_the_group_replaces_the_prefill_statefulset(docs, gpu, lws) -> None:
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert ("StatefulSet", "stageserve-prefill") not in names
    assert names - {("LeaderWorkerSet", NAME)} == {
        (d["kind"], d["metadata"]["name"]) for d in gpu
    } - {("StatefulSet", "stageserve-prefill")}


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_objects_and_pod_templates_pass_the_strict_schemas(docs, lws, version) -> None:
    pods = [
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"pod-{i}", **t["metadata"]}}
        | {"spec": t["spec"]}
        for i, t in enumerate(templates(lws))
    ]
    for doc in [*(d for d in docs if d["kind"] != "LeaderWorkerSet"), *pods]:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']}: {exc.message}")


def test_the_leader_worker_set_fields(lws) -> None:
    assert lws["apiVersion"] == LWS_API
    assert set(lws["spec"]) == {"replicas", "startupPolicy", "leaderWorkerTemplate"}
    # the leader is ready only once its group formed: waiting for it would never start the workers
    assert lws["spec"]["startupPolicy"] == "LeaderCreated"
    group = lws["spec"]["leaderWorkerTemplate"]
    assert set(group) == {"size", "restartPolicy", "leaderTemplate", "workerTemplate"}
    assert group["size"] >= 2
    assert group["restartPolicy"] in ("RecreateGroupOnPodRestart", "None")


def test_the_leader_is_the_gpu_prefill_pod_with_its_group_opened(gpu, lws) -> None:
    ours = templates(lws)[0]
    theirs = find(gpu, "StatefulSet", "stageserve-prefill")["spec"]["template"]
    [our_container], [their_container] = ours["spec"]["containers"], theirs["spec"]["containers"]
    size = lws["spec"]["leaderWorkerTemplate"]["size"]
    opened = ["--devices", ",".join(["cuda:0"] + ["join"] * (size - 1))]
    opened += ["--rank-address", "$(POD_IP):29600"]
    args = their_container["args"]
    at = args.index("--device")
    assert our_container["args"] == args[:at] + opened + args[at + 2 :]
    rank_port = {"name": "ranks", "containerPort": 29600}
    assert our_container["ports"] == [*their_container["ports"], rank_port]
    strip = lambda c: {k: v for k, v in c.items() if k not in ("args", "ports")}  # noqa: E731
    assert strip(our_container) == strip(their_container)
    assert {k: v for k, v in ours["spec"].items() if k != "containers"} == {
        k: v for k, v in theirs["spec"].items() if k != "containers"
    }
    assert ours["metadata"] == theirs["metadata"]


def test_leader_and_workers_name_one_group(docs, lws, monkeypatch) -> None:
    monkeypatch.setattr("services.common.kv_transfer.mooncake_moves_device_memory", lambda: True)
    leader_template, worker_template = templates(lws)
    size = lws["spec"]["leaderWorkerTemplate"]["size"]
    leader = container(docs, leader_template, lws, lws_env(lws, 0))
    config = parse_service_args("prefill", leader.args[2:])
    assert config.devices == ("cuda:0", *["join"] * (size - 1))
    host, port = config.rank_address.rsplit(":", 1)
    assert host == leader.env["POD_IP"] and int(port) == leader.port("ranks")
    monkeypatch.setenv(INTERNAL_TOKEN_ENV, "from the secret")  # both read the same Secret key
    for index in range(1, size):
        worker = container(docs, worker_template, lws, lws_env(lws, index))
        assert worker.args[0] == "join-rank"
        args = build_parser().parse_args(worker.args[1:])
        assert check_args(args) is None
        assert args.leader == f"tcp://{NAME}-0.{NAME}.{NAMESPACE}:{port}"
        assert (args.rank, args.world_size, args.device) == (index, size, "cuda:0")
        assert args.host == worker.env["POD_IP"]
    for template in (leader_template, worker_template):
        [spec] = template["spec"]["containers"]
        secret = [e for e in spec["env"] if e["name"] == INTERNAL_TOKEN_ENV]
        assert secret[0]["valueFrom"]["secretKeyRef"]["key"] == "internal-token"
        assert (
            spec["image"]
            == find(docs, "StatefulSet", "stageserve-decode")["spec"]["template"]["spec"][
                "containers"
            ][0]["image"]
        )


def test_the_prefill_service_finds_the_leaders_only(docs, lws) -> None:
    leader_template, worker_template = templates(lws)
    selector = find(docs, "Service", "stageserve-prefill")["spec"]["selector"]
    labels = lambda t: t["metadata"]["labels"]  # noqa: E731
    assert selector.items() <= labels(leader_template).items()
    for service in (d for d in docs if d["kind"] == "Service"):
        assert not service["spec"]["selector"].items() <= labels(worker_template).items()
    internal = find(docs, "NetworkPolicy", "stageserve-internal")["spec"]
    for template in (leader_template, worker_template):  # rank traffic: any port, pod to pod
        assert internal["podSelector"]["matchLabels"].items() <= labels(template).items()
    assert flag(container(docs, worker_template, lws, lws_env(lws, 1)).args, "--device") == [
        "cuda:0"
    ]


def test_renders_like_kubectl_kustomize(docs) -> None:
    assert_renders_like_kubectl(K8S / "overlays" / "gpu-multihost", docs)
