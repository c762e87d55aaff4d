"""A decode process killed mid-stream: requests end with an error in time, the router
reports the worker not ready, and stopping the launcher leaves no process behind."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import openai
import pytest

from tests.e2e.system import pid_alive, start_system

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
BOUND_S = 90  # generous bound on "promptly"; a hang would wait forever


def test_killed_decode_fails_streams_and_is_reported(tmp_path):
    system = start_system(tmp_path)
    try:
        client = openai.OpenAI(base_url=system.base_url, api_key="unused", max_retries=0, timeout=BOUND_S)
        model = client.models.list().data[0].id
        outcomes: list[str] = []
        started = threading.Barrier(5)

        def stream_one(i: int) -> None:
            try:
                stream = client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": f"Count forever, {i}."}],
                    max_tokens=3000, temperature=0, stream=True, extra_body={"ignore_eos": True},
                )
                for n, _ in enumerate(stream):
                    if n == 2:
                        started.wait(timeout=BOUND_S)
                outcomes.append("finished")
            except (openai.APIError, httpx.HTTPError) as exc:
                outcomes.append(f"error: {type(exc).__name__}")

        threads = [threading.Thread(target=stream_one, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        started.wait(timeout=BOUND_S)
        os.kill(system.state["decode"]["pid"], signal.SIGKILL)
        for t in threads:
            t.join(timeout=BOUND_S)
        assert not any(t.is_alive() for t in threads), "a request hung after its decode died"
        assert len(outcomes) == 4 and all(o.startswith("error") for o in outcomes), outcomes

        deadline = time.monotonic() + BOUND_S
        health = httpx.get(f"http://127.0.0.1:{system.http_port}/health", timeout=10)
        while health.status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.5)
            health = httpx.get(f"http://127.0.0.1:{system.http_port}/health", timeout=10)
        assert health.status_code == 503
        assert "decode" in health.text

        with pytest.raises(openai.APIStatusError) as info:
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert info.value.status_code == 503
    finally:
        code = system.stop()
    assert code == 0
    assert not [pid for pid in system.child_pids() if pid_alive(pid)]
