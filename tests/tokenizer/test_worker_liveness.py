"""A tokenizer worker process that stops (SIGSTOP) is killed and the pool rebuilt within its
liveness bound; every job sent meanwhile ends with a prompt or ``UnavailableError``."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from services.common.errors import UnavailableError
from services.tokenizer.workers import PromptJob, WorkerPool
from tests.conftest import TINY_MODEL_DIR
from tests.e2e.system import pid_alive
from tests.tokenizer.conftest import TEST_LIMITS

pytestmark = pytest.mark.integration
LIVENESS_S = 2.0
BOUND_S = LIVENESS_S + 5.0
JOB_TIMEOUT_S = 30.0  # a hung job would wait forever; this only bounds the test


def worker_pids(pool: WorkerPool) -> set[int]:
    return {slot.pid for slot in pool._beats if slot.pid}


async def wait_for(condition, timeout_s: float) -> None:
    deadline_mono = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline_mono, "timed out"
        await asyncio.sleep(0.05)


async def one_job(pool: WorkerPool, i: int) -> str:
    try:
        prompt = await asyncio.wait_for(pool.run(PromptJob(f"hello {i}")), JOB_TIMEOUT_S)
    except UnavailableError as exc:
        assert "worker process died" in exc.message
        return "unavailable"
    assert prompt.token_ids
    return "ok"


async def test_a_stopped_worker_is_killed_and_replaced_and_no_job_hangs():
    pool = WorkerPool(TINY_MODEL_DIR, TEST_LIMITS, num_workers=2, liveness_timeout_s=LIVENESS_S)
    await pool.start()
    first = worker_pids(pool)
    assert len(first) == 2
    victim, seen = min(first), set(first)
    try:
        os.kill(victim, signal.SIGSTOP)
        stopped_at = time.monotonic()
        jobs = []
        while pid_alive(victim) and time.monotonic() - stopped_at < BOUND_S:
            jobs.append(asyncio.ensure_future(one_job(pool, len(jobs))))
            await asyncio.sleep(0.1)
        assert not pid_alive(victim), f"not killed {BOUND_S} s after SIGSTOP"
        await wait_for(lambda: len(worker_pids(pool)) == 2, BOUND_S)
        seen |= worker_pids(pool)
        assert time.monotonic() - stopped_at < BOUND_S + 5.0
        assert not worker_pids(pool) & first
        outcomes = await asyncio.gather(*jobs)  # each ends: none waits for the frozen worker
        assert set(outcomes) <= {"ok", "unavailable"} and outcomes, outcomes
        assert [await one_job(pool, i) for i in range(4)] == ["ok"] * 4
    finally:
        if pid_alive(victim):
            os.kill(victim, signal.SIGKILL)
        pool.close()
    await wait_for(lambda: not [pid for pid in seen if pid_alive(pid)], BOUND_S)
