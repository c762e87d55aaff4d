"""The decode service over real gRPC: parity with the offline engine, batching, errors, pages."""

from __future__ import annotations

import asyncio
import random

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import REGISTRY

from services.common.errors import (
    AbortedError,
    CapacityError,
    DeadlineExceededError,
    InvalidRequestError,
    NotFoundError,
    UnavailableError,
)
from services.common.types import FinishReason, Usage
from services.decode.scheduler import DecodePlan
from services.engine.sampler import SamplingParams
from tests.decode.conftest import WAIT_S, MakeDecode, offline_tokens

EOS = 2


def prompt_of(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 2048) for _ in range(length)]


def record_plans(harness) -> list[DecodePlan]:
    plans: list[DecodePlan] = []
    execute = harness.engine.worker.execute

    def recording(plan: DecodePlan):
        plans.append(plan)
        return execute(plan)

    harness.engine.worker.execute = recording
    return plans


async def test_greedy_matches_offline_engine_one_request(make_decode: MakeDecode, offline) -> None:
    harness = await make_decode()
    prompt, params = prompt_of(13, seed=1), SamplingParams(temperature=0.0, max_new_tokens=24)
    result = await harness.run("r1", prompt, params)
    expected, reason = offline_tokens(offline, prompt, params)
    assert result.token_ids == expected
    assert result.finish_reason.value == reason
    assert result.usage == Usage(len(prompt), len(expected))


async def test_continuous_batching_matches_offline_engine(make_decode: MakeDecode, offline) -> None:
    """Requests of different lengths arrive while others run; each equals its offline run."""
    harness = await make_decode()
    plans = record_plans(harness)
    cases = [
        (f"r{i}", prompt_of(length, seed=i), SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=i == 0))
        for i, (length, n) in enumerate([(5, 160), (31, 40), (9, 25), (17, 33), (3, 12), (44, 20)])
    ]
    results: dict[str, list[int]] = {}
    first_running = asyncio.Event()

    async def run(i: int) -> None:
        request_id, prompt, params = cases[i]
        if i > 0:
            await first_running.wait()
            await asyncio.sleep(0.005 * i)
        kv_ref = await harness.reserve(request_id, prompt, params)
        first = harness.prefill.prefill(request_id, prompt, params, kv_ref)
        tokens = [first]
        async for chunk in harness.client.generate(request_id, first, timeout_s=WAIT_S):
            tokens += chunk.token_ids
            first_running.set()
        results[request_id] = tokens

    await asyncio.gather(*(run(i) for i in range(len(cases))))
    for request_id, prompt, params in cases:
        assert results[request_id] == offline_tokens(offline, prompt, params)[0], request_id
    batches = [[item.request_id for item in plan.items] for plan in plans if plan.items]
    assert max(len(b) for b in batches) > 1
    joined_mid_flight = [
        plan for plan in plans if any(i.is_new for i in plan.items) and any(not i.is_new for i in plan.items)
    ]
    assert joined_mid_flight, "no request joined a batch that was already running"


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_new_tokens=30),
        SamplingParams(temperature=1.3, top_k=50, min_p=0.01, repetition_penalty=1.3, frequency_penalty=0.5,
                       presence_penalty=0.3, seed=7, max_new_tokens=30),
    ],
)
async def test_seeded_sampling_matches_offline_engine(make_decode: MakeDecode, offline, params) -> None:
    harness = await make_decode()
    prompt = prompt_of(11, seed=5)
    greedy_neighbour = harness.run("neighbour", prompt_of(7, seed=6), SamplingParams(temperature=0.0, max_new_tokens=30))
    result, _ = await asyncio.gather(harness.run("seeded", prompt, params), greedy_neighbour)
    assert result.token_ids == offline_tokens(offline, prompt, params)[0]


async def test_unseeded_sampling_runs(make_decode: MakeDecode) -> None:
    harness = await make_decode()
    result = await harness.run("r", prompt_of(6, seed=1), SamplingParams(temperature=1.0, max_new_tokens=10))
    assert len(result.token_ids) == result.usage.num_completion_tokens <= 10


