"""A decode process killed mid-stream: requests end with an error in time, the router reports
the worker not ready, ``stageserve up`` restarts decode on its port and the system serves again,
and stopping the launcher leaves no process behind (the restarted one included)."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import openai
import pytest

from tests.e2e.system import endless_stream, openai_client, pid_alive, start_system

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
BOUND_S = 90  # generous bound on "promptly"; a hang would wait forever


def test_killed_decode_fails_streams_is_reported_and_restarted(tmp_path):
    system = start_system(tmp_path)
    num_services = len(
        [name for name in system.state if name != "launcher"]
    )  # routers: one per 8 CPUs
    try:
        client = openai_client(system, BOUND_S)
        model = client.models.list().data[0].id
        outcomes: list[str] = []
        started = threading.Barrier(5)

        def stream_one(i: int) -> None:
            try:
                messages = [{"role": "user", "content": f"Count forever, {i}."}]
                stream = endless_stream(client, model, messages, 3000)
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
        old = dict(system.state["decode"])
        num_lines = len(system.output)
        os.kill(old["pid"], signal.SIGKILL)
        # Down for at least the 0.5 s restart delay plus decode's start-up; the router
        # polls every 1 s, so /health names decode as missing in between.
        health = httpx.get(f"http://127.0.0.1:{system.http_port}/health", timeout=10)
        deadline_mono = time.monotonic() + BOUND_S
        while health.status_code == 200 and time.monotonic() < deadline_mono:
            time.sleep(0.1)
            health = httpx.get(f"http://127.0.0.1:{system.http_port}/health", timeout=10)
        assert health.status_code == 503
        assert "decode" in health.text
        for t in threads:
            t.join(timeout=BOUND_S)
        assert not any(t.is_alive() for t in threads), "a request hung after its decode died"
        assert len(outcomes) == 4 and all(o.startswith("error") for o in outcomes), outcomes

        line, _ = system.wait_for_output(
            "decode exited with code -9; restarting in", num_lines, BOUND_S
        )
        assert line.endswith("(restart 1)"), line
        system.wait_for_output("decode is ready again (pid", num_lines, BOUND_S)
        new = system.reload_state()["decode"]
        assert new["pid"] != old["pid"] and pid_alive(new["pid"])
        assert (new["port"], new["metrics_port"]) == (old["port"], old["metrics_port"])
        deadline_mono = time.monotonic() + BOUND_S
        while system.health() != 200 and time.monotonic() < deadline_mono:
            time.sleep(0.2)
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
        )
        assert reply.choices[0].finish_reason in ("stop", "length")
    finally:
        code = system.stop()
    assert code == 0
    assert len(system.child_pids()) == num_services + 1  # the services and the restarted decode
    assert not [pid for pid in system.child_pids() if pid_alive(pid)]
