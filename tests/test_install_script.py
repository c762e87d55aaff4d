"""``scripts/install.sh``'s choices, printed with ``DRY_RUN=1``: where torch comes from (PyPI
with an NVIDIA GPU; without one PyTorch's CPU index when it answers, else PyPI, said so), and
extras only when asked. Nothing is installed."""

from __future__ import annotations

import functools
import http.server
import os
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO

SCRIPT = REPO / "scripts" / "install.sh"
BOUND_S = 60.0
HAS_NVIDIA_DRIVER = any(Path("/proc/driver/nvidia/gpus").glob("*"))


def fake_nvidia_smi(bin_dir: Path, gpus: str) -> None:
    """An ``nvidia-smi`` whose ``-L`` lists ``gpus`` (none: it fails, as without a driver)."""
    bin_dir.mkdir(exist_ok=True)
    path = bin_dir / "nvidia-smi"
    path.write_text(f"#!/bin/sh\n[ -n '{gpus}' ] || exit 9\necho '{gpus}'\n")
    path.chmod(0o755)


def dry_run(tmp_path: Path, *args: str, index: str, gpus: str = "") -> subprocess.CompletedProcess:
    fake_nvidia_smi(tmp_path / "bin", gpus)
    env = {
        **os.environ,
        "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}",
        "DRY_RUN": "1",
        "VENV": str(tmp_path / "venv"),
        "TORCH_CPU_INDEX": index,
        "TORCH_INDEX_PROBE_S": "2",
    }
    env.pop("CI", None)
    return subprocess.run(
        ["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=BOUND_S
    )


def torch_command(result: subprocess.CompletedProcess) -> str:
    (line,) = [line for line in result.stdout.splitlines() if "torch==" in line]
    return line


@pytest.fixture
def closed_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/whl/cpu"


@pytest.fixture
def cpu_index(tmp_path: Path) -> Iterator[str]:
    (tmp_path / "index" / "whl" / "cpu" / "torch").mkdir(parents=True)
    handler = functools.partial(
        http.server.SimpleHTTPRequestHandler, directory=str(tmp_path / "index")
    )
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/whl/cpu"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.mark.skipif(HAS_NVIDIA_DRIVER, reason="this host has an NVIDIA GPU")
def test_without_a_gpu_torch_comes_from_the_cpu_index(tmp_path: Path, cpu_index: str) -> None:
    result = dry_run(tmp_path, index=cpu_index)
    assert result.returncode == 0, result.stderr
    assert f"--index-url {cpu_index} torch==2.13.0" in torch_command(result)
    assert "the CPU build, from" in result.stderr


@pytest.mark.skipif(HAS_NVIDIA_DRIVER, reason="this host has an NVIDIA GPU")
def test_an_unreachable_cpu_index_falls_back_to_pypi_and_says_so(
    tmp_path: Path, closed_url: str
) -> None:
    result = dry_run(tmp_path, index=closed_url)
    assert result.returncode == 0, result.stderr
    assert "--index-url" not in torch_command(result)
    assert f"{closed_url} is not reachable" in result.stderr
    assert "from PyPI instead" in result.stderr


def test_with_a_gpu_torch_comes_from_pypi(tmp_path: Path, cpu_index: str) -> None:
    result = dry_run(tmp_path, index=cpu_index, gpus="GPU 0: NVIDIA H100 80GB HBM3 (UUID: x)")
    assert result.returncode == 0, result.stderr
    assert "--index-url" not in torch_command(result)
    assert "NVIDIA GPU found" in result.stderr


def test_extras_only_when_asked(tmp_path: Path, closed_url: str) -> None:
    bare = dry_run(tmp_path, index=closed_url)
    assert bare.stdout.splitlines()[-1].endswith("pip install -q -e .")
    assert "apt-get" not in bare.stdout and "Mooncake" not in bare.stderr
    asked = dry_run(tmp_path, "test,cpu", index=closed_url)
    assert asked.stdout.splitlines()[-1].endswith("pip install -q -e .[test,cpu]")
    assert "xgrammar" not in asked.stdout
    structured = dry_run(tmp_path, "test,structured", index=closed_url)
    *_, package, xgrammar = structured.stdout.splitlines()
    assert package.endswith("pip install -q -e .[test,structured]")
    assert xgrammar.endswith("pip install -q --no-deps xgrammar==0.2.9")


def test_an_unknown_extra_is_refused(tmp_path: Path, closed_url: str) -> None:
    result = dry_run(tmp_path, "test,cuda", index=closed_url)
    assert result.returncode == 2
    assert "unknown extra 'cuda' (known:" in result.stderr
    assert result.stdout == ""
