"""Worker discovery in one process: ``dns:///`` addresses parse and resolve, and a refresh
adds, checks, retires and forgets workers in the registry (fake workers over real gRPC)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import grpc
import pytest
from prometheus_client import CollectorRegistry

from services.common.types import SamplingParams
from services.router import discovery
from services.router.__main__ import build_parser, config_from_args
from services.router.app import make_worker
from services.router.config import WorkerAddresses
from services.router.discovery import SystemResolver, WorkerDiscovery
from services.router.health_probe import HealthProbe
from services.router.metrics import RouterMetrics
from services.router.policy import RoundRobinPolicy
from services.router.registry import WorkerRegistry
from services.router.workers import DnsName, WorkerKind, parse_dns_name
from tests.conftest import TINY_MODEL_DIR
from tests.router.fake_decode import FakeDecode
from tests.router.fakes import FakeWorker, Script, start_worker
from tests.router.membership import DECODE_NAME, DECODE_TARGET, ScriptedResolver

STATIC = "127.0.0.1:1"  # never answers: a static worker stays a member though not ready


def test_dns_addresses_parse_and_plain_ones_are_static():
    assert parse_dns_name("decode-0:50051") is None
    assert parse_dns_name("dns:///decode.ns.svc:50051") == DnsName("decode.ns.svc", 50051)
    assert parse_dns_name("dns:///[::1]:7") == DnsName("::1", 7)
    assert str(DnsName("decode", 50051)) == "dns:///decode:50051"


@pytest.mark.parametrize(
    "address", ["dns://decode:1", "dns:///decode", "dns:///decode:0", "dns:///:1", "dns:///a/b:1"]
)
def test_a_malformed_dns_address_is_refused_at_start(address, capsys):
    with pytest.raises(ValueError, match="dns:///HOST:PORT|port must be"):
        WorkerAddresses(decode=(address,))
    argv = ["--model", str(TINY_MODEL_DIR), "--decode-address", address]
    with pytest.raises(SystemExit, match="worker address"):
        config_from_args(build_parser().parse_args(argv))


def test_discovery_flags_reach_the_config():
    argv = ["--model", str(TINY_MODEL_DIR), "--decode-address", f"{STATIC},{DECODE_TARGET}"]
    cfg = config_from_args(build_parser().parse_args([*argv, "--discovery-interval-s", "2.5"]))
    assert cfg.workers.decode == (STATIC, DECODE_TARGET)
    assert cfg.workers.discovery_interval_s == 2.5
    with pytest.raises(SystemExit):
        build_parser().parse_args([*argv, "--discovery-interval-s", "0"])


async def test_the_system_resolver_answers_each_address_at_the_port():
    answer = await SystemResolver().resolve(DnsName("localhost", 4321))
    assert "127.0.0.1:4321" in answer
    assert all(a.endswith(":4321") for a in answer)


@pytest.mark.parametrize(
    ("errno", "outcome"), [(socket.EAI_NONAME, ()), (socket.EAI_AGAIN, socket.gaierror)]
)
async def test_a_name_without_address_answers_none_and_a_failure_raises(errno, outcome):
    loop = asyncio.get_running_loop()

    async def failing(*args, **kwargs):
        raise socket.gaierror(errno, "test")

    loop.getaddrinfo = failing  # type: ignore[method-assign]
    try:
        if outcome == ():
            assert await SystemResolver().resolve(DnsName("gone", 1)) == ()
        else:
            with pytest.raises(outcome):
                await SystemResolver().resolve(DnsName("flaky", 1))
    finally:
        del loop.getaddrinfo


@pytest.fixture
async def decodes() -> AsyncIterator[list[FakeWorker]]:
    workers = [await start_worker(FakeDecode(Script())) for _ in range(2)]
    yield workers
    for worker in workers:
        await worker.server.stop(None)


def discovery_over(resolver: ScriptedResolver, grace_s: float = 0.0):
    addresses = {WorkerKind.DECODE: (STATIC, DECODE_TARGET)}
    registry = WorkerRegistry(
        [make_worker(WorkerKind.DECODE, STATIC)],
        RoundRobinPolicy(),
        RouterMetrics(CollectorRegistry()),
        HealthProbe(1.0),
    )
    found = WorkerDiscovery(registry, addresses, make_worker, resolver, 1.0, grace_s)
    return registry, found


def members(registry: WorkerRegistry) -> dict[str, str]:
    return {
        w.address: "leaving" if w.is_leaving else w.state.value
        for w in registry.workers(WorkerKind.DECODE)
    }


async def test_a_refresh_admits_only_workers_whose_check_passes(decodes):
    resolver = ScriptedResolver()
    registry, found = discovery_over(resolver)
    up, down = decodes
    down.health.set_serving(False)
    resolver.answers[DECODE_NAME] = (up.address, down.address)
    try:
        await found.refresh()  # no health poller runs: the refresh checks the new ones itself
        assert members(registry) == {
            STATIC: "unknown",
            up.address: "ready",
            down.address: "not_ready",
        }
        assert [w.address for w in registry.ready_workers(WorkerKind.DECODE)] == [up.address]
        assert found.num_refreshes == 1
    finally:
        await registry.close()


async def test_a_leaving_worker_keeps_its_requests_and_is_forgotten_once_idle(decodes):
    resolver = ScriptedResolver()
    registry, found = discovery_over(resolver)
    up, other = decodes
    resolver.answers[DECODE_NAME] = (up.address, other.address)
    try:
        await found.refresh()
        held = registry.acquire(WorkerKind.DECODE)
        resolver.answers[DECODE_NAME] = tuple(
            a for a in (up.address, other.address) if a != held.address
        )
        await found.refresh()
        assert members(registry)[held.address] == "leaving"
        assert not held.is_ready and held.num_in_flight == 1
        for _ in range(3):  # nothing new goes to it
            worker = registry.acquire(WorkerKind.DECODE)
            assert worker is not held
            registry.release(worker)
        await found.refresh()
        assert held.address in members(registry)  # still holds a request
        registry.release(held)
        await found.refresh()
        assert held.address not in members(registry)
        with pytest.raises(grpc.aio.UsageError, match="closed"):  # its client was closed
            await held.client.reserve("r", [1], 0, SamplingParams(), 1e12)
        resolver.answers[DECODE_NAME] = (up.address, other.address)
        await found.refresh()
        assert members(registry)[held.address] == "ready"  # a new worker at the address
    finally:
        await registry.close()


async def test_a_worker_answered_again_before_it_is_forgotten_joins_again(decodes):
    resolver = ScriptedResolver()
    registry, found = discovery_over(resolver, grace_s=3600.0)
    up, _ = decodes
    resolver.answers[DECODE_NAME] = (up.address,)
    try:
        await found.refresh()
        (worker,) = registry.ready_workers(WorkerKind.DECODE)
        resolver.answers[DECODE_NAME] = ()
        await found.refresh()
        assert members(registry)[up.address] == "leaving"  # idle, but within its grace
        resolver.answers[DECODE_NAME] = (up.address,)
        await found.refresh()
        assert registry.ready_workers(WorkerKind.DECODE) == [worker]
    finally:
        await registry.close()


async def test_a_failed_or_slow_resolution_keeps_the_last_answer(decodes, monkeypatch):
    resolver = ScriptedResolver()
    registry, found = discovery_over(resolver)
    up, _ = decodes
    resolver.answers[DECODE_NAME] = (up.address,)
    try:
        await found.refresh()
        resolver.error = OSError("no DNS server")
        await found.refresh()
        assert members(registry)[up.address] == "ready"
        resolver.error = None
        monkeypatch.setattr(discovery, "RESOLVE_TIMEOUT_S", 0.05)
        monkeypatch.setattr(resolver, "resolve", _never_answers)
        await found.refresh()
        assert members(registry)[up.address] == "ready"
    finally:
        await registry.close()


async def _never_answers(name: DnsName) -> tuple[str, ...]:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")
