"""The prefix cache's shared KV store between two prefill workers (real rank processes, a
real ``mooncake_master``): a prompt one worker computed is read by the other (its KV bit for
bit the first worker's, its first token the offline engine's); with the master killed, both
keep serving (the tier is skipped and counted), and nothing hangs."""

from __future__ import annotations

import asyncio
import os
import signal
import socket

import pytest
import torch

from services.common.types import SamplingParams
from services.prefill import kv_store_master, metrics
from tests.conftest import image_bytes
from tests.prefill.conftest import (
    KV_ATOL,
    PAGE_SIZE,
    make_case,
    prefill_config,
    reference,
    start_harness,
    stop_harness,
)
from tests.prefill.test_prefix_cache_service import decode_kv

pytestmark = pytest.mark.slow
pytest.importorskip("mooncake.store")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def failures(op: str) -> float:
    return metrics.PREFIX_CACHE_STORE_FAILURES.labels(op)._value.get()


async def test_a_prompt_one_worker_computed_is_read_by_another(
    pipeline, language_model, tmp_path
) -> None:
    port = free_port()
    master = kv_store_master.start_master(port, log_path=tmp_path / "master.log")
    greedy = SamplingParams(temperature=0.0)
    text = "Write the harbour master's report on the storm. " * 5
    case = make_case(pipeline, "report", text, [image_bytes(80, 64, seed=5)], greedy)
    n = len(case.prompt.token_ids)
    ref = reference(pipeline, case)
    config = prefill_config(
        devices=("cpu",), kv_store_master=f"127.0.0.1:{port}", kv_store_segment_gb=0.064
    )
    first = second = None
    try:
        first = await start_harness(pipeline, language_model, config)
        second = await start_harness(pipeline, language_model, config)
        assert first.scheduler.prefix.has_store and second.scheduler.prefix.has_store
        a, dst = await first.prefill(case)
        assert a.num_prefix_cached_tokens == 0 and a.first_token_id == ref.first_token_id
        k1, v1 = decode_kv(first, dst, n)
        first.decode.pages.free(list(dst.page_ids))
        expected = (n - 1) // PAGE_SIZE  # every full page but the last token's
        keys = _page_keys(case)[:expected]
        for _ in range(100):  # the first worker's rank writes in the background
            if await second.leader.store.leading(keys) == expected:
                break
            await asyncio.sleep(0.1)
        else:
            pytest.fail("the first worker's pages never reached the store")
        b, dst = await second.prefill(case)
        k2, v2 = decode_kv(second, dst, n)
        second.decode.pages.free(list(dst.page_ids))
        cached = expected * PAGE_SIZE
        assert b.num_prefix_cached_tokens == cached
        assert b.num_prefix_cached_image_tokens == case.request.spans[0].length
        assert b.first_token_id == ref.first_token_id
        assert torch.equal(k2[:, :cached], k1[:, :cached])
        assert torch.equal(v2[:, :cached], v1[:, :cached])
        assert torch.allclose(k2, ref.k, atol=KV_ATOL, rtol=0)
        assert torch.allclose(v2, ref.v, atol=KV_ATOL, rtol=0)

        kv_store_master.stop_master(master)  # the store goes away mid-traffic
        before = failures("lookup")
        other = make_case(pipeline, "after", "A new question entirely. " * 4, [], greedy)
        async with asyncio.timeout(60):  # no hang: the tier is skipped
            c, dst = await second.prefill(other)
        second.decode.pages.free(list(dst.page_ids))
        shared = next(
            i for i, (x, y) in enumerate(zip(_page_keys(other), keys, strict=False)) if x != y
        )
        assert c.num_prefix_cached_tokens == shared * PAGE_SIZE  # the template's, held here
        assert c.first_token_id == reference(pipeline, other).first_token_id
        assert failures("lookup") > before
    finally:
        for h in (first, second):
            if h is not None:
                await stop_harness(h)
        kv_store_master.stop_master(master)


def _page_keys(case) -> tuple[bytes, ...]:
    from services.common.prefix_keys import page_keys

    return tuple(page_keys(case.prompt.token_ids, case.prompt.spans, PAGE_SIZE))


async def test_pages_lost_from_the_store_are_computed_instead(
    pipeline, language_model, tmp_path
) -> None:
    """The worker whose segment held the pages dies: the store still lists them for a while,
    so the other worker's plan fetches them, the fetch fails on the rank, and the leader runs
    the request again without the store: it is served, from its own computation."""
    port = free_port()
    master = kv_store_master.start_master(port, log_path=tmp_path / "master.log", client_ttl_s=30)
    greedy = SamplingParams(temperature=0.0)
    case = make_case(pipeline, "lost", "Count the lighthouses on the coast. " * 6, [], greedy)
    ref = reference(pipeline, case)
    store = f"127.0.0.1:{port}"
    holder = reader = None
    try:  # the reader lends no segment: every page lives in the holder's
        holder = await start_harness(
            pipeline,
            language_model,
            prefill_config(devices=("cpu",), kv_store_master=store, kv_store_segment_gb=0.064),
        )
        reader = await start_harness(
            pipeline,
            language_model,
            prefill_config(devices=("cpu",), kv_store_master=store, kv_store_segment_gb=0),
        )
        _, dst = await holder.prefill(case)
        holder.decode.pages.free(list(dst.page_ids))
        expected = (len(case.prompt.token_ids) - 1) // PAGE_SIZE
        keys = _page_keys(case)[:expected]
        for _ in range(100):
            if await reader.leader.store.leading(keys) == expected:
                break
            await asyncio.sleep(0.1)
        else:
            pytest.fail("the holder's pages never reached the store")
        # the holder's rank dies (a clean close would unlist its pages at once): its segment
        # and the pages in it are gone, and the master lists them until --client_ttl
        os.kill(holder.app.ranks.rank_pids[0], signal.SIGKILL)
        before = failures("fetch")
        async with asyncio.timeout(60):
            result, dst = await reader.prefill(case)
        reader.decode.pages.free(list(dst.page_ids))
        assert failures("fetch") == before + 1  # the plan that read the store failed once
        assert result.num_prefix_cached_tokens == 0  # computed: the store skipped for it
        assert result.first_token_id == ref.first_token_id
        assert not reader.scheduler.num_live
    finally:
        for h in (holder, reader):
            if h is not None:
                await stop_harness(h)
        kv_store_master.stop_master(master)
