"""The gRPC API of a whole system (``stageserve up --grpc-port P --enable-reflection --api-key K``
on the bundled tiny model), through ``stageserve.client`` and the examples users copy.

The examples run as a user runs them (``python examples/...``, their output checked); the
router serves on the port ``up`` was given, lists its services over reflection, and refuses a
call without the key.
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from stageserve import PROTO_ROOT
from stageserve.client import Client, Image, Message, Sampling, UnauthenticatedError
from tests.conftest import REPO, image_bytes
from tests.e2e.system import running_system

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
API_KEY = "e2e-grpc-client-key"
TIMEOUT_S = 300  # generous bound on "no hang"


def free_port() -> int:
    """A free port below the kernel's ephemeral range: one from that range (port 0) may be
    handed to another process's connection or port-0 bind before ``up``'s router binds it."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for port in random.Random().sample(range(low // 2, low), 200):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError(f"no free port in {low // 2}..{low}")


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    grpc_port = free_port()
    env = {**os.environ, "STAGESERVE_API_KEY": API_KEY}
    with running_system(
        tmp_path_factory.mktemp("grpc"),
        *("--num-pages", "256", "--grpc-port", str(grpc_port), "--enable-reflection"),
        env=env,
    ) as system:
        system.grpc_port = grpc_port
        yield system


def run_example(system, name: str, *args: str) -> str:
    result = subprocess.run(
        [sys.executable, f"examples/{name}", "--address", f"127.0.0.1:{system.grpc_port}", *args],
        cwd=REPO,
        env={**os.environ, "STAGESERVE_API_KEY": API_KEY, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_the_router_serves_on_the_grpc_port_up_was_given(system):
    assert int(system.state["router"]["port"]) == system.grpc_port


def test_the_blocking_example_generates_and_streams_an_image_chat(system, tmp_path):
    image = tmp_path / "image.png"
    image.write_bytes(image_bytes(64, 48, seed=5))
    out = run_example(system, "grpc_client.py", "--image", str(image)).splitlines()
    assert out[0].startswith("prompt -> ") and "num_prompt_tokens=" in out[0]
    assert out[1].startswith("chat [")
    assert out[2].startswith("(length, ") or out[2].startswith("(stop, "), out


def test_the_async_example_runs_concurrent_and_streamed_calls(system):
    out = run_example(system, "grpc_client_async.py").splitlines()
    assert len(out) == 5, out
    assert all(" -> " in line and "tokens)" in line for line in out[:3])
    assert out[3].startswith("stream -> ")
    assert out[4].startswith("refused as expected: temperature: ")


def test_the_client_matches_the_http_api_and_needs_the_key(system):
    chat = [Message("user", [Image(image_bytes(40, 40, seed=6)), "What is shown here?"])]
    sampling = Sampling(temperature=0, max_new_tokens=8)
    with Client(f"127.0.0.1:{system.grpc_port}", api_key=API_KEY, timeout_s=TIMEOUT_S) as client:
        whole = client.generate(messages=chat, sampling=sampling, request_id="e2e-1")
        chunks = list(client.stream(messages=chat, sampling=sampling))
    assert whole.request_id == "e2e-1"
    assert whole.usage.num_completion_tokens == len(whole.token_ids) > 0
    assert "".join(c.text for c in chunks) == whole.text  # greedy: the same tokens again
    with Client(f"127.0.0.1:{system.grpc_port}", timeout_s=TIMEOUT_S) as client:
        with pytest.raises(UnauthenticatedError):
            client.generate("Once")


def test_reflection_lists_the_router_and_the_wheel_carries_its_proto(system):
    with grpc.insecure_channel(f"127.0.0.1:{system.grpc_port}") as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        key = (("authorization", f"Bearer {API_KEY}"),)  # reflection is behind the key too
        [reply] = stub.ServerReflectionInfo(iter([request]), timeout=TIMEOUT_S, metadata=key)
    names = {service.name for service in reply.list_services_response.service}
    assert "stageserve.v1.Router" in names
    assert (PROTO_ROOT / "stageserve" / "v1" / "router.proto").is_file()
