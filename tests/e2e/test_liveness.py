"""``stageserve up --router-workers 2`` with a small liveness bound: a stopped (SIGSTOP)
tokenizer worker process and a stopped router process are each killed and replaced within
the bound + 5 s, no request sent meanwhile hangs, and requests after the replacement
succeed."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from benchmarks.freeze_liveness import queue_reader, tokenizer_worker_pids
from tests.conftest import TINY_MODEL_DIR
from tests.e2e.system import pid_alive, start_system

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
LIVENESS_S = 3.0
REPLACED_S = LIVENESS_S + 5.0
STALL_S = 10.0  # the router's default per-hop stall bound
REQUEST_TIMEOUT_S = 60.0  # only bounds the test; a request must end well before
MODEL = TINY_MODEL_DIR.name  # the served model name: the model directory's


def chat(base_url: str, results: list[tuple[str, float]]) -> None:
    start = time.monotonic()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    try:
        reply = httpx.post(f"{base_url}/chat/completions", json=body, timeout=REQUEST_TIMEOUT_S)
        outcome = str(reply.status_code)
    except httpx.TransportError as exc:  # the stopped listener's connections are reset
        outcome = type(exc).__name__
    results.append((outcome, time.monotonic() - start))


def requests_until(base_url: str, done) -> list[tuple[str, float]]:
    """Requests every 0.2 s until ``done()``; each one's outcome and wait once all ended."""
    results: list[tuple[str, float]] = []
    threads = []
    deadline_mono = time.monotonic() + REPLACED_S + 30
    while not done() and time.monotonic() < deadline_mono:
        threads.append(threading.Thread(target=chat, args=(base_url, results)))
        threads[-1].start()
        time.sleep(0.2)
    for t in threads:
        t.join(REQUEST_TIMEOUT_S)
    assert not any(t.is_alive() for t in threads)
    return results


def test_stopped_tokenizer_worker_and_router_are_replaced(tmp_path):
    system = start_system(
        tmp_path, "--router-workers", "2", "--liveness-timeout-s", str(LIVENESS_S)
    )
    stopped: list[int] = []
    try:
        warm: list[tuple[str, float]] = []
        for _ in range(3):
            chat(system.base_url, warm)
        assert [outcome for outcome, _ in warm] == ["200"] * 3
        workers = tokenizer_worker_pids(system.state["tokenizer"]["pid"])
        assert len(workers) >= 2
        victim = queue_reader(workers)
        stopped.append(victim)
        os.kill(victim, signal.SIGSTOP)
        frozen_at = time.monotonic()
        during = requests_until(system.base_url, lambda: not pid_alive(victim))
        assert time.monotonic() - frozen_at < REPLACED_S
        assert all(wait_s < STALL_S + 5 for _, wait_s in during), during
        assert {outcome for outcome, _ in during} <= {"200", "503"}, during
        replaced = tokenizer_worker_pids(system.state["tokenizer"]["pid"])
        assert victim not in replaced and replaced

        router = system.state["router-2"]["pid"]
        num_lines = len(system.output)
        stopped.append(router)
        os.kill(router, signal.SIGSTOP)
        frozen_at = time.monotonic()
        during = requests_until(system.base_url, lambda: not pid_alive(router))
        line, killed_at = system.wait_for_output("answered no liveness check", num_lines, 60)
        assert line.startswith(f"router-2 (pid {router}) answered no liveness check"), line
        assert killed_at - frozen_at < REPLACED_S
        assert all(wait_s < STALL_S + 5 for _, wait_s in during), during
        system.wait_for_output("router-2 is ready again (pid", num_lines, 120)
        assert system.reload_state()["router-2"]["pid"] != router
        after: list[tuple[str, float]] = []
        for _ in range(8):
            chat(system.base_url, after)
        assert [outcome for outcome, _ in after] == ["200"] * 8
    finally:
        for pid in stopped:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        code = system.stop()
    assert code == 0
    assert not [pid for pid in system.child_pids() if pid_alive(pid)]
