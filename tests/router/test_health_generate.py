"""Health-check generate: an idle worker runs a tiny generate through tokenizer, prefill and
decode, pinned to it; completed live traffic counts instead; a failed or timed-out generate
ejects the worker (no request is routed to it) until one passes."""

from __future__ import annotations

import asyncio

import pytest

from services.common.errors import UnavailableError
from services.router.health_generate import HEALTH_ID_PREFIX
from tests.router.conftest import (
    router_config,
    start_cluster,
    start_router,
    stop_router,
    wait_until,
)
from tests.router.fakes import Script

INTERVAL_S = 0.3


def health_ids(worker) -> list[str]:
    return [
        r.request_id for r in worker.servicer.requests if r.request_id.startswith(HEALTH_ID_PREFIX)
    ]


@pytest.fixture
async def two_prefills():
    cluster = await start_cluster(Script(), num_prefills=2)
    yield cluster
    await cluster.stop()


async def test_an_idle_worker_runs_a_generate_pinned_to_it(two_prefills) -> None:
    cluster = two_prefills
    app = await start_router(
        router_config(cluster, health_generate_interval_s=INTERVAL_S, health_generate_timeout_s=5.0)
    )
    try:
        await wait_until(
            lambda: all(health_ids(p) for p in cluster.prefills)
        )  # each prefill its own
        assert health_ids(cluster.tokenizer) and cluster.decode.reserved
        assert all(w.is_ready for w in app.registry.workers())
    finally:
        await stop_router(app)


async def test_live_traffic_counts_instead(two_prefills) -> None:
    cluster = two_prefills
    app = await start_router(
        router_config(cluster, health_generate_interval_s=INTERVAL_S, health_generate_timeout_s=5.0)
    )
    try:
        for _ in range(12):  # requests complete on every worker more often than the interval
            reply = await _complete(app)
            assert reply
            await asyncio.sleep(INTERVAL_S / 4)
        assert not any(health_ids(p) for p in cluster.prefills)
    finally:
        await stop_router(app)


async def test_a_failing_generate_ejects_the_worker_until_one_passes(two_prefills) -> None:
    cluster = two_prefills
    broken = cluster.prefills[1]
    broken.servicer.error = UnavailableError("fake prefill: its ranks are wedged")
    app = await start_router(
        router_config(cluster, health_generate_interval_s=INTERVAL_S, health_generate_timeout_s=1.0)
    )
    try:
        worker = next(w for w in app.registry.workers() if w.address == broken.address)
        await wait_until(lambda: bool(worker.generate_error))
        assert "wedged" in worker.generate_error and not worker.is_ready
        before = len(broken.servicer.requests)
        for _ in range(4):  # live requests go to the healthy prefill only
            assert await _complete(app)
        assert [
            r
            for r in broken.servicer.requests[before:]
            if not r.request_id.startswith(HEALTH_ID_PREFIX)
        ] == []
        broken.servicer.error = None
        await wait_until(lambda: worker.is_ready)  # the next generate passes: readmitted
        broken.servicer.hang = True  # a generate that times out ejects as well
        await wait_until(lambda: not worker.is_ready, timeout_s=10)
        broken.servicer.hang = False
        await wait_until(lambda: worker.is_ready, timeout_s=10)
    finally:
        await stop_router(app)


async def test_two_kinds_ejected_at_once_clear_each_other() -> None:
    """Decode and the tokenizer both ejected (one worker each), both serving again: each one's
    generate goes through the other (ejected, but answering its health check) and passes, so
    both come back, instead of each failing for lack of the other for good."""
    cluster = await start_cluster(Script())
    app = await start_router(
        router_config(cluster, health_generate_interval_s=INTERVAL_S, health_generate_timeout_s=5.0)
    )
    try:
        workers = {w.kind.value: w for w in app.registry.workers()}
        for kind in ("decode", "tokenizer"):
            app.registry.record_generate(workers[kind], f"{kind} was wedged")
        assert not app.registry.is_ready
        await wait_until(lambda: app.registry.is_ready, timeout_s=10)
        assert all(w.is_ready for w in workers.values())
    finally:
        await stop_router(app)
        await cluster.stop()


async def test_a_generate_that_finds_another_kind_down_blames_nobody() -> None:
    """Decode not serving: the tokenizer's and prefill's generates cannot run, and neither is
    ejected for it; once decode serves again, everything is ready without another round."""
    cluster = await start_cluster(Script())
    app = await start_router(
        router_config(cluster, health_generate_interval_s=INTERVAL_S, health_generate_timeout_s=5.0)
    )
    try:
        cluster.decodes[0].health.set_serving(False)
        await wait_until(lambda: not app.registry.is_ready)
        rounds = len(health_ids(cluster.tokenizer))
        await wait_until(lambda: len(health_ids(cluster.tokenizer)) > rounds + 1, timeout_s=10)
        assert not any(w.generate_error for w in app.registry.workers())
        cluster.decodes[0].health.set_serving(True)
        await wait_until(lambda: app.registry.is_ready, timeout_s=10)
    finally:
        await stop_router(app)
        await cluster.stop()


async def _complete(app) -> bool:
    from services.router.types import GenerationRequest

    request = GenerationRequest(
        f"live-{id(app)}-{asyncio.get_running_loop().time()}", prompt="hi", max_tokens=3
    )
    last = None
    async for delta in app.pipeline.stream(request):
        last = delta
    return last is not None and last.finish_reason is not None


def test_flags() -> None:
    from services.router.__main__ import build_parser, config_from_args

    base = ["--tokenizer-address", "a:1", "--prefill-address", "b:1", "--decode-address", "c:1"]
    cfg = config_from_args(build_parser().parse_args(base))
    assert (cfg.health_generate_interval_s, cfg.health_generate_timeout_s) == (30.0, 30.0)
    cfg = config_from_args(
        build_parser().parse_args(
            [*base, "--health-generate-interval-s", "0", "--health-generate-timeout-s", "5"]
        )
    )
    assert (cfg.health_generate_interval_s, cfg.health_generate_timeout_s) == (0.0, 5.0)
    for argv in (["--health-generate-interval-s", "-1"], ["--health-generate-timeout-s", "0"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args([*base, *argv])
