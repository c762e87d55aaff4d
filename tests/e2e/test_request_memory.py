"""What a hostile or huge request costs the router and the tokenizer, measured on the real
processes of ``stageserve up``: a ``prompt_embeds`` file claiming a huge shape is refused from
its header (HTTP 400, gRPC INVALID_ARGUMENT) without the router growing, and memory that bodies
near the size limit took is given back once they are answered."""

from __future__ import annotations

import base64
import concurrent.futures
import io
import json
import os
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch

from services.common.pb.stageserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.e2e.system import System, start_system

KEY = "sk-e2e-memory"
MB = 1024 * 1024
EMBEDS_GROWTH_MB = 50  # a 1.6 KB file: nothing it claims may be allocated
RETURNED_MB = 200  # per process, after 48 bodies of 30 MB (each held ~150 MB in flight)
BOMBS = [
    (torch.zeros(1).expand(250_000, 2048), "has 250000 rows"),
    (torch.zeros(1).expand(2_500_000, 2048), "has 2500000 rows"),
    (torch.zeros(1).expand(16, 10**9), "rows have 1000000000 values"),
]
_LETTERS = bytes((32 if i % 8 == 0 else 97 + i % 26) for i in range(256))


@pytest.fixture(scope="module")
def system(tmp_path_factory) -> System:
    system = start_system(tmp_path_factory.mktemp("memory"), "--api-key", KEY)
    try:
        yield system
    finally:
        system.stop()


def _status_mb(pid: int, key: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no {key} for {pid}")


def _post(system: System, path: str, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{system.http_port}{path}",
        data=body,
        headers={"authorization": f"Bearer {KEY}", "content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _saved(tensor: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(tensor, buf)
    return buf.getvalue()


def test_prompt_embeds_bombs_are_refused_without_router_growth(system):
    router = system.state["router"]["pid"]
    rss, hwm = _status_mb(router, "VmRSS"), _status_mb(router, "VmHWM")
    channel = grpc.insecure_channel(system.address("router"))
    stub = router_pb2_grpc.RouterStub(channel)
    try:
        for tensor, message in BOMBS:
            raw = _saved(tensor)
            body = {"prompt_embeds": base64.b64encode(raw).decode(), "max_tokens": 4}
            status, reply = _post(system, "/v1/completions", json.dumps(body).encode())
            assert status == 400 and reply["error"]["param"] == "prompt_embeds", reply
            assert message in reply["error"]["message"], reply
            request = router_pb2.GenerateRequest(
                prompt_embeds=raw, sampling_params=common_pb2.SamplingParams(max_new_tokens=4)
            )
            with pytest.raises(grpc.RpcError) as caught:
                list(stub.Generate(request, metadata=[("authorization", f"Bearer {KEY}")]))
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert message in caught.value.details()
    finally:
        channel.close()
    grown = max(_status_mb(router, "VmRSS") - rss, _status_mb(router, "VmHWM") - hwm)
    assert grown < EMBEDS_GROWTH_MB, f"router grew {grown:.0f} MB"


def _tokenizer_tree(pid: int) -> list[int]:
    pids = [pid]
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            pids += _tokenizer_tree(int(child))
    return pids


def _chat_body(num_bytes: int) -> bytes:
    text = os.urandom(num_bytes).translate(_LETTERS)  # distinct random words
    return b'{"messages":[{"role":"user","content":"' + text + b'"}],"max_tokens":4}'


def test_memory_of_large_rejected_bodies_is_given_back(system):
    pids = {"router": system.state["router"]["pid"]}
    pids |= {
        f"tokenizer{i}": p for i, p in enumerate(_tokenizer_tree(system.state["tokenizer"]["pid"]))
    }
    before = {name: _status_mb(pid, "VmRSS") for name, pid in pids.items()}
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        for _ in range(3):
            bodies = [_chat_body(30_000_000) for _ in range(16)]
            answers = list(pool.map(lambda b: _post(system, "/v1/chat/completions", b), bodies))
            del bodies
            # 400: over the context limit; 429: the tokenizer's queue bound (256 MiB) was full
            other = [
                (status, reply)
                for status, reply in answers
                if status != 400
                and not (status == 429 and "the tokenizer is busy" in reply["error"]["message"])
            ]
            assert not other, other[:2]
    grown: dict[str, float] = {}
    deadline_mono = time.monotonic() + 30
    while time.monotonic() < deadline_mono:
        grown = {name: _status_mb(pid, "VmRSS") - before[name] for name, pid in pids.items()}
        if max(grown.values()) < RETURNED_MB:
            break
        time.sleep(0.5)
    assert max(grown.values()) < RETURNED_MB, f"still held (MB): {grown}"
