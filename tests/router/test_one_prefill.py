"""One prefill per prompt for ``n`` choices (``choices.open_choices``): a prompt's first choice
starts at once, the others once its first delta came (or it ended without one), so they read
the prompt from prefill's prefix cache; closing or cancelling closes every stream; choices keep
their order, index, id and seed. Over a fake pipeline, then through both front ends over the
fake workers."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import AsyncIterator

import pytest

from services.common.client import create_channel
from services.common.errors import UnavailableError
from services.common.pb.stageserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from services.common.types import FinishReason, SamplingParams
from services.router.choices import (
    choice_requests,
    each_choice,
    merged,
    open_choices,
    reads_cache,
)
from services.router.config import FlowConfig, LimitsConfig
from services.router.types import GenerationDelta, GenerationRequest
from tests.router.conftest import BOUND_S, wait_until
from tests.router.http_helpers import COMPLETION, COMPLETIONS_PATH, EXPECTED
from tests.router.served import serve


class FakePipeline:
    """``stream(request, after)`` as ``GenerationPipeline.stream``: admitted at its first read,
    started once ``after`` (if any) is set; two deltas, ``<id>:a`` then ``<id>:b`` (finished).
    Records when each stream is admitted, starts and closes. A request in ``held`` waits for
    its ``release`` before its first delta; one in ``errors`` raises its error instead; one in
    ``hung`` never sends its last."""

    def __init__(self) -> None:
        self.admitted: list[str] = []
        self.started: list[str] = []
        self.closed: list[str] = []
        self.requests: dict[str, GenerationRequest] = {}
        self.held: set[str] = set()
        self.release = defaultdict(asyncio.Event)
        self.errors: dict[str, Exception] = {}
        self.hung: set[str] = set()

    async def stream(
        self, request: GenerationRequest, after: asyncio.Event | None = None
    ) -> AsyncIterator[GenerationDelta]:
        request_id = request.request_id
        self.admitted.append(request_id)
        try:
            if after is not None:
                await after.wait()
            self.started.append(request_id)
            self.requests[request_id] = request
            if request_id in self.held:
                await self.release[request_id].wait()
            if request_id in self.errors:
                raise self.errors[request_id]
            yield GenerationDelta(f"{request_id}:a")
            if request_id in self.hung:
                await asyncio.sleep(3600)
            yield GenerationDelta(f"{request_id}:b", finish_reason=FinishReason.STOP)
        finally:
            self.closed.append(request_id)


async def settle() -> None:
    """Every ready task runs, several rounds over (a task that could start has started)."""
    for _ in range(20):
        await asyncio.sleep(0)


def seeded(request_id: str = "cmpl-1", **params) -> GenerationRequest:
    return GenerationRequest(request_id, prompt="a", params=SamplingParams(seed=7, **params))


async def test_later_choices_start_once_the_first_choice_s_first_delta_came():
    pipeline = FakePipeline()
    requests = choice_requests(seeded(), 3)
    pipeline.held = {"cmpl-1-0"}
    streams = open_choices(requests, 3, pipeline.stream, one_prefill=True)
    firsts_task = asyncio.ensure_future(each_choice(streams, anext))
    await settle()
    assert pipeline.admitted == ["cmpl-1-0", "cmpl-1-1", "cmpl-1-2"]  # counted in flight
    assert pipeline.started == ["cmpl-1-0"]
    pipeline.release["cmpl-1-0"].set()
    firsts = await asyncio.wait_for(firsts_task, BOUND_S)
    assert pipeline.started == ["cmpl-1-0", "cmpl-1-1", "cmpl-1-2"]
    assert [f.text for f in firsts] == ["cmpl-1-0:a", "cmpl-1-1:a", "cmpl-1-2:a"]
    deltas = [(i, d.text) async for i, d in merged(streams, firsts)]
    assert deltas[:3] == [(0, "cmpl-1-0:a"), (1, "cmpl-1-1:a"), (2, "cmpl-1-2:a")]
    assert sorted(deltas[3:]) == [(0, "cmpl-1-0:b"), (1, "cmpl-1-1:b"), (2, "cmpl-1-2:b")]
    sent = [pipeline.requests[f"cmpl-1-{i}"] for i in range(3)]
    assert sent == requests and [r.params.seed for r in sent] == [7, 8, 9]
    for stream in streams:  # as the front ends close them
        await stream.aclose()
    assert sorted(pipeline.closed) == ["cmpl-1-0", "cmpl-1-1", "cmpl-1-2"]


async def test_later_choices_start_when_the_first_fails_before_its_first_delta():
    pipeline = FakePipeline()
    pipeline.errors = {"cmpl-1-0": UnavailableError("choice 0 failed")}
    streams = open_choices(choice_requests(seeded(), 3), 3, pipeline.stream, one_prefill=True)
    results = await asyncio.wait_for(
        asyncio.gather(*(anext(s) for s in streams), return_exceptions=True), BOUND_S
    )
    assert isinstance(results[0], UnavailableError)
    assert [r.text for r in results[1:]] == ["cmpl-1-1:a", "cmpl-1-2:a"]
    for stream in streams:
        await stream.aclose()
    assert sorted(pipeline.closed) == ["cmpl-1-0", "cmpl-1-1", "cmpl-1-2"]


async def test_a_first_choice_failing_fails_the_response_and_leaves_no_stream_open():
    pipeline = FakePipeline()
    pipeline.errors = {"cmpl-1-0": UnavailableError("choice 0 failed")}
    streams = open_choices(choice_requests(seeded(), 3), 3, pipeline.stream, one_prefill=True)
    with pytest.raises(UnavailableError, match="choice 0 failed"):
        await asyncio.wait_for(each_choice(streams, anext), BOUND_S)
    for stream in streams:  # as gRPC's Generate closes them (HTTP leaves them to be collected)
        await stream.aclose()
    assert sorted(pipeline.closed) == sorted(pipeline.admitted)


async def test_cancelling_before_the_first_delta_starts_no_later_choice():
    pipeline = FakePipeline()
    pipeline.held = {"cmpl-1-0"}
    streams = open_choices(choice_requests(seeded(), 3), 3, pipeline.stream, one_prefill=True)
    firsts_task = asyncio.ensure_future(each_choice(streams, anext))
    await settle()
    firsts_task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await firsts_task
    for stream in streams:  # as the front ends close them
        await stream.aclose()
    assert pipeline.started == ["cmpl-1-0"]
    assert sorted(pipeline.closed) == ["cmpl-1-0", "cmpl-1-1", "cmpl-1-2"]


async def test_cancelling_mid_stream_closes_every_choice():
    pipeline = FakePipeline()
    pipeline.hung = {"cmpl-1-0", "cmpl-1-1", "cmpl-1-2"}
    streams = open_choices(choice_requests(seeded(), 3), 3, pipeline.stream, one_prefill=True)

    async def consume() -> None:
        firsts = await each_choice(streams, anext)
        deltas = merged(streams, firsts)
        try:
            async for _ in deltas:
                pass
        finally:
            await deltas.aclose()

    consumer = asyncio.ensure_future(consume())
    await wait_until(lambda: len(pipeline.started) == 3)
    await settle()
    consumer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await consumer
    for stream in streams:
        await stream.aclose()
    assert sorted(pipeline.closed) == ["cmpl-1-0", "cmpl-1-1", "cmpl-1-2"]


@pytest.mark.parametrize(
    ("one_prefill", "params"),
    [(False, {}), (True, {"num_prompt_logprobs": 0})],
    ids=["prefix-cache-disabled", "prompt-logprobs"],
)
async def test_choices_start_together_when_the_cache_cannot_serve_them(one_prefill, params):
    pipeline = FakePipeline()
    pipeline.held = {"cmpl-1-0"}
    requests = choice_requests(seeded(**params), 3)
    streams = open_choices(requests, 3, pipeline.stream, one_prefill=one_prefill)
    firsts_task = asyncio.ensure_future(each_choice(streams, anext))
    await wait_until(lambda: len(pipeline.started) == 3)
    pipeline.release["cmpl-1-0"].set()
    await asyncio.wait_for(firsts_task, BOUND_S)


def test_prompt_logprobs_read_no_cache():
    assert reads_cache(seeded())
    assert not reads_cache(seeded(num_prompt_logprobs=0))


async def test_each_prompt_of_a_batch_has_its_own_first_choice():
    pipeline = FakePipeline()
    requests = [*choice_requests(seeded("p0"), 2), *choice_requests(seeded("p1"), 2)]
    pipeline.held = {"p0-0", "p1-0"}
    streams = open_choices(requests, 2, pipeline.stream, one_prefill=True)
    firsts_task = asyncio.ensure_future(each_choice(streams, anext))
    await settle()
    assert sorted(pipeline.started) == ["p0-0", "p1-0"]
    pipeline.release["p1-0"].set()
    await wait_until(lambda: "p1-1" in pipeline.started)
    await settle()
    assert "p0-1" not in pipeline.started
    pipeline.release["p0-0"].set()
    firsts = await asyncio.wait_for(firsts_task, BOUND_S)
    assert [f.text for f in firsts] == ["p0-0:a", "p0-1:a", "p1-0:a", "p1-1:a"]


def record_prefills(prefill) -> list[tuple[str, str]]:
    """("start" | "end", request id) of every Prefill the fake worker answers, in order."""
    events: list[tuple[str, str]] = []
    answer = prefill._prefill

    async def recorded(request):
        events.append(("start", request.request_id))
        try:
            return await answer(request)
        finally:
            events.append(("end", request.request_id))

    prefill._prefill = recorded
    return events


async def choices_over_http(served) -> str:
    body = {**COMPLETION, "n": 3, "seed": 5}
    response = await served.http.post(COMPLETIONS_PATH, json=body)
    assert response.status_code == 200, response.text
    assert [c["text"] for c in response.json()["choices"]] == [EXPECTED] * 3
    return response.json()["id"]


async def choices_over_grpc(served) -> str:
    channel = create_channel(f"127.0.0.1:{served.app.grpc_port}")
    try:
        stub = router_pb2_grpc.RouterStub(channel)
        params = common_pb2.SamplingParams(max_new_tokens=100)
        request = router_pb2.GenerateRequest(
            prompt="Once upon", num_choices=3, sampling_params=params
        )
        responses = [r async for r in stub.Generate(request, timeout=BOUND_S)]
    finally:
        await channel.close()
    texts = defaultdict(str)
    for response in responses:
        texts[response.choice_index] += response.text_delta
    assert texts == {0: EXPECTED, 1: EXPECTED, 2: EXPECTED}
    return sorted(served.cluster.decode.reserved)[0].removesuffix("-0")


@pytest.mark.parametrize("front_end", [choices_over_http, choices_over_grpc])
async def test_both_front_ends_prefill_the_first_choice_alone(front_end):
    """The later choices reach prefill once the first's Prefill answered; with
    ``--disable-prefix-cache`` all at once."""
    script_delay_s = 0.05  # each Prefill takes this long: without staggering, all would overlap
    async with serve(FlowConfig()) as served:
        served.cluster.script.prefill_delay_s = script_delay_s
        events = record_prefills(served.cluster.prefill)
        response_id = await front_end(served)
        first = f"{response_id}-0"
        assert events[:2] == [("start", first), ("end", first)]
        assert sorted(events[2:]) == [
            (kind, f"{response_id}-{i}") for kind in ("end", "start") for i in (1, 2)
        ]
    async with serve(FlowConfig(), disable_prefix_cache=True) as served:
        served.cluster.script.prefill_delay_s = script_delay_s
        events = record_prefills(served.cluster.prefill)
        await front_end(served)
        assert [kind for kind, _ in events[:3]] == ["start"] * 3


async def test_later_choices_are_in_flight_from_the_start_so_a_drain_lets_them_run():
    async with serve(FlowConfig()) as served:
        served.cluster.prefill.first_delay_s = 0.2
        events = record_prefills(served.cluster.prefill)
        request = asyncio.ensure_future(choices_over_http(served))
        await wait_until(lambda: bool(events))  # the first choice is at prefill
        served.app.pipeline.tasks.start_drain()  # refuses what it admits from now on
        await asyncio.wait_for(request, BOUND_S)
        assert len(events) == 6


async def test_a_later_choice_s_deadline_counts_its_wait():
    limits = LimitsConfig(request_timeout_s=1.0)
    async with serve(FlowConfig(), limits=limits) as served:
        served.cluster.script.prefill_delay_s = 0.6  # 0.6 s of waiting, then 0.6 s of its own
        body = {**COMPLETION, "n": 2}
        response = await served.http.post(COMPLETIONS_PATH, json=body)
        assert response.status_code == 504, response.text
        assert "passed its deadline of 1 s" in response.json()["error"]["message"]
