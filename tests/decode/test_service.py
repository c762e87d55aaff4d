"""The decode service over real gRPC: parity with the offline engine, batching, errors, health, telemetry."""

from __future__ import annotations

import asyncio
import itertools

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import REGISTRY

from services.common.errors import (
    InvalidRequestError,
    UnavailableError,
)
from services.common.types import FinishReason, SamplingParams, Usage
from services.decode import leader as leader_module
from services.decode.scheduler import DecodePlan
from tests.conftest import sdk_provider
from tests.decode.conftest import EOS, MakeDecode, offline_tokens, prompt_of


def record_plans(harness) -> list[DecodePlan]:
    plans: list[DecodePlan] = []
    scheduler = harness.ranks[0].rank.scheduler
    schedule = scheduler.schedule

    def recording(step: int) -> DecodePlan | None:
        plan = schedule(step)
        if plan is not None:
            plans.append(plan)
        return plan

    scheduler.schedule = recording
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
        (
            f"r{i}",
            prompt_of(length, seed=i),
            SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=i == 0),
        )
        for i, (length, n) in enumerate([(5, 160), (31, 40), (9, 25), (17, 33), (3, 12), (44, 20)])
    ]
    results: dict[str, list[int]] = {}
    first_running = asyncio.Event()

    async def run(i: int) -> None:
        request_id, prompt, params = cases[i]
        if i > 0:
            await first_running.wait()
            await asyncio.sleep(0.005 * i)
        kv_ref, first = await harness.reserve_and_prefill(request_id, prompt, params)
        tokens = [first]
        async for chunk in harness.generate(kv_ref, first):
            tokens += chunk.token_ids
            first_running.set()
        results[request_id] = tokens

    await asyncio.gather(*(run(i) for i in range(len(cases))))
    for request_id, prompt, params in cases:
        assert results[request_id] == offline_tokens(offline, prompt, params)[0], request_id
    assert max(plan.num_rows for plan in plans) > 1
    joined_mid_flight = [plan for plan in plans if plan.joined and len(plan.joined) < plan.num_rows]
    assert joined_mid_flight, "no request joined a batch that was already running"


async def test_a_request_waiting_for_a_place_in_the_batch_is_listed_until_it_runs(
    make_decode: MakeDecode, offline, monkeypatch
) -> None:
    """With a batch of one, the second request waits while the first runs: its stream gets
    empty chunks (decode lists it as waiting, what the router's stall bound reads), then
    exactly the offline engine's tokens."""
    monkeypatch.setattr(leader_module, "WAITING_LIST_S", 0.0)  # list at every report
    harness = await make_decode(max_running_requests=1)
    params = SamplingParams(temperature=0.0, max_new_tokens=120, ignore_eos=True)
    prompts = {"first": prompt_of(7, seed=3), "second": prompt_of(11, seed=4)}
    chunks: dict[str, list] = {"first": [], "second": []}
    first_running = asyncio.Event()

    async def run(request_id: str) -> list[int]:
        prompt = prompts[request_id]
        if request_id == "second":
            await first_running.wait()
        kv_ref, first = await harness.reserve_and_prefill(request_id, prompt, params)
        tokens = [first]
        async for chunk in harness.generate(kv_ref, first):
            chunks[request_id].append(chunk)
            tokens += chunk.token_ids
            first_running.set()
        return tokens

    tokens = dict(zip(prompts, await asyncio.gather(*(run(r) for r in prompts)), strict=True))
    for request_id, prompt in prompts.items():
        assert tokens[request_id] == offline_tokens(offline, prompt, params)[0], request_id
    waited = list(itertools.takewhile(lambda c: not c.token_ids, chunks["second"]))
    assert waited and all(c.finish_reason is None for c in waited)
    assert chunks["first"][-1].finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_new_tokens=30),
        SamplingParams(
            temperature=1.3,
            top_k=50,
            min_p=0.01,
            repetition_penalty=1.3,
            frequency_penalty=0.5,
            presence_penalty=0.3,
            seed=7,
            max_new_tokens=30,
        ),
    ],
)
async def test_seeded_sampling_matches_offline_engine(
    make_decode: MakeDecode, offline, params
) -> None:
    harness = await make_decode()
    prompt = prompt_of(11, seed=5)
    greedy_neighbour = harness.run(
        "neighbour", prompt_of(7, seed=6), SamplingParams(temperature=0.0, max_new_tokens=30)
    )
    result, _ = await asyncio.gather(harness.run("seeded", prompt, params), greedy_neighbour)
    assert result.token_ids == offline_tokens(offline, prompt, params)[0]


async def test_unseeded_sampling_runs(make_decode: MakeDecode) -> None:
    harness = await make_decode()
    result = await harness.run(
        "r", prompt_of(6, seed=1), SamplingParams(temperature=1.0, max_new_tokens=10)
    )
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
        kv_ref = await harness.reserve(request_id, prompt, params)
        chunks = [c async for c in harness.generate(kv_ref, first)]
        assert [(c.token_ids, c.finish_reason, c.usage) for c in chunks] == [
            ((), reason, Usage(5, 1))
        ]
    kv_ref = await harness.reserve(
        "ignore", prompt, SamplingParams(temperature=0.0, ignore_eos=True, max_new_tokens=3)
    )
    chunks = [c async for c in harness.generate(kv_ref, EOS)]
    assert (
        sum(len(c.token_ids) for c in chunks) == 2
        and chunks[-1].finish_reason is FinishReason.LENGTH
    )


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
async def test_bad_reserve_is_invalid_argument(
    make_decode: MakeDecode, prompt_len, params, param
) -> None:
    harness = await make_decode()
    with pytest.raises(InvalidRequestError) as caught:
        await harness.reserve("r", prompt_of(prompt_len, 1), params)
    assert caught.value.param == param
    await harness.run(
        "after", prompt_of(5, 1), SamplingParams(temperature=0.0, max_new_tokens=4)
    )  # still serving


