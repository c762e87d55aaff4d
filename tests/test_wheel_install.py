"""A platform engineer's install: sdist -> wheel -> a fresh venv outside the source tree.

The sdist is built from a copy of the source tree, the wheel from that sdist alone (so
the sdist is complete), and the wheel installed with the CPU image's extras and
deploy/constraints.txt into a new venv (no system site-packages; torch 2.13.0 from the
local wheel, the rest from pip's cache or the index). Every command then runs from a
temporary directory with no ``PYTHONPATH``, so nothing can come from the checkout.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
import venv
import zipfile
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from benchmarks.system_load import up_http_port
from tests.conftest import REPO
from tests.e2e.system import pid_alive

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

INSTALL_TIMEOUT_S = 900
UP_TIMEOUT_S = 300
ASSET_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "preprocessor_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
)
# Not part of a source distribution (and large: the checkout's .venv is over a gigabyte).
COPY_IGNORE = shutil.ignore_patterns(
    ".venv",
    ".git",
    "__pycache__",
    "*.egg-info",
    "build",
    "dist",
    ".*_cache",
    ".whl",
    ".gl",
    "*.pyc",
)


@dataclass(frozen=True)
class Install:
    sdist: Path
    wheel: Path
    venv: Path
    workdir: Path  # the cwd of every command: outside the checkout

    def bin(self, name: str) -> str:
        return str(self.venv / "bin" / name)


def clean_env() -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")
    }
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def run(cmd: list[str], cwd: Path, timeout_s: float) -> subprocess.CompletedProcess:
    done = subprocess.run(
        cmd, cwd=cwd, env=clean_env(), capture_output=True, text=True, timeout=timeout_s
    )
    assert done.returncode == 0, (
        f"{cmd} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    return done


@pytest.fixture(scope="module")
def install(tmp_path_factory) -> Install:
    root = tmp_path_factory.mktemp("wheel-install")
    src, dist, workdir = root / "src", root / "dist", root / "work"
    shutil.copytree(REPO, src, ignore=COPY_IGNORE)
    dist.mkdir()
    workdir.mkdir()
    build_sdist = f"from setuptools import build_meta; print(build_meta.build_sdist({str(dist)!r}))"
    sdist = dist / run([sys.executable, "-c", build_sdist], src, 300).stdout.split()[-1]
    run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(dist),
            str(sdist),
        ],
        workdir,
        300,
    )
    (wheel,) = dist.glob("stageserve-*.whl")
    env_dir = root / "venv"
    venv.EnvBuilder(with_pip=True, system_site_packages=False, symlinks=True).create(env_dir)
    pip = [str(env_dir / "bin" / "python"), "-m", "pip", "install", "-q", "--no-compile"]
    constraints = [
        "--constraint",
        str(REPO / "deploy" / "constraints.txt"),
    ]  # as deploy/Dockerfile.cpu
    run([*pip, *constraints, "torch==2.13.0", f"{wheel}[cpu]"], workdir, INSTALL_TIMEOUT_S)
    return Install(sdist, wheel, env_dir, workdir)


JPEG_ROWS_FILES = [
    f"services/engine/processing/libjpeg/{f}"
    for f in ("jpeg_rows.c", "jpeglib.h", "jmorecfg.h", "jconfig.h")
]


def test_sdist_carries_protos_and_the_model(install: Install) -> None:
    with tarfile.open(install.sdist) as tar:
        names = {Path(*Path(n).parts[1:]).as_posix() for n in tar.getnames()}
    assert "services/common/pb/stageserve/v1/decode.proto" in names
    assert {f"services/assets/tiny-qwen2.5-vl/{f}" for f in ASSET_FILES} <= names
    assert "services/py.typed" in names
    assert set(JPEG_ROWS_FILES) <= names


def test_wheel_carries_the_model_and_type_information(install: Install) -> None:
    names = set(zipfile.ZipFile(install.wheel).namelist())
    assert {f"services/assets/tiny-qwen2.5-vl/{f}" for f in ASSET_FILES} <= names
    assert {"services/py.typed", "services/common/pb/stageserve/v1/decode_pb2.pyi"} <= names
    assert set(JPEG_ROWS_FILES) <= names  # the encoder's band JPEG decoder builds from them
    # the gRPC contracts (stageserve.PROTO_ROOT) and the client users import
    assert {
        "services/common/pb/stageserve/v1/router.proto",
        "services/common/pb/stageserve/v1/common.proto",
        "stageserve/client/__init__.py",
    } <= names
    assert not any(n.startswith(("models/", "tests/", "examples/")) for n in names)


def test_everything_is_imported_from_the_venv(install: Install) -> None:
    probe = (
        "import services.common.paths as p; print(p.__file__); print(p.BUNDLED_MODEL); "
        "import opentelemetry.exporter.otlp.proto.grpc.trace_exporter; "
        "import opentelemetry.exporter.otlp.proto.http.trace_exporter"
    )  # both exporters are runtime dependencies
    module_file, model_dir = run(
        [install.bin("python"), "-c", probe], install.workdir, 60
    ).stdout.split()
    site = install.venv / "lib"
    assert Path(module_file).is_relative_to(site) and Path(model_dir).is_relative_to(site)
    assert (Path(model_dir) / "model.safetensors").is_file()


def test_version(install: Install) -> None:
    assert (
        run([install.bin("stageserve"), "--version"], install.workdir, 60).stdout.strip()
        == "stageserve 0.1.0"
    )


def test_generate_on_the_bundled_model(install: Install) -> None:
    done = run(
        [install.bin("stageserve"), "generate", "--prompt", "hi", "--max-tokens", "4"],
        install.workdir,
        300,
    )
    assert " generated, finish_reason=" in done.stderr
    num_generated = int(done.stderr.split(" generated")[0].rsplit(" ", 1)[-1])
    assert 1 <= num_generated <= 4


def test_up_serves_a_chat(install: Install) -> None:
    state_file = install.workdir / "state.json"
    cmd = [
        install.bin("stageserve"),
        "up",
        "--port",
        "0",  # the router binds a free port, which up's "is up" line names
        "--state-file",
        str(state_file),
        "--log-dir",
        str(install.workdir / "logs"),
    ]
    process = subprocess.Popen(
        cmd,
        cwd=install.workdir,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    output: list[str] = []
    threading.Thread(
        target=lambda: output.extend(line.rstrip() for line in process.stdout), daemon=True
    ).start()
    child_pids: list[int] = []
    try:
        deadline_mono = time.monotonic() + UP_TIMEOUT_S
        while not (ports := [p for p in map(up_http_port, output) if p is not None]):
            assert process.poll() is None and time.monotonic() < deadline_mono, "\n".join(output)
            time.sleep(0.2)
        port = ports[0]
        state = json.loads(state_file.read_text())
        child_pids = [v["pid"] for k, v in state.items() if k != "launcher"]
        body = {
            "model": "tiny-qwen2.5-vl",
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "hi"}],
        }
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        assert 1 <= reply.json()["usage"]["completion_tokens"] <= 4
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0, "\n".join(output)
    assert not [pid for pid in child_pids if pid_alive(pid)]
