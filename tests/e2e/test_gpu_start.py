"""Day one on a GPU (device tool, never in CI): the GPU image's default command and the
README's GPU command, each run as a process with the same arguments, start on one GPU with
no other flag and serve a chat with an image; ``up`` says what it chose for the device, and
decode sized its KV pool from ``--gpu-memory-utilization`` (the share itself is checked within
2% by ``tests/engine/test_kv_sizing_gpu.py``)."""

from __future__ import annotations

import base64
import json
import os
import secrets

import httpx
import pytest
import torch

from services.common.paths import BUNDLED_MODEL
from tests.conftest import REPO, image_bytes
from tests.e2e.system import running_system

pytestmark = [pytest.mark.gpu, pytest.mark.e2e, pytest.mark.slow]


def image_cmd() -> list[str]:
    """``deploy/Dockerfile.gpu``'s ENTRYPOINT + CMD, as ``docker run`` would run them."""
    entrypoint, cmd = None, None
    for line in (REPO / "deploy" / "Dockerfile.gpu").read_text().splitlines():
        if line.startswith("ENTRYPOINT "):
            entrypoint = json.loads(line.removeprefix("ENTRYPOINT "))
        if line.startswith("CMD "):
            cmd = json.loads(line.removeprefix("CMD "))
    assert entrypoint == ["stageserve"] and cmd and cmd[0] == "up", (entrypoint, cmd)
    return cmd


README_GPU = ["up", "--model", str(BUNDLED_MODEL), "--device", "cuda", "--dtype", "bfloat16"]


@pytest.mark.parametrize("argv", [image_cmd(), README_GPU], ids=["image-cmd", "readme"])
def test_the_documented_gpu_command_serves(tmp_path, argv) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if argv == README_GPU:
        readme = (REPO / "README.md").read_text()
        assert "stageserve up --model /path/to/Qwen2.5-VL-7B-Instruct --device cuda --dtype " \
            "bfloat16" in readme  # fmt: skip
    key = secrets.token_urlsafe(24)
    env = {**os.environ, "STAGESERVE_API_KEY": key}
    with running_system(tmp_path, *argv[1:], env=env) as system:
        chose, _ = system.wait_for_output("stageserve up:", timeout_s=5)
        api = httpx.Client(base_url=system.base_url, timeout=120, trust_env=False)
        auth = {"Authorization": f"Bearer {key}"}
        models = api.get("/models", headers=auth)
        assert models.status_code == 200, models.text
        model = models.json()["data"][0]["id"]
        data = base64.b64encode(image_bytes(320, 240, seed=3)).decode()
        content = [
            {"type": "image_url", "image_url": {"url": f"data:image/jpeg;base64,{data}"}},
            {"type": "text", "text": "What is in this picture?"},
        ]
        body = {
            "model": model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 8,
            "temperature": 0,
        }
        reply = api.post("/chat/completions", json=body, headers=auth)
        assert reply.status_code == 200, reply.text
        answer = reply.json()
        assert answer["usage"]["completion_tokens"] >= 1, answer
        assert answer["choices"][0]["finish_reason"] in ("stop", "length"), answer
        wrong = api.get("/models", headers={"Authorization": "Bearer wrong"})
        assert wrong.status_code == 401, wrong.text
        decode_logs = "".join(p.read_text() for p in (tmp_path / "logs").glob("decode*.log"))
    print(chose)
    assert "cuda_ipc" in chose, chose  # KV between processes on the GPU
    assert "KV pool:" in decode_logs and "--gpu-memory-utilization" in decode_logs, decode_logs[
        -2000:
    ]