async def test_first_token_can_finish_the_request(make_decode: MakeDecode) -> None:
    harness = await make_decode()
    prompt = prompt_of(5, seed=2)
    cases = [
        ("len1", SamplingParams(temperature=0.0, max_new_tokens=1), 7, FinishReason.LENGTH),
        ("eos", SamplingParams(temperature=0.0), EOS, FinishReason.STOP),
        ("stop-id", SamplingParams(temperature=0.0, stop_token_ids=(7,)), 7, FinishReason.STOP),
    ]
    for request_id, params, first, reason in cases:
        await harness.reserve(request_id, prompt, params)
        chunks = [c async for c in harness.client.generate(request_id, first, timeout_s=WAIT_S)]
        assert [(c.token_ids, c.finish_reason, c.usage) for c in chunks] == [((), reason, Usage(5, 1))]
    await harness.reserve("ignore", prompt, SamplingParams(temperature=0.0, ignore_eos=True, max_new_tokens=3))
    chunks = [c async for c in harness.client.generate("ignore", EOS, timeout_s=WAIT_S)]
    assert sum(len(c.token_ids) for c in chunks) == 2 and chunks[-1].finish_reason is FinishReason.LENGTH


async def test_capacity_is_resource_exhausted_until_pages_come_back(make_decode: MakeDecode) -> None:
    harness = await make_decode(num_pages=16)
    params = SamplingParams(temperature=0.0, max_new_tokens=28)  # 4 + 28 positions = 8 pages
    await harness.reserve("a", prompt_of(4, 1), params)
    await harness.reserve("b", prompt_of(4, 2), params)
    with pytest.raises(CapacityError) as caught:
        await harness.reserve("c", prompt_of(4, 3), params)
    assert caught.value.retryable
    assert (await harness.client.stats()).num_free_pages == 0
    assert await harness.client.abort("a", "test")  # never written: its 8 pages go to quarantine
    with pytest.raises(CapacityError, match="8 in quarantine"):
        await harness.reserve("c", prompt_of(4, 3), params)
    await harness.pass_quarantine()
    await harness.reserve("c", prompt_of(4, 3), params)
    for request_id in ("b", "c"):
        assert await harness.client.abort(request_id, "test")


async def test_abort_mid_stream_ends_it_cancelled_and_frees_pages(make_decode: MakeDecode) -> None:
    harness = await make_decode()
    params = SamplingParams(temperature=0.0, max_new_tokens=800, ignore_eos=True)
    prompt = prompt_of(8, 1)
    kv_ref = await harness.reserve("r", prompt, params)
    first = harness.prefill.prefill("r", prompt, params, kv_ref)
    stream = harness.client.generate("r", first, timeout_s=WAIT_S)
    assert (await anext(stream)).finish_reason is None
    assert await harness.client.abort("r", "client went away")
    with pytest.raises(AbortedError, match="client went away"):
        async for _ in stream:
            pass
    assert not await harness.client.abort("r", "again")  # idempotent
    await harness.wait_all_pages_free()
    stats = await harness.client.stats()
    assert stats.num_running_requests == stats.num_reserved_requests == 0


async def test_cancelled_stream_aborts_the_request(make_decode: MakeDecode) -> None:
    harness = await make_decode()
    params = SamplingParams(temperature=0.0, max_new_tokens=800, ignore_eos=True)
    prompt = prompt_of(8, 1)
    kv_ref = await harness.reserve("r", prompt, params)
    first = harness.prefill.prefill("r", prompt, params, kv_ref)
    async for _ in harness.client.generate("r", first, timeout_s=WAIT_S):
        break  # the router's client disconnected
    await harness.wait_for(lambda: harness.engine.stats().num_running_requests == 0)
    await harness.wait_all_pages_free()
    assert not await harness.client.abort("r", "late")


