"""Worker registry: health polling (eject, readmit), routing policies, no-worker errors."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from prometheus_client import CollectorRegistry

from services.common.errors import UnavailableError
from services.common.healthcheck import HealthAnswer
from services.router.config import PolicyName
from services.router.health_probe import HealthProbe
from services.router.metrics import RouterMetrics
from services.router.policy import LeastLoadPolicy, RoundRobinPolicy
from services.router.registry import WorkerRegistry
from services.router.workers import Worker, WorkerKind, WorkerState
from tests.router.conftest import (
    MODEL_NAME,
    asgi_client,
    router_config,
    start_cluster,
    start_router,
    stop_router,
    wait_until,
)

CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]}


def ready(kind: WorkerKind, address: str, in_flight: int = 0) -> Worker:
    return Worker(kind, address, state=WorkerState.READY, num_in_flight=in_flight)


def registry_of(workers, policy) -> WorkerRegistry:
    return WorkerRegistry(workers, policy, RouterMetrics(CollectorRegistry()), HealthProbe(1.0))


def test_round_robin_cycles_through_ready_workers():
    workers = [ready(WorkerKind.DECODE, f"d{i}") for i in range(3)]
    workers[1].state = WorkerState.NOT_READY
    registry = registry_of(workers, RoundRobinPolicy())
    chosen = []
    for _ in range(4):
        worker = registry.acquire(WorkerKind.DECODE)
        chosen.append(worker.address)
        registry.release(worker)
    assert chosen == ["d0", "d2", "d0", "d2"]


def test_least_load_prefers_the_idlest_worker():
    workers = [
        ready(WorkerKind.PREFILL, "p0", 2),
        ready(WorkerKind.PREFILL, "p1", 0),
        ready(WorkerKind.PREFILL, "p2", 1),
    ]
    registry = registry_of(workers, LeastLoadPolicy())
    first = registry.acquire(WorkerKind.PREFILL)
    second = registry.acquire(WorkerKind.PREFILL)
    assert first.address == "p1"  # the only idle one
    assert second.address in ("p1", "p2")  # now tied at one request each
    assert sorted(w.num_in_flight for w in workers[1:]) == [1, 2]
    registry.release(first)
    registry.release(second)
    assert [w.num_in_flight for w in workers] == [2, 0, 1]


def test_no_ready_worker_raises_unavailable():
    registry = registry_of(
        [Worker(WorkerKind.DECODE, "d0")], RoundRobinPolicy()
    )  # never polled: not ready
    with pytest.raises(UnavailableError, match="no ready decode worker"):
        registry.acquire(WorkerKind.DECODE)
    assert registry.missing_kinds() == [WorkerKind.TOKENIZER, WorkerKind.PREFILL, WorkerKind.DECODE]


async def test_poll_ejects_and_readmits(script):
    cluster = await start_cluster(script, num_decodes=2)
    app = await start_router(router_config(cluster))
    try:
        registry = app.registry
        assert registry.is_ready and app.health.is_serving
        cluster.decodes[0].health.set_serving(False)
        await wait_until(lambda: len(registry.ready_workers(WorkerKind.DECODE)) == 1)
        assert registry.is_ready  # one decode is enough
        cluster.decodes[1].health.set_serving(False)
        await wait_until(lambda: not registry.is_ready)
        assert not app.health.is_serving  # the router's own gRPC health follows
        cluster.decodes[0].health.set_serving(True)
        await wait_until(lambda: registry.is_ready)
        assert app.health.is_serving
        assert [w.address for w in registry.ready_workers(WorkerKind.DECODE)] == [
            cluster.decodes[0].address
        ]
    finally:
        await stop_router(app)
        await cluster.stop()


class ScriptedProbe(HealthProbe):
    """Answers each worker's checks from a script: None passes, "timeout" times out, any other
    string is a NOT_SERVING answer."""

    def __init__(self, answers: dict[str, list[str | None]]) -> None:
        super().__init__(1.0)
        self.answers = answers

    async def check(self, address: str) -> HealthAnswer:
        answer = self.answers[address].pop(0)
        if answer is None:
            return HealthAnswer("SERVING")
        if answer == "timeout":
            return HealthAnswer(None, grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        return HealthAnswer("NOT_SERVING")


async def test_a_flapping_worker_gets_no_traffic_until_it_passes_twice_in_a_row():
    workers = [Worker(WorkerKind.DECODE, a) for a in ("steady", "flaky")]
    flaps = [None, "down", None, "down", None, "down", None, None, None]
    probe = ScriptedProbe({"steady": [None] * len(flaps), "flaky": list(flaps)})
    registry = WorkerRegistry(
        workers, RoundRobinPolicy(), RouterMetrics(CollectorRegistry()), probe, readmit_passes=2
    )
    routable = []
    for _ in flaps:
        await registry.poll_once()
        routable.append([w.address for w in registry.ready_workers(WorkerKind.DECODE)])
    flaky_ready = ["flaky" in r for r in routable]
    # admitted at its first pass (never ready before), then ejected by each failure and
    # readmitted only by the second of two passes in a row
    assert flaky_ready == [True, False, False, False, False, False, False, True, True]
    assert all("steady" in r for r in routable)


async def test_a_ready_worker_is_ejected_by_three_timeouts_in_a_row_or_one_refusal():
    workers = [Worker(WorkerKind.DECODE, a) for a in ("slow", "down")]
    slow = [None, "timeout", "timeout", None, "timeout", "timeout", "timeout", None, None]
    down = [None, None, "down", None, None, "timeout", "timeout", "timeout", None]
    probe = ScriptedProbe({"slow": list(slow), "down": list(down)})
    registry = WorkerRegistry(
        workers,
        RoundRobinPolicy(),
        RouterMetrics(CollectorRegistry()),
        probe,
        readmit_passes=2,
        eject_timeouts=3,
    )
    routable = []
    for _ in slow:
        await registry.poll_once()
        routable.append(sorted(w.address for w in registry.ready_workers(WorkerKind.DECODE)))
    # "slow": timeouts keep it until the third in a row ejects it; two passes readmit it.
    # "down": a NOT_SERVING answer ejects it at once; readmitted, three timeouts eject it.
    assert [("slow" in r, "down" in r) for r in routable] == [
        (True, True),
        (True, True),
        (True, False),
        (True, False),
        (True, True),
        (True, True),
        (False, True),
        (False, False),
        (True, False),
    ]


async def run_chats(app, num: int) -> None:
    async with asgi_client(app) as http:
        replies = await asyncio.gather(
            *(http.post("/v1/chat/completions", json=CHAT) for _ in range(num))
        )
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]


async def test_round_robin_spreads_requests_over_workers(script):
    cluster = await start_cluster(script, num_prefills=2, num_decodes=2)
    app = await start_router(router_config(cluster, policy=PolicyName.ROUND_ROBIN))
    try:
        await run_chats(app, 4)
        assert [len(w.servicer.reserved) for w in cluster.decodes] == [2, 2]
        assert [len(w.servicer.requests) for w in cluster.prefills] == [2, 2]
    finally:
        await stop_router(app)
        await cluster.stop()


async def test_least_load_avoids_the_busy_worker(script):
    cluster = await start_cluster(script, num_decodes=2)
    app = await start_router(router_config(cluster, policy=PolicyName.LEAST_LOAD))
    try:
        busy = app.registry.ready_workers(WorkerKind.DECODE)[0]
        busy.num_in_flight += 5  # as if five long requests were running there
        await run_chats(app, 3)
        counts = {w.address: len(w.servicer.reserved) for w in cluster.decodes}
        assert counts[busy.address] == 0 and sum(counts.values()) == 3
        busy.num_in_flight -= 5
        assert all(w.num_in_flight == 0 for w in app.registry.workers())  # every lease was released
    finally:
        await stop_router(app)
        await cluster.stop()
