"""deploy/compose*.yaml: valid compose files in both variants, consistent with the services.

``docker compose config`` runs where a docker CLI with the compose plugin exists; the
compose-spec JSON schema (the copy check-jsonschema vendors) checks the files everywhere,
after the same variable interpolation and ``-f compose.yaml -f compose.gpu.yaml`` merge.
Nothing here needs docker: the stop grace periods are checked against the services' own
drain budgets and against the Kubernetes overlay of the same variant.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from importlib.metadata import version
from importlib.resources import files

import jsonschema
import pytest
import yaml

from services.common.exposure import ExposureError, check_api_exposure
from tests.deploy.manifests import (
    DEPLOY,
    K8S,
    SERVICES,
    dockerfile,
    duration_s,
    flag,
    interpolate,
    merge_compose,
    parse_service_args,
    read_env_file,
    render_kustomization,
    rendered_containers,
    stop_s,
)

COMPOSE_DEFAULT_GRACE = "10s"  # a service's stop_grace_period when it sets none
TOKEN_ENV = {"STAGESERVE_INTERNAL_TOKEN": "test-token", "STAGESERVE_API_KEY": "sk-test"}
VARIANTS = {
    "cpu": (["compose.yaml"], {}),
    "gpu": (
        ["compose.yaml", "compose.gpu.yaml"],
        {**read_env_file(DEPLOY / "gpu.env"), "STAGESERVE_MODELS_DIR": "/srv/models"},
    ),
}


def compose_schema() -> dict:
    return json.loads(
        (files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json").read_text()
    )


def load_variant(name: str, env: dict[str, str]) -> dict:
    paths, variant_env = VARIANTS[name]
    merged: dict = {}
    for path in paths:
        merged = merge_compose(
            merged, interpolate(yaml.safe_load((DEPLOY / path).read_text()), env | variant_env)
        )
    return merged


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def project(variant) -> dict:
    return load_variant(variant, TOKEN_ENV)


@pytest.fixture
def gpu_mooncake(monkeypatch, variant) -> None:
    """The GPU image's Mooncake moves GPU memory (test_dockerfiles checks it installs that
    build)."""
    if variant == "gpu":
        monkeypatch.setattr(
            "services.common.kv_transfer.mooncake_moves_device_memory", lambda: True
        )


def has_compose_plugin() -> bool:
    if shutil.which("docker") is None:
        return False
    return (
        subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30).returncode
        == 0
    )


def test_docker_compose_config(variant) -> None:
    if not has_compose_plugin():
        pytest.skip(
            "no docker CLI with the compose plugin here: the compose-spec schema test checks"
        )
    paths, variant_env = VARIANTS[variant]
    cmd = [
        "docker",
        "compose",
        *[a for p in paths for a in ("-f", str(DEPLOY / p))],
        "config",
        "--quiet",
    ]
    env = {**os.environ, **TOKEN_ENV, **variant_env}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr


def test_matches_the_compose_spec_schema(project) -> None:
    schema = compose_schema()
    validator = jsonschema.validators.validator_for(schema)(schema)
    errors = [
        f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
        for e in validator.iter_errors(project)
    ]
    assert not errors, "\n".join(errors)


def test_the_internal_token_and_the_api_key_are_required(variant) -> None:
    with pytest.raises(KeyError, match="STAGESERVE_INTERNAL_TOKEN"):
        load_variant(variant, {"STAGESERVE_API_KEY": "sk-test"})
    with pytest.raises(KeyError, match="STAGESERVE_API_KEY"):
        load_variant(variant, {"STAGESERVE_INTERNAL_TOKEN": "test-token"})
    for name, service in load_variant(variant, TOKEN_ENV)["services"].items():
        assert (
            service["environment"]["STAGESERVE_INTERNAL_TOKEN"]
            == TOKEN_ENV["STAGESERVE_INTERNAL_TOKEN"]
        ), name
    router = project_services(variant)["router"]
    assert router["environment"]["STAGESERVE_API_KEY"] == TOKEN_ENV["STAGESERVE_API_KEY"]
    args = parse_service_args("router", router["command"][2:])
    check_api_exposure((args.host, args.http_host), True, args.insecure_no_api_key)
    with pytest.raises(ExposureError, match="without an API key"):  # 0.0.0.0 needs the key
        check_api_exposure((args.host, args.http_host), False, args.insecure_no_api_key)


def project_services(variant: str) -> dict:
    return load_variant(variant, TOKEN_ENV)["services"]


def test_every_service_accepts_its_command(project, gpu_mooncake) -> None:
    assert sorted(project["services"]) == sorted(SERVICES)
    for name, service in project["services"].items():
        assert service["command"][:2] == ["serve", name]
        parse_service_args(name, service["command"][2:])


def test_addresses_ports_and_health_checks_agree(project) -> None:
    services = project["services"]
    grpc_port = {name: flag(s["command"], "--port") for name, s in services.items()}
    for name, service in services.items():
        command = service["command"]
        assert service["healthcheck"]["test"][-1] == f"127.0.0.1:{grpc_port[name][0]}"
        for address_flag in (
            "--tokenizer-address",
            "--prefill-address",
            "--decode-address",
            "--encoder-address",
        ):
            for address in flag(command, address_flag):
                host, port = address.rsplit(":", 1)
                assert host in services and [port] == grpc_port[host], (name, address)
                assert host in service.get("depends_on", {}) or name != "router", (name, host)
        if "--transfer-host" in command:
            assert flag(command, "--transfer-host") == [
                name
            ]  # what the peers resolve on the network
    (published,) = services["router"]["ports"]
    assert published.rsplit(":", 1)[1] == flag(services["router"]["command"], "--http-port")[0]
    assert all("ports" not in s for n, s in services.items() if n != "router")


def test_images_and_builds(variant, project) -> None:
    for name, service in project["services"].items():
        assert service["image"] == f"stageserve:{version('stageserve')}-{variant}", name
        assert service["build"]["dockerfile"] == f"deploy/Dockerfile.{variant}"
        assert (DEPLOY / ".." / service["build"]["dockerfile"]).is_file()
        assert service["read_only"] is True and service["cap_drop"] == ["ALL"]


def test_gpu_variant_gives_each_model_service_a_gpu_and_the_jit_cache() -> None:
    services = project_services("gpu")
    for name in ("vision_encoder", "prefill", "decode"):
        (device,) = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        assert "jit-cache:/var/cache/stageserve" in services[name]["volumes"]
        assert flag(services[name]["command"], "--device") == ["cuda"]
    for name in ("tokenizer", "router"):
        assert "deploy" not in services[name]
    for name, service in services.items():
        assert "/srv/models:/models:ro" in service["volumes"], name
        assert flag(service["command"], "--model") == ["/models/current"], name


def test_timeouts_agree(project, gpu_mooncake) -> None:
    """Decode holds a reservation as long as the router lets a request run; its quarantine
    outlasts a stuck Mooncake transfer."""
    services = project["services"]
    decode = parse_service_args("decode", services["decode"]["command"][2:])
    router = parse_service_args("router", services["router"]["command"][2:])
    transfer_timeout_s = float(services["decode"]["environment"]["MC_TRANSFER_TIMEOUT"])
    assert decode.kv_quarantine_s > transfer_timeout_s
    assert decode.max_reservation_s >= router.request_timeout_s


def test_every_service_has_time_to_drain_and_stop(variant, project, gpu_mooncake) -> None:
    """SIGTERM (no other stop signal is set), then SIGKILL after ``stop_grace_period``: that
    must cover the drain budget and the rest of the stop, as the service bounds them from the
    flags the compose file gives it (compose's default, 10 s, cuts every long stream)."""
    image = dockerfile(DEPLOY / f"Dockerfile.{variant}")
    assert not [i for i in image if i.keyword == "STOPSIGNAL"]
    for name, service in project["services"].items():
        assert service.get("stop_signal", "SIGTERM") == "SIGTERM", name
        grace_s = duration_s(service.get("stop_grace_period", COMPOSE_DEFAULT_GRACE))
        needed_s = stop_s(name, service["command"][2:])
        assert grace_s >= needed_s, f"{name}: {grace_s:g} s to stop, needs {needed_s:g} s"


def test_stop_grace_periods_match_kubernetes(variant, project) -> None:
    """Each service gets as long to stop under compose as its pod under the same overlay."""
    pods = rendered_containers(render_kustomization(K8S / "overlays" / variant))
    k8s = {c.service: c.pod["spec"]["terminationGracePeriodSeconds"] for c in pods}
    compose = {
        name: duration_s(service.get("stop_grace_period", COMPOSE_DEFAULT_GRACE))
        for name, service in project["services"].items()
    }
    assert compose == k8s


def test_the_router_stops_before_the_workers_it_streams_from(project) -> None:
    """``docker compose down`` stops a service only once its dependents have stopped: the
    router, depending on every worker, drains while they still serve its streams."""
    services = project["services"]
    workers = sorted(name for name in services if name != "router")
    assert sorted(services["router"]["depends_on"]) == workers