async def test_duplicate_ids_and_bad_generate_calls(make_decode: MakeDecode) -> None:
    harness = await make_decode()
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    prompt = prompt_of(5, 1)
    kv_ref = await harness.reserve("r", prompt, params)
    with pytest.raises(InvalidRequestError, match="already live"):
        await harness.reserve("r", prompt, params)
    with pytest.raises(InvalidRequestError, match="first_token_id"):
        async for _ in harness.generate(kv_ref, 99999):
            pass
    with pytest.raises(InvalidRequestError, match="token ids must be"):
        await harness.reserve("bad-token", [1, 99999], params)
    stream = harness.generate(kv_ref, 7)
    first_chunk = await anext(stream)
    with pytest.raises(InvalidRequestError, match="already started"):
        async for _ in harness.generate(kv_ref, 7):
            pass
    rest = [c async for c in stream]  # the first stream is unaffected
    assert (rest or [first_chunk])[-1].finish_reason is not None


async def test_a_dead_rank_fails_its_requests_and_readiness_until_it_is_back(
    make_decode: MakeDecode,
) -> None:
    harness = await make_decode()
    rank = harness.ranks[0]
    reserved = await harness.reserve("reserved", prompt_of(5, 1), SamplingParams())
    params = SamplingParams(temperature=0.0, max_new_tokens=200, ignore_eos=True)
    kv_ref, first = await harness.reserve_and_prefill("r", prompt_of(5, 2), params)
    stream = harness.generate(kv_ref, first)
    assert (await anext(stream)).finish_reason is None

    def die(payload) -> None:
        rank.before_step = None
        rank.crash()

    rank.before_step = die
    with pytest.raises(UnavailableError, match="decode rank 0 failed.*did not finish"):
        async for _ in stream:
            pass
    await harness.wait_for(lambda: not harness.leader.is_ready)
    with pytest.raises(UnavailableError, match="lost its reservation"):  # not NOT_FOUND: retryable
        async for _ in harness.generate(reserved, 7):
            pass
    with pytest.raises(UnavailableError, match="no decode rank serves"):
        await harness.reserve("late", prompt_of(5, 3), SamplingParams())
    await rank.restart()  # a fresh process: a fresh pool
    await harness.wait_for(lambda: harness.leader.is_ready)
    assert harness.stats().num_free_pages == harness.num_start_free_pages
    await harness.run("after", prompt_of(5, 4), SamplingParams(temperature=0.0, max_new_tokens=4))


async def test_reserve_and_generate_spans_continue_the_callers_trace(
    make_decode: MakeDecode,
) -> None:
    exporter = InMemorySpanExporter()
    sdk_provider().add_span_processor(SimpleSpanProcessor(exporter))
    harness = await make_decode()
    with trace.get_tracer("test").start_as_current_span("router.request") as parent:
        await harness.run(
            "traced",
            prompt_of(5, 1),
            SamplingParams(temperature=0.0, max_new_tokens=5, ignore_eos=True),
        )
    exporter.shutdown()
    spans = {
        s.name: s
        for s in exporter.get_finished_spans()
        if s.attributes.get("request_id") == "traced"
    }
    assert sorted(spans) == ["decode.generate", "decode.reserve"]
    for span in spans.values():
        assert span.context.trace_id == parent.get_span_context().trace_id
        assert span.parent.span_id == parent.get_span_context().span_id
    generate = spans["decode.generate"]
    assert generate.attributes["gen_ai.usage.output_tokens"] == 5
    assert generate.attributes["finish_reason"] == "length"
    assert spans["decode.reserve"].attributes["gen_ai.usage.input_tokens"] == 5


async def test_metrics_count_outcomes_tokens_and_pages(make_decode: MakeDecode) -> None:
    def value(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(f"stageserve_decode_{name}", labels) or 0.0

    harness = await make_decode()
    before = {
        "length": value("requests_total", outcome="length"),
        "aborted": value("requests_total", outcome="aborted"),
        "tokens": value("tokens_generated_total"),
        "steps": value("step_seconds_count"),
    }
    await harness.run(
        "m", prompt_of(5, 1), SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    )
    await harness.reserve("m-aborted", prompt_of(5, 1), SamplingParams())
    used = harness.stats().num_used_pages
    assert (
        value("kv_pages_used") == used
        and value("kv_pages_free") == harness.num_start_free_pages - used
    )
    assert value("reserved_requests") == 1
    assert value("kv_pages_quarantined") == 0
    stats = harness.stats()  # one reserved request: its pages or its batch slot, the larger
    held = max(1 - stats.num_free_pages / stats.num_total_pages, 1 / stats.max_running_requests)
    assert value("saturation") == pytest.approx(held) and 0 < held < 1
    await harness.client.abort("m-aborted")
    assert value("kv_pages_quarantined") == used and value("kv_pages_used") == 0
    await harness.pass_quarantine()
    assert (
        value("kv_pages_quarantined") == 0
        and value("kv_pages_free") == harness.num_start_free_pages
    )
    assert value("requests_total", outcome="length") == before["length"] + 1
    assert value("requests_total", outcome="aborted") == before["aborted"] + 1
    assert value("tokens_generated_total") == before["tokens"] + 5
    assert value("step_seconds_count") == before["steps"] + 5
    assert value("running_requests") == 0 and value("kv_pages_used") == 0
    assert value("saturation") == 0