async def page_counts(harness) -> tuple[int, int, int]:
    """(free, used, quarantined) from Stats, checking that they add up to the pool, overall and per rank."""
    stats = await harness.client.stats()
    for counts in (stats, *stats.ranks):
        assert counts.num_free_pages + counts.num_used_pages + counts.num_quarantined_pages == counts.num_total_pages
    assert stats.num_quarantined_pages == sum(r.num_quarantined_pages for r in stats.ranks)
    return stats.num_free_pages, stats.num_used_pages, stats.num_quarantined_pages


async def test_abort_reserved_request_quarantines_its_pages(make_decode: MakeDecode) -> None:
    harness = await make_decode()
    start = harness.num_start_free_pages
    await harness.reserve("r", prompt_of(8, 1), SamplingParams(max_new_tokens=12))  # 20 positions: 5 pages
    assert (await harness.client.stats()).num_reserved_requests == 1
    assert await page_counts(harness) == (start - 5, 5, 0)
    assert await harness.client.abort("r", "prefill failed")  # prefill may still be writing its KV
    assert await page_counts(harness) == (start - 5, 0, 5)
    assert (await harness.client.stats()).num_reserved_requests == 0
    with pytest.raises(NotFoundError):
        async for _ in harness.client.generate("r", 7, timeout_s=WAIT_S):
            pass
    await harness.reserve("r", prompt_of(8, 1), SamplingParams(max_new_tokens=12))  # the id is free again
    assert await page_counts(harness) == (start - 10, 5, 5)
    assert await harness.client.abort("r", "again")
    await harness.pass_quarantine()
    assert await page_counts(harness) == (start, 0, 0)


async def test_abort_with_kv_written_frees_a_reservation_at_once(make_decode: MakeDecode) -> None:
    harness = await make_decode()
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    prompt = prompt_of(8, 1)
    kv_ref = await harness.reserve("r", prompt, params)
    harness.prefill.prefill("r", prompt, params, kv_ref)  # the KV landed; the first token ends it (router side)
    assert await harness.client.abort("r", "the first token finished it", is_kv_written=True)
    assert await page_counts(harness) == (harness.num_start_free_pages, 0, 0)
    assert not await harness.client.abort("r", "again", is_kv_written=True)


async def test_abort_of_a_running_request_frees_at_once(make_decode: MakeDecode) -> None:
    harness = await make_decode()
    params = SamplingParams(temperature=0.0, max_new_tokens=800, ignore_eos=True)
    prompt = prompt_of(8, 2)
    kv_ref = await harness.reserve("r", prompt, params)
    stream = harness.client.generate("r", harness.prefill.prefill("r", prompt, params, kv_ref), timeout_s=WAIT_S)
    assert (await anext(stream)).finish_reason is None
    assert await harness.client.abort("r", "a stop string matched")  # running: no is_kv_written needed
    with pytest.raises(AbortedError):
        async for _ in stream:
            pass
    await harness.wait_all_pages_free()  # after the step in flight; the quarantine clock never moved
    assert await page_counts(harness) == (harness.num_start_free_pages, 0, 0)


async def test_reservation_expires_at_its_deadline(make_decode: MakeDecode) -> None:
    harness = await make_decode()
    start = harness.num_start_free_pages
    await harness.reserve("r", prompt_of(8, 1), SamplingParams(max_new_tokens=12), deadline_in_s=0.2)
    await harness.wait_for(lambda: harness.engine.stats().num_reserved_requests == 0)
    assert await page_counts(harness) == (start - 5, 0, 5)  # a late write may still land: quarantined
    with pytest.raises(NotFoundError, match="unknown, expired or aborted"):
        async for _ in harness.client.generate("r", 7, timeout_s=WAIT_S):
            pass
    await harness.pass_quarantine()
    assert await page_counts(harness) == (start, 0, 0)


