"""SIGTERM to the decode process of a running system (``stageserve up``) during 8 long streams:
decode reports NOT_SERVING and admits no new request (the router answers it 503: no other
decode worker), every stream finishes normally, and decode exits with code 0."""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.e2e.system import start_system

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
BOUND_S = 120  # generous bound on every wait; a hang fails instead of stalling
NUM_STREAMS = 8
MAX_TOKENS = 600  # about a minute on 2 busy CPU cores, several seconds on an idle machine


def decode_health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(), timeout=10).status


def wait_until(predicate, what: str) -> None:
    deadline_mono = time.monotonic() + BOUND_S
    while not predicate():
        assert time.monotonic() < deadline_mono, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_sigterm_drains_decode_streams_finish_and_it_exits_0(tmp_path) -> None:
    system = start_system(tmp_path)
    try:
        client = openai.OpenAI(
            base_url=system.base_url, api_key="unused", max_retries=0, timeout=BOUND_S
        )
        model = client.models.list().data[0].id
        outcomes: list[str] = []
        num_chunks = [0] * NUM_STREAMS

        def stream_one(i: int) -> None:
            try:
                stream = client.completions.create(
                    model=model,
                    prompt=f"Count forever, {i}.",
                    max_tokens=MAX_TOKENS,
                    temperature=0,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                finish_reason = None
                for chunk in stream:
                    num_chunks[i] += 1
                    finish_reason = chunk.choices[0].finish_reason or finish_reason
                outcomes.append(f"finished: {finish_reason}")
            except (openai.APIError, httpx.HTTPError) as exc:
                outcomes.append(f"error: {type(exc).__name__}: {exc}")

        threads = [threading.Thread(target=stream_one, args=(i,)) for i in range(NUM_STREAMS)]
        for t in threads:
            t.start()
        wait_until(lambda: all(n >= 2 for n in num_chunks), "every stream to start")
        decode = dict(system.state["decode"])
        num_lines = len(system.output)
        os.kill(decode["pid"], signal.SIGTERM)
        serving = health_pb2.HealthCheckResponse.SERVING
        wait_until(lambda: decode_health(system.address("decode")) != serving, "NOT_SERVING")
        with pytest.raises(openai.APIStatusError) as refused:
            client.completions.create(model=model, prompt="Late.", max_tokens=4)
        assert refused.value.status_code == 503, refused.value
        assert not any(outcomes), outcomes  # the streams went on meanwhile
        for t in threads:
            t.join(timeout=BOUND_S)
        assert not any(t.is_alive() for t in threads), "a stream hung during the drain"
        assert outcomes == ["finished: length"] * NUM_STREAMS, outcomes
        system.wait_for_output("decode exited with code 0", num_lines, BOUND_S)
    finally:
        system.stop(timeout_s=BOUND_S)
