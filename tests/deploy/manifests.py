"""Read deploy/ as the tools would: kustomize renders, compose files, Dockerfiles, service flags.

``render_kustomization`` is a small kustomize for what deploy/k8s uses (resources, components,
strategic merge patches, images) and refuses anything else, so a new kustomize feature cannot slip
past the tests unrendered; test_k8s.py checks it against ``kubectl kustomize`` where that
exists. ``parse_service_args`` hands a container's arguments to the service's own parser;
``stop_s`` asks the service how long a SIGTERM takes to end it.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib
import inspect
import io
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.common import settings
from services.common.envs import Envs
from services.common.server import serve_until_signal
from services.router.config import RouterConfig
from tests.conftest import REPO

DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
OVERLAYS = ("cpu", "gpu")
SERVICES = ("tokenizer", "vision_encoder", "prefill", "decode", "router")
KUSTOMIZE_KEYS = {"apiVersion", "kind", "resources", "components", "images", "patches"}
COMPONENTS = K8S / "components"
# Strategic-merge keys of the lists deploy/k8s patches (others are replaced whole).
MERGE_KEYS = {
    "containers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
}
WORKLOAD_KINDS = ("Deployment", "StatefulSet")


def load_docs(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _merge(target: Any, patch: Any, key: str = "") -> Any:
    if isinstance(target, dict) and isinstance(patch, dict):
        assert not any(k.startswith("$") for k in patch), f"unsupported patch directive in {patch}"
        for name, value in patch.items():
            if value is None:  # a strategic merge patch's null deletes the field
                target.pop(name, None)
                continue
            target[name] = (
                _merge(target[name], value, name) if name in target else copy.deepcopy(value)
            )
        return target
    merge_key = MERGE_KEYS.get(key)
    if isinstance(target, list) and isinstance(patch, list) and merge_key:
        by_key = {item[merge_key]: item for item in target}
        for item in patch:
            if item[merge_key] in by_key:
                _merge(by_key[item[merge_key]], item)
            else:
                target.append(copy.deepcopy(item))
        return target
    return copy.deepcopy(patch)


def find(docs: list[dict], kind: str, name: str) -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{len(found)} {kind}/{name} in the render"
    return found[0]


def _kustomization(directory: Path, kind: str) -> dict:
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - KUSTOMIZE_KEYS
    assert not unknown, f"{directory}: this test's renderer does not implement {sorted(unknown)}"
    assert kustomization.get("kind", "Kustomization") == kind, f"{directory}: not a {kind}"
    return kustomization


def _add_resources_and_patches(directory: Path, kustomization: dict, docs: list[dict]) -> None:
    for resource in kustomization.get("resources", []):
        path = directory / resource
        docs += render_kustomization(path) if path.is_dir() else load_docs(path)
    for patch in kustomization.get("patches", []):
        assert set(patch) == {"path"}, f"{directory}: only file patches are rendered here: {patch}"
        for doc in load_docs(directory / patch["path"]):
            target = find(docs, doc["kind"], doc["metadata"]["name"])
            if doc.get("$patch") == "delete":  # the one directive rendered: drop the object
                docs.remove(target)
            else:
                _merge(target, doc)


def render_kustomization(directory: Path, components: tuple[Path, ...] = ()) -> list[dict]:
    """The resources ``kustomize build directory`` prints, for the features deploy/k8s uses;
    ``components`` are added after the kustomization's own, as an overlay listing them would."""
    kustomization = _kustomization(directory, "Kustomization")
    docs: list[dict] = []
    _add_resources_and_patches(directory, {"resources": kustomization.get("resources", [])}, docs)
    for component in [*(directory / c for c in kustomization.get("components", [])), *components]:
        _add_resources_and_patches(component, _kustomization(component, "Component"), docs)
    _add_resources_and_patches(directory, {"patches": kustomization.get("patches", [])}, docs)
    for image in kustomization.get("images", []):
        for container in containers(docs):
            if container["image"].split(":")[0] == image["name"]:
                container["image"] = f"{image.get('newName', image['name'])}:{image['newTag']}"
    return docs


