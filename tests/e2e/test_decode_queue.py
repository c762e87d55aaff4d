"""Requests that wait on decode for a place in its batch, longer than the router's stall
bound, are waiting, not stalled: with a decode batch of one and ``--stall-timeout-s 1``,
three concurrent requests run one after another and all finish."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest

from tests.e2e.system import start_system

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
BOUND_S = 300
STALL_S = 1.0
MAX_TOKENS = 600


def test_requests_behind_a_full_decode_batch_wait_past_the_stall_bound(tmp_path):
    system = start_system(
        tmp_path, "--max-running-requests", "1", "--stall-timeout-s", str(STALL_S)
    )
    try:
        model = httpx.get(f"{system.base_url}/models", timeout=10).json()["data"][0]["id"]

        def run(i: int) -> tuple[int, dict, float]:
            body = {
                "model": model,
                "messages": [{"role": "user", "content": f"Count, {i}."}],
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
            }
            started = time.monotonic()
            reply = httpx.post(f"{system.base_url}/chat/completions", json=body, timeout=BOUND_S)
            return reply.status_code, reply.json(), time.monotonic() - started

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            results = list(pool.map(run, range(3)))
        assert [status for status, _, _ in results] == [200] * 3, results
        assert [body["usage"]["completion_tokens"] for _, body, _ in results] == [MAX_TOKENS] * 3
        # one at a time: the last one waited behind the other two (about two runs) and
        # the waiting alone was longer than the stall bound
        elapsed = sorted(seconds for _, _, seconds in results)
        assert elapsed[2] - elapsed[0] > STALL_S, elapsed
        assert system.metric("router", "router_worker_stalls_total") == 0
    finally:
        assert system.stop() == 0