@pytest.mark.parametrize(
    ("prompt_len", "params", "param"),
    [
        (5, SamplingParams(temperature=-1.0), "temperature"),
        (5, SamplingParams(top_p=0.0), "top_p"),
        (5, SamplingParams(frequency_penalty=3.0), "frequency_penalty"),
        (0, SamplingParams(), "prompt_token_ids"),
        (4096, SamplingParams(), "prompt_token_ids"),
        (5, SamplingParams(max_new_tokens=4000), "max_new_tokens"),  # more pages than the pool has
    ],
)
async def test_bad_reserve_is_invalid_argument(make_decode: MakeDecode, prompt_len, params, param) -> None:
    harness = await make_decode()
    with pytest.raises(InvalidRequestError) as caught:
        await harness.reserve("r", prompt_of(prompt_len, 1), params)
    assert caught.value.param == param
    await harness.run("after", prompt_of(5, 1), SamplingParams(temperature=0.0, max_new_tokens=4))  # still serving


async def test_duplicate_ids_and_bad_generate_calls(make_decode: MakeDecode) -> None:
    harness = await make_decode()
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    prompt = prompt_of(5, 1)
    await harness.reserve("r", prompt, params)
    with pytest.raises(InvalidRequestError, match="already live"):
        await harness.reserve("r", prompt, params)
    with pytest.raises(InvalidRequestError, match="first_token_id"):
        async for _ in harness.client.generate("r", 99999, timeout_s=WAIT_S):
            pass
    with pytest.raises(InvalidRequestError, match="token ids must be"):
        await harness.reserve("bad-token", [1, 99999], params)
    stream = harness.client.generate("r", 7, timeout_s=WAIT_S)
    first_chunk = await anext(stream)
    with pytest.raises(InvalidRequestError, match="already started"):
        async for _ in harness.client.generate("r", 7, timeout_s=WAIT_S):
            pass
    rest = [c async for c in stream]  # the first stream is unaffected
    assert (rest or [first_chunk])[-1].finish_reason is not None


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
async def test_engine_failure_fails_live_requests_and_health(make_decode: MakeDecode) -> None:
    harness = await make_decode()

    def broken(plan):
        raise RuntimeError("device lost")

    harness.engine.worker.execute = broken
    await harness.reserve("reserved", prompt_of(5, 1), SamplingParams())
    await harness.reserve("r", prompt_of(5, 2), SamplingParams(temperature=0.0))
    with pytest.raises(UnavailableError, match="decode engine stopped"):
        async for _ in harness.client.generate("r", 7, timeout_s=WAIT_S):
            pass
    assert not harness.engine.is_healthy()
    with pytest.raises(UnavailableError, match="not running"):
        await harness.reserve("late", prompt_of(5, 3), SamplingParams())
    await harness.wait_all_pages_free()


async def test_watchdog_flags_a_stuck_loop(make_decode: MakeDecode) -> None:
    harness = await make_decode(watchdog_s=0.05)
    import threading

    release = threading.Event()
    execute = harness.engine.worker.execute

    def stuck(plan):
        release.wait(WAIT_S)
        return execute(plan)

    harness.engine.worker.execute = stuck
    assert harness.engine.is_healthy()
    task = asyncio.ensure_future(harness.run("r", prompt_of(5, 1), SamplingParams(temperature=0.0, max_new_tokens=3)))
    await harness.wait_for(lambda: not harness.engine.is_healthy())
    release.set()
    await task
    await harness.wait_for(harness.engine.is_healthy)


