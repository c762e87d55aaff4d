"""A randomized soak of the CP service (C = 2): health-check-shaped one-token requests, live
requests (text and images, repeated so the prefix cache hits and evicts), callers that give
up or cancel mid-flight, and rank-local state that differs by rank (each rank's fake drain
queue). Every step, every rank's digest of the plan it ran is all-gathered and equal to the
leader's, and every rank holds exactly the cached pages the leader's index says; every
request ends; nothing hangs.
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest
import torch

from services.common.errors import StageServeError
from services.common.types import SamplingParams
from services.prefill.messages import RankPlan
from tests.conftest import image_bytes
from tests.prefill.conftest import PAGE_SIZE, make_case, prefill_config, start_harness, stop_harness

pytestmark = pytest.mark.slow
MIN_STEPS = 500
SOAK_TIMEOUT_S = 600.0


@pytest.mark.parametrize("host_pages", [0, 48], ids=["device_only", "host_tier"])
async def test_plans_agree_on_every_rank_at_every_step(
    pipeline, language_model, host_pages
) -> None:
    config = prefill_config(
        devices=("cpu", "cpu"),
        max_batch_tokens=256,
        num_pages=96,
        host_cache_gb=(host_pages + 0.5) * host_page_bytes(language_model) / 1e9
        if host_pages
        else 0,
    )
    h = await start_harness(pipeline, language_model, config)
    steps: list[tuple[bytes, list]] = []
    step = h.leader.ranks.step

    index = h.scheduler.prefix
    held: list[list[frozenset[bytes]]] = []  # the leader's view of each rank's cache, per step
    host_held: list[list[frozenset[bytes]]] = []  # and of each rank's host tier
    drops: list[int] = []  # pages the ranks dropped before each step (evicted or forgotten)
    loads: list[int] = []  # pages the ranks copied back from their host tier

    async def recording(payload, *args):
        results = await step(payload, *args)
        if isinstance(payload, RankPlan):
            steps.append((payload.digest(), results))
            held.append([index.held(rank) for rank in range(2)])
            host_held.append([index.host_held(rank) for rank in range(2)])
            drops.append(sum(len(m.drop) for m in payload.moves))
            loads.append(sum(len(m.load) for m in payload.moves))
        return results

    h.leader.ranks.step = recording
    rng = random.Random(13)
    greedy = SamplingParams(temperature=0.0)
    shapes = [
        (
            "health",
            lambda i: make_case(
                pipeline, f"health-{i}", "Hi", [], SamplingParams(max_new_tokens=1)
            ),
        ),
        (
            "text",
            lambda i: make_case(
                pipeline,
                f"live-{i}",
                f"Boat {rng.randint(0, 15)}. " + "Say something about boats. " * rng.randint(1, 4),
                [],
                greedy,
            ),
        ),
        (
            "image",
            lambda i: make_case(
                pipeline, f"img-{i}", "What is it?", [image_bytes(60, 60, seed=i % 3)], greedy
            ),
        ),
    ]
    outcomes = {"ok": 0, "error": 0, "cancelled": 0}

    async def prefill(case, deadline_in_s: float = 30.0):
        dst = h.decode.reserve(case.request.request_id, len(case.prompt.token_ids), 0)
        try:
            return await h.client.prefill(
                case.request.request_id,
                case.prompt,
                case.request.params,
                h.decode.kv_ref(dst),
                time.time() + deadline_in_s,
            )
        finally:
            h.decode.pages.free(list(dst.page_ids))

    async def one(i: int) -> None:
        kind, make = rng.choices(shapes, weights=(3, 6, 1))[0]
        case = make(i)
        give_up = rng.random()
        try:
            if give_up < 0.1:  # the caller cancels mid-flight
                task = asyncio.create_task(prefill(case))
                await asyncio.sleep(rng.uniform(0.0, 0.05))
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                outcomes["cancelled"] += 1
                return
            timeout_s = (
                rng.uniform(0.02, 0.2) if give_up < 0.2 else 30.0
            )  # some pass their deadline
            await prefill(case, timeout_s)
            outcomes["ok"] += 1
        except StageServeError:
            outcomes["error"] += 1

    try:
        async with asyncio.timeout(SOAK_TIMEOUT_S):  # zero hangs
            i = 0
            while len(steps) < MIN_STEPS:
                await asyncio.gather(*(one(i + k) for k in range(rng.randint(1, 6))))
                i += 6
        async with asyncio.timeout(30):
            while h.scheduler.num_live:
                await asyncio.sleep(0.01)
        h.assert_all_free()
    finally:
        await stop_harness(h)
    drains = set()
    num_pages = 96
    num_hits = 0
    for (digest, results), leader_view, host_view in zip(steps, held, host_held, strict=True):
        failed = any(r.peer_failed for r in results)
        for r, keys, host_keys in zip(results, leader_view, host_view, strict=True):
            # no page leaks; the leader never counts on a page a rank lacks, and after a step
            # that ran (no peer failed mid-pass) they agree exactly
            assert r.num_free_pages + len(r.cached_keys) == num_pages
            assert r.cached_keys <= keys if failed else r.cached_keys == keys
            assert r.host_keys == host_keys and len(host_keys) <= host_pages
            assert not r.host_keys & r.cached_keys  # a page is in one tier at a time
        num_hits += len(results[0].cached_keys) > 0
        assert [r.rank for r in results] == [0, 1]
        for r in results:
            assert r.digests == (
                digest,
                digest,
            )  # all-gathered on the ranks, equal to what was sent
        drains.add(tuple(r.drain_len for r in results))
    assert any(a != b for a, b in drains)  # the ranks' local state did differ
    assert outcomes["ok"] > MIN_STEPS // 2 and outcomes["error"] + outcomes["cancelled"] > 0, (
        outcomes
    )
    assert num_hits > MIN_STEPS // 2  # the cache held pages through most of the soak
    assert sum(d > 0 for d in drops) > 10, drops  # and evicted many times
    if host_pages:  # evicted pages went to the host tier and came back from it
        assert sum(n > 0 for n in loads) > 10, loads
        assert max(len(k) for view in host_held for k in view) == host_pages
    else:
        assert not any(loads)


def host_page_bytes(model) -> int:
    """Bytes of one KV page (K and V of every layer) of ``model``'s pool on the CPU."""
    text = model.config.text
    element = torch.empty((), dtype=next(model.parameters()).dtype).element_size()
    return (
        2 * text.num_hidden_layers * PAGE_SIZE * text.num_key_value_heads * text.head_dim * element
    )
