"""Build deploy/Dockerfile.cpu and send its default command (`stageserve up`) one chat request.

Needs a container engine (DOCKER_HOST or /var/run/docker.sock) that can pull the base image
and reach the package indexes; skipped, with the reason, where none answers.
"""

from __future__ import annotations

import docker
import docker.errors
import httpx
import pytest

from tests.conftest import REPO

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

UP_TIMEOUT_S = 600


def engine_error() -> str | None:
    try:
        docker.from_env(timeout=10).ping()
    except (docker.errors.DockerException, OSError) as exc:  # requests' errors are OSErrors
        return f"{type(exc).__name__}: {exc}"
    return None


def test_cpu_image_serves_a_chat() -> None:
    error = engine_error()
    if error is not None:
        pytest.skip(f"no container engine answers here ({error})")
    from testcontainers.core.container import DockerContainer
    from testcontainers.core.image import DockerImage
    from testcontainers.core.waiting_utils import wait_for_logs

    with DockerImage(
        path=str(REPO), dockerfile_path="deploy/Dockerfile.cpu", tag="stageserve:test-cpu"
    ) as image:
        container = (
            DockerContainer(str(image))
            .with_exposed_ports(8000)
            .with_kwargs(shm_size="1g")
            .with_env("STAGESERVE_API_KEY", "sk-image-test")  # 0.0.0.0 needs one
        )
        with container:
            wait_for_logs(container, "stageserve is up", timeout=UP_TIMEOUT_S, raise_on_exit=True)
            url = f"http://{container.get_container_host_ip()}:{container.get_exposed_port(8000)}"
            body = {
                "model": "tiny-qwen2.5-vl",
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}],
            }
            key = {"authorization": "Bearer sk-image-test"}
            reply = httpx.post(f"{url}/v1/chat/completions", json=body, headers=key, timeout=120)
            assert reply.status_code == 200, reply.text
            assert 1 <= reply.json()["usage"]["completion_tokens"] <= 4
            user = container.exec(["id", "-u"]).output.decode().strip()
            assert user == "10001"