async def test_free_pages_return_after_a_mixed_workload(make_decode: MakeDecode) -> None:
    harness = await make_decode(num_pages=128)
    start = await harness.client.stats()
    assert start.num_free_pages == start.num_total_pages == 128 and start.page_size == 4

    async def finished(i: int) -> None:
        await harness.run(f"ok-{i}", prompt_of(3 + i, i), SamplingParams(temperature=0.0, max_new_tokens=10))

    async def aborted(i: int) -> None:
        params = SamplingParams(temperature=0.0, max_new_tokens=60, ignore_eos=True)  # 17 pages
        kv_ref = await harness.reserve(f"abort-{i}", prompt_of(6, i), params)
        first = harness.prefill.prefill(f"abort-{i}", prompt_of(6, i), params, kv_ref)
        async for _ in harness.client.generate(f"abort-{i}", first, timeout_s=WAIT_S):
            await harness.client.abort(f"abort-{i}", "test")

    async def never_generated(i: int) -> None:
        try:  # the short deadline may also pass during the call; pages are freed either way
            await harness.reserve(f"reserved-{i}", prompt_of(6, i), SamplingParams(), deadline_in_s=0.2)
        except DeadlineExceededError:
            pass

    async def rejected(i: int) -> None:
        try:
            await harness.reserve(f"big-{i}", prompt_of(20, i), SamplingParams(max_new_tokens=200))  # 55 pages
        except CapacityError:
            pass
        else:
            await harness.client.abort(f"big-{i}", "test")

    jobs = [f(i) for i in range(3) for f in (finished, aborted, never_generated, rejected)]
    outcomes = await asyncio.gather(*jobs, return_exceptions=True)
    assert all(o is None or isinstance(o, AbortedError | CapacityError) for o in outcomes), outcomes
    await harness.wait_for(lambda: harness.engine.stats().num_reserved_requests == 0)
    await page_counts(harness)
    await harness.pass_quarantine()  # expired and aborted reservations
    end = await harness.client.stats()
    assert end.num_free_pages == start.num_free_pages
    assert end.num_running_requests == end.num_reserved_requests == end.num_used_pages == 0
    assert end.num_quarantined_pages == 0
    assert len(end.ranks) == 1 and end.ranks[0].num_free_pages == end.num_free_pages


async def test_generate_span_continues_the_callers_trace(make_decode: MakeDecode) -> None:
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        trace.set_tracer_provider(TracerProvider())
        provider = trace.get_tracer_provider()
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    harness = await make_decode()
    with trace.get_tracer("test").start_as_current_span("router.request") as parent:
        await harness.run("traced", prompt_of(5, 1), SamplingParams(temperature=0.0, max_new_tokens=5))
    exporter.shutdown()
    (span,) = [s for s in exporter.get_finished_spans() if s.attributes.get("request_id") == "traced"]
    assert span.name == "decode.generate"
    assert span.context.trace_id == parent.get_span_context().trace_id
    assert span.parent.span_id == parent.get_span_context().span_id
    assert span.attributes["num_streamed_tokens"] == 4


async def test_metrics_count_outcomes_tokens_and_pages(make_decode: MakeDecode) -> None:
    def value(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(f"stageserve_decode_{name}", labels) or 0.0

    harness = await make_decode()
    before = {
        "length": value("requests_total", outcome="length"),
        "aborted": value("requests_total", outcome="aborted"),
        "tokens": value("tokens_generated_total"),
        "itl": value("inter_token_latency_seconds_count"),
        "steps": value("step_seconds_count"),
    }
    await harness.run("m", prompt_of(5, 1), SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True))
    await harness.reserve("m-aborted", prompt_of(5, 1), SamplingParams())
    used = harness.engine.stats().num_used_pages
    assert value("kv_pages_used") == used and value("kv_pages_free") == harness.num_start_free_pages - used
    assert value("reserved_requests") == 1
    assert value("kv_pages_quarantined") == 0
    await harness.client.abort("m-aborted")
    assert value("kv_pages_quarantined") == used and value("kv_pages_used") == 0
    await harness.pass_quarantine()
    assert value("kv_pages_quarantined") == 0 and value("kv_pages_free") == harness.num_start_free_pages
    assert value("requests_total", outcome="length") == before["length"] + 1
    assert value("requests_total", outcome="aborted") == before["aborted"] + 1
    assert value("tokens_generated_total") == before["tokens"] + 5
    assert value("inter_token_latency_seconds_count") == before["itl"] + 5
    assert value("step_seconds_count") == before["steps"] + 5
    assert value("running_requests") == 0 and value("kv_pages_used") == 0
