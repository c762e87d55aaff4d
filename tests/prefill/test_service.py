"""The prefill service over real gRPC: first token and KV pages equal the offline engine's; failures free everything."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
import torch
from opentelemetry import trace
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import REGISTRY

from services.common.errors import (
    DeadlineExceededError,
    ImageDataNeededError,
    InvalidRequestError,
    UnavailableError,
)
from services.common.types import FinishReason, SamplingParams, TokenizedPrompt
from tests.conftest import image_bytes, sdk_provider
from tests.prefill.conftest import (
    KV_ATOL,
    Case,
    Harness,
    gate_worker,
    make_case,
    prefill_abandoned_while_held,
    prefill_as_one_batch,
    prefill_config,
    reference,
    standard_cases,
    start_harness,
    stop_harness,
    wait_until,
    wait_until_ready,
)


def assert_matches(harness: Harness, case: Case, result, dst, ref) -> None:
    n = len(case.prompt.token_ids)
    assert result.first_token_id == ref.first_token_id, case.request.request_id
    k, v = harness.decode.kv(dst, n)
    assert ref.k.abs().amax() > 0 and ref.v.abs().amax() > 0
    assert torch.allclose(k, ref.k, atol=KV_ATOL, rtol=0), (k - ref.k).abs().max()
    assert torch.allclose(v, ref.v, atol=KV_ATOL, rtol=0), (v - ref.v).abs().max()
    pool = harness.decode.pool
    assert result.num_kv_bytes == 2 * pool.num_layers * -(-n // pool.page_size) * pool.page_nbytes


def requests_total(outcome: str) -> float:
    return (
        REGISTRY.get_sample_value("stageserve_prefill_requests_total", {"outcome": outcome}) or 0.0
    )


@pytest.mark.parametrize("index", [0, 1, 2], ids=["text", "one-image", "two-images"])
async def test_first_token_and_kv_equal_the_offline_engine(
    pipeline, harness: Harness, index: int
) -> None:
    case = standard_cases(pipeline)[index]
    ref = reference(pipeline, case)
    ok_before = requests_total("ok")
    result, dst = await harness.prefill(case)
    assert_matches(harness, case, result, dst, ref)
    assert result.finish_reason is None and result.num_cached_image_tokens == 0
    assert harness.encoder.num_calls == (1 if case.prompt.spans else 0)
    assert requests_total("ok") == ok_before + 1
    harness.assert_all_free()


async def test_concurrent_requests_share_a_batch_and_give_identical_results(
    pipeline, harness: Harness
) -> None:
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=7)
    cases = [
        *standard_cases(pipeline),
        make_case(pipeline, "sampled", "Tell me a story about the wind.", [], sampled),
        make_case(
            pipeline,
            "sampled-image",
            "Describe the colours.",
            [image_bytes(90, 90, seed=5)],
            sampled,
        ),
    ]
    refs = [reference(pipeline, case) for case in cases]
    release, plans = gate_worker(harness)
    blocker = asyncio.create_task(
        harness.prefill(make_case(pipeline, "first", "Hi.", [], SamplingParams()))
    )
    await wait_until(lambda: bool(plans))  # the first plan is held; the others queue behind it
    tasks = [asyncio.create_task(harness.prefill(case)) for case in cases]
    await wait_until_ready(harness, len(cases))
    release()
    results = await asyncio.gather(*tasks)
    await blocker
    assert plans[0] == ["first"]
    assert sorted(plans[1]) == sorted(
        c.request.request_id for c in cases
    )  # one batch, text and images
    for case, (result, dst), ref in zip(cases, results, refs, strict=True):
        assert_matches(harness, case, result, dst, ref)
    harness.assert_all_free()


@pytest.mark.parametrize(
    ("mode", "error"), [("unavailable", UnavailableError), ("invalid", InvalidRequestError)]
)
async def test_encoder_failure_is_an_error_and_frees_everything(
    pipeline, harness: Harness, mode, error
) -> None:
    harness.encoder.mode = mode
    case = standard_cases(pipeline)[2]
    with pytest.raises(error):
        await harness.prefill(case)
    harness.assert_all_free()
    harness.encoder.mode = "ok"  # the service keeps answering
    case = standard_cases(pipeline)[1]
    result, dst = await harness.prefill(case)
    assert_matches(harness, case, result, dst, reference(pipeline, case))
    harness.assert_all_free()


async def test_deadline_passing_during_encode_is_deadline_exceeded(
    pipeline, harness: Harness
) -> None:
    harness.encoder.mode, harness.encoder.delay_s = "slow", 1.5
    deadline_before = requests_total("deadline_exceeded")
    with pytest.raises(DeadlineExceededError):
        await harness.prefill(standard_cases(pipeline)[1], deadline_in_s=0.5)
    assert requests_total("deadline_exceeded") == deadline_before + 1
    for _ in range(300):  # the slow Encode returns; its rows go back (quarantine is 0 here)
        if harness.scheduler.num_live == 0 and harness.scheduler.num_rows_used == 0:
            break
        await asyncio.sleep(0.01)
    harness.assert_all_free()


async def test_deadline_passing_while_queued_behind_a_batch(pipeline, harness: Harness) -> None:
    release, plans = gate_worker(harness)
    blocker = asyncio.create_task(
        harness.prefill(make_case(pipeline, "first", "Hi.", [], SamplingParams()))
    )
    while not plans:
        await asyncio.sleep(0.01)
    with pytest.raises(DeadlineExceededError):
        await harness.prefill(standard_cases(pipeline)[0], deadline_in_s=0.3)
    release()
    await blocker
    assert plans == [["first"]]  # the expired request never ran
    harness.assert_all_free()


async def test_kv_transfer_failure_is_unavailable_and_frees_pages(
    pipeline, harness: Harness
) -> None:
    case = standard_cases(pipeline)[0]
    dst = harness.decode.reserve("text", len(case.prompt.token_ids))
    harness.decode.receiver.close()  # decode's pool is gone
    with pytest.raises(UnavailableError, match="rank 0: decode.s KV pool .* no longer exists"):
        await harness.client.prefill(
            "text", case.prompt, case.request.params, harness.decode.kv_ref(dst), time.time() + 30
        )
    harness.assert_all_free()


async def test_bad_requests_are_invalid_argument(pipeline, harness: Harness) -> None:
    greedy = SamplingParams(temperature=0.0)
    case = standard_cases(pipeline)[1]
    span = case.prompt.spans[0]
    bad_prompts = {
        "span over text": msgspec.structs.replace(
            case.prompt, spans=(msgspec.structs.replace(span, offset=span.offset - 1),)
        ),
        "grid mismatch": msgspec.structs.replace(
            case.prompt, spans=(msgspec.structs.replace(span, grid_thw=(1, 2, 2)),)
        ),
        "placeholders without span": msgspec.structs.replace(case.prompt, spans=()),
        "empty": TokenizedPrompt(()),
        "token out of vocab": TokenizedPrompt((1, 2, 999_999)),
    }
    for name, prompt in bad_prompts.items():
        kv_ref = harness.decode.kv_ref(
            harness.decode.reserve(f"bad-{name}", max(len(prompt.token_ids), 1))
        )
        with pytest.raises(InvalidRequestError):
            await harness.client.prefill(
                f"bad-{name}", prompt, case.request.params, kv_ref, time.time() + 30
            )
    # an image named by hash alone that the worker never got: the caller must send its bytes
    unsent = make_case(pipeline, "no-bytes", "And this?", [image_bytes(70, 50, seed=99)], greedy)
    kv_ref = harness.decode.kv_ref(harness.decode.reserve("no-bytes", len(unsent.prompt.token_ids)))
    with pytest.raises(ImageDataNeededError, match="send their bytes") as needed:
        await harness.client.prefill(
            "no-bytes",
            msgspec.structs.replace(unsent.prompt, images={}),
            unsent.request.params,
            kv_ref,
            time.time() + 30,
        )
    assert needed.value.param == "images"
    text = standard_cases(pipeline)[0]
    n = len(text.prompt.token_ids)
    short = harness.decode.kv_ref(
        msgspec.structs.replace(harness.decode.reserve("short", n), page_ids=(0,))
    )
    with pytest.raises(InvalidRequestError, match="pages") as info:
        await harness.client.prefill(
            "short", text.prompt, text.request.params, short, time.time() + 30
        )
    assert info.value.param == "kv_ref"
    with pytest.raises(InvalidRequestError) as info:
        await harness.client.prefill(
            "hot",
            text.prompt,
            SamplingParams(temperature=-1.0),
            harness.decode.kv_ref(harness.decode.reserve("hot", n)),
            time.time() + 30,
        )
    assert info.value.param == "temperature"
    harness.assert_all_free()


async def test_first_token_can_finish_the_request(pipeline, harness: Harness) -> None:
    case = make_case(pipeline, "one", "Hi.", [], SamplingParams(temperature=0.0, max_new_tokens=1))
    result, _ = await harness.prefill(case)
    assert result.finish_reason is FinishReason.LENGTH
    eos = make_case(
        pipeline,
        "eos",
        "Hi.",
        [],
        SamplingParams(temperature=0.0, stop_token_ids=(result.first_token_id,)),
    )
    result, _ = await harness.prefill(eos)
    assert result.finish_reason is FinishReason.STOP


async def test_small_token_budget_splits_batches(pipeline, language_model) -> None:
    h = await start_harness(pipeline, language_model, prefill_config(max_batch_tokens=8))
    try:
        cases = standard_cases(pipeline)
        refs = [reference(pipeline, c) for c in cases]
        results = await asyncio.gather(*(h.prefill(c) for c in cases))
        for case, (result, dst), ref in zip(cases, results, refs, strict=True):
            assert_matches(h, case, result, dst, ref)
        h.assert_all_free()
    finally:
        await stop_harness(h)


async def test_forward_and_transfer_spans_continue_the_callers_trace(
    pipeline, harness: Harness
) -> None:
    exporter = InMemorySpanExporter()
    sdk_provider().add_span_processor(SimpleSpanProcessor(exporter))
    case = standard_cases(pipeline)[1]
    with trace.get_tracer("test").start_as_current_span("router.request") as parent:
        await harness.prefill(case)
    exporter.shutdown()
    spans = {
        s.name: s
        for s in exporter.get_finished_spans()
        if s.attributes.get("request_id") == "one-image"
    }
    request = spans[
        "prefill.request"
    ]  # the call's span, queueing included: the stages are its children
    assert request.parent.span_id == parent.get_span_context().span_id
    assert request.attributes["gen_ai.usage.input_tokens"] == len(case.prompt.token_ids)
    for name in ("prefill.forward", "kv.transfer"):
        assert spans[name].context.trace_id == parent.get_span_context().trace_id, name
        assert spans[name].parent.span_id == request.context.span_id, name
    assert spans["kv.transfer"].attributes["kv.num_bytes"] > 0


async def test_no_write_starts_after_the_callers_deadline(pipeline, harness: Harness) -> None:
    """The plan carrying the request reaches the ranks after its deadline: the ranks start no
    write (the deadline travels as wall-clock time); the caller has its DEADLINE_EXCEEDED, all
    is freed and the service serves the next request."""
    dst = await prefill_abandoned_while_held(harness, standard_cases(pipeline)[0])
    assert not harness.decode.is_written(dst)
    harness.assert_all_free()
    case = standard_cases(pipeline)[1]
    result, dst = await harness.prefill(case)
    assert_matches(harness, case, result, dst, reference(pipeline, case))


@pytest.mark.slow
async def test_two_cp_ranks_serve_a_mixed_batch_like_one(pipeline, language_model) -> None:
    """C = 2 behind the gRPC service: a batch of text and image requests, every image row sent
    to both ranks, first tokens and decode's KV equal the offline engine's."""
    h = await start_harness(pipeline, language_model, prefill_config(devices=("cpu", "cpu")))
    try:
        cases = standard_cases(pipeline)
        results, batch = await prefill_as_one_batch(h, pipeline, cases)
        assert sorted(batch) == sorted(c.request.request_id for c in cases)
        for case, result in zip(cases, results, strict=True):
            assert_matches(h, case, *result, reference(pipeline, case))
        assert h.encoder.num_destinations and set(h.encoder.num_destinations) == {2}
        h.assert_all_free()
    finally:
        await stop_harness(h)