def kubectl_kustomize(directory: Path) -> list[dict]:
    """The objects ``kubectl kustomize directory`` prints."""
    rendered = subprocess.run(
        ["kubectl", "kustomize", str(directory)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    return [d for d in yaml.safe_load_all(rendered) if d]


def assert_renders_like_kubectl(directory: Path, docs: list[dict]) -> None:
    """``docs`` (this renderer's) are ``kubectl kustomize directory``'s objects; skips the test
    where kubectl is not installed."""
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed: the render is checked by this renderer only")
    key = lambda d: (d["kind"], d["metadata"]["name"])  # noqa: E731
    theirs = sorted(kubectl_kustomize(directory), key=key)
    assert [normalized(d) for d in sorted(docs, key=key)] == [normalized(d) for d in theirs]


def normalized(value: Any, key: str = "") -> Any:
    """``value`` with merge-keyed lists sorted, so two renders compare regardless of order."""
    if isinstance(value, dict):
        return {k: normalized(v, k) for k, v in value.items()}
    if isinstance(value, list):
        items = [normalized(v, key) for v in value]
        merge_key = MERGE_KEYS.get(key)
        if merge_key and all(isinstance(item, dict) and merge_key in item for item in items):
            return sorted(items, key=lambda item: str(item[merge_key]))
        return items
    return value


def workloads(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d["kind"] in WORKLOAD_KINDS]


def pod_templates(doc: dict) -> list[dict]:
    """The pod templates of a workload: a Deployment's or StatefulSet's one, a LeaderWorkerSet's
    leader and worker templates; none for other kinds."""
    if doc["kind"] in WORKLOAD_KINDS:
        return [doc["spec"]["template"]]
    if doc["kind"] == "LeaderWorkerSet":
        group = doc["spec"]["leaderWorkerTemplate"]
        return [group["leaderTemplate"], group["workerTemplate"]]
    return []


def containers(docs: list[dict]) -> Iterator[dict]:
    """Every container of every pod template (``images:`` reaches them all, as in kustomize)."""
    for doc in docs:
        for template in pod_templates(doc):
            yield from template["spec"]["containers"]


@dataclass(frozen=True)
class Container:
    """One container of a rendered workload, with its environment as the kubelet builds it."""

    workload: dict
    spec: dict
    env: dict[str, str]

    @property
    def pod(self) -> dict:
        return self.workload["spec"]["template"]

    @property
    def args(self) -> list[str]:
        """``args`` with ``$(VAR)`` expanded; a reference to no variable fails the test."""
        expanded = []
        for arg in self.spec["args"]:
            for name in re.findall(r"\$\((\w+)\)", arg):
                assert name in self.env, f"{self.spec['name']}: $({name}) names no variable"
                arg = arg.replace(f"$({name})", self.env[name])
            expanded.append(arg)
        return expanded

    @property
    def service(self) -> str:
        assert self.spec["args"][0] == "serve", self.spec["args"]
        return self.spec["args"][1]

    def port(self, name: str) -> int:
        (port,) = [p["containerPort"] for p in self.spec["ports"] if p["name"] == name]
        return port


POD_IP = "192.0.2.10"  # a documentation address: only parsed, never dialled


def rendered_containers(docs: list[dict]) -> list[Container]:
    config_maps = {
        d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"
    }
    found = []
    for workload in workloads(docs):
        for spec in workload["spec"]["template"]["spec"]["containers"]:
            found.append(Container(workload, spec, container_env(spec, config_maps)))
    return found


def container_env(spec: dict, config_maps: Mapping[str, Mapping[str, str]]) -> dict[str, str]:
    """A container's environment as the kubelet builds it (its ConfigMaps, then its own values;
    a pod's IP is ``POD_IP``)."""
    env: dict[str, str] = {}
    for source in spec.get("envFrom", []):
        env.update(config_maps[source["configMapRef"]["name"]])
    for var in spec.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        elif var["valueFrom"].get("fieldRef", {}).get("fieldPath") == "status.podIP":
            env[var["name"]] = POD_IP
    return env


def flag(args: list[str], name: str) -> list[str]:
    """Every value given to ``name`` in ``args`` (repeatable flags give several)."""
    return [args[i + 1] for i, arg in enumerate(args[:-1]) if arg == name]


def parse_service_args(service: str, args: list[str]) -> argparse.Namespace | Any:
    """Parse ``args`` with ``services.<service>.__main__``'s parser; its error message on failure.

    Tokenizer and router build their config by reading the checkpoint, so only their parser
    runs; decode, prefill and the vision encoder run their whole config check.
    """
    module = importlib.import_module(f"services.{service}.__main__")
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            if service in ("tokenizer", "router"):
                return module.build_parser(Envs()).parse_args(args)
            if service == "decode":
                return module.parse_config(args)
            return module.parse_args(args)
    except SystemExit as exc:
        raise AssertionError(
            f"{service} rejects {shlex.join(args)}: {exc} {stderr.getvalue()}"
        ) from None


def stop_s(service: str, args: list[str]) -> float:
    """The longest a SIGTERM takes to end ``service`` run with ``args``, as the service bounds it.

    Router, prefill and decode: their config's ``stop_s`` (the drain budget, then the rest of
    the stop). The tokenizer and the vision encoder have no drain: the gRPC grace of
    ``serve_until_signal``, then (the encoder) its ranks' stop grace.
    """
    parsed = parse_service_args(service, args)
    if service == "router":
        return settings.config_from_args(RouterConfig, parsed, model=parsed.model).stop_s
    if service in ("prefill", "decode"):
        return parsed.stop_s
    grace_s = inspect.signature(serve_until_signal).parameters["grace_s"].default
    if service == "tokenizer":
        return grace_s
    assert service == "vision_encoder", service
    from services.vision_encoder.app import rank_group_configs

    return grace_s + max(group.stop_grace_s for group in rank_group_configs(parsed, Envs()))


_DURATION = re.compile(r"(\d+(?:\.\d+)?)(us|ms|s|m|h)")
_UNIT_S = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def duration_s(value: str) -> float:
    """A compose duration (``330s``, ``5m30s``, ``1.5h``) in seconds."""
    parts = _DURATION.findall(value)
    assert parts and "".join(n + u for n, u in parts) == value, f"not a duration: {value!r}"
    return sum(float(n) * _UNIT_S[u] for n, u in parts)


_VARIABLE = re.compile(r"\$\$|\$\{(\w+)(?:(:?[-?])([^}]*))?\}")


def interpolate(value: Any, env: Mapping[str, str]) -> Any:
    """Compose's ``${VAR}``, ``${VAR:-default}``, ``${VAR-default}``, ``${VAR:?error}``, ``$$``."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        name, operator, word = match.groups()
        is_set = name in env and (env[name] != "" or not (operator or "").startswith(":"))
        if operator in (":?", "?") and not is_set:
            raise KeyError(f"${{{name}}}: {word}")
        return env[name] if is_set else (word if operator else "")

    return _VARIABLE.sub(substitute, value)


def read_env_file(path: Path) -> dict[str, str]:
    lines = [line.strip() for line in path.read_text().splitlines()]
    return dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))


def merge_compose(base: dict, override: dict) -> dict:
    """``docker compose -f base -f override``: mappings merge, volumes add up, the rest is
    replaced."""
    merged = copy.deepcopy(base)
    for name, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(name), dict):
            merged[name] = merge_compose(merged[name], value)
        elif name == "volumes" and isinstance(value, list):
            merged[name] = [*merged.get(name, []), *value]
        else:
            merged[name] = copy.deepcopy(value)
    return merged


@dataclass(frozen=True)
class Instruction:
    keyword: str
    value: str


def dockerfile(path: Path) -> list[Instruction]:
    """Instructions with continuation lines joined and comments dropped."""
    text = re.sub(
        r"\\\n",
        " ",
        "\n".join(
            line for line in path.read_text().splitlines() if not line.lstrip().startswith("#")
        ),
    )
    found = []
    for line in text.splitlines():
        if line.strip():
            keyword, _, value = line.strip().partition(" ")
            found.append(Instruction(keyword.upper(), " ".join(value.split())))
    return found


def stages(instructions: list[Instruction]) -> list[list[Instruction]]:
    result: list[list[Instruction]] = []
    for instruction in instructions:
        if instruction.keyword == "FROM":
            result.append([])
        result[-1].append(instruction)
    return result
