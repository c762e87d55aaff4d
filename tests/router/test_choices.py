"""``n`` choices over fake workers: one generation per choice (ids ``<id>-<i>``, seeds
``seed + i``), each its own choice; usage counts the prompt once; the first choice that fails
fails the response and the others are aborted on decode."""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from collections.abc import AsyncIterator

import pytest

from services.common.errors import UnavailableError
from services.common.types import SamplingParams
from services.common.wire import sampling_params_from_proto
from services.router.choices import choice_requests, each_choice
from services.router.config import FlowConfig, LimitsConfig
from services.router.types import GenerationRequest
from tests.router.conftest import BOUND_S, wait_until
from tests.router.fakes import TEXT
from tests.router.http_helpers import (
    CHAT,
    CHAT_PATH,
    COMPLETION,
    COMPLETIONS_PATH,
    EXPECTED,
    assert_400,
    prompt_len,
    sse_events,
)
from tests.router.served import Served, serve

PATIENT_S = 3600.0


def test_each_choice_has_its_id_and_seed_and_one_choice_is_the_request():
    generation = GenerationRequest("cmpl-1", prompt="a", params=SamplingParams(seed=2**64 - 2))
    choices = choice_requests(generation, 3)
    assert [c.request_id for c in choices] == ["cmpl-1-0", "cmpl-1-1", "cmpl-1-2"]
    assert [c.params.seed for c in choices] == [2**64 - 2, 2**64 - 1, 0]
    assert all(c.prompt == "a" for c in choices)
    assert choice_requests(generation, 1) == [generation]
    unseeded = choice_requests(GenerationRequest("cmpl-2", prompt="a"), 2)
    assert [c.params.seed for c in unseeded] == [None, None]


async def test_the_first_failed_choice_is_raised_and_the_others_are_closed():
    closed = []

    async def deltas(index: int):
        try:
            if index == 1:
                raise UnavailableError("choice 1 failed")
            await asyncio.sleep(3600)
            yield index
        finally:
            closed.append(index)

    with pytest.raises(UnavailableError, match="choice 1 failed"):
        await asyncio.wait_for(each_choice([deltas(i) for i in range(3)], anext), BOUND_S)
    assert sorted(closed) == [0, 1, 2]


@pytest.fixture
async def patient() -> AsyncIterator[Served]:
    """A router whose requests neither stall nor pass their deadline within the tests' bound:
    a choice left running ends only when the router cancels it."""
    flow = FlowConfig(stall_timeout_s=PATIENT_S)
    async with serve(flow, limits=LimitsConfig(request_timeout_s=PATIENT_S)) as served:
        yield served


def reserved_seeds(cluster) -> dict[str, int | None]:
    return {
        request_id: sampling_params_from_proto(r.sampling_params).seed
        for request_id, r in cluster.decode.reserved.items()
    }


async def test_chat_choices_share_the_prompt_and_sum_the_completions(http, cluster):
    response = await http.post(CHAT_PATH, json={**CHAT, "n": 3, "temperature": 0, "seed": 5})
    assert response.status_code == 200, response.text
    body = response.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert all(c["message"]["content"] == EXPECTED for c in body["choices"])
    num_completion = len(cluster.script.output_ids)
    assert body["usage"]["prompt_tokens"] == prompt_len(cluster)
    assert body["usage"]["completion_tokens"] == 3 * num_completion
    seeds = reserved_seeds(cluster)
    assert sorted(seeds.values()) == [5, 6, 7]
    assert sorted(seeds) == [f"{body['id']}-{i}" for i in range(3)]
    assert not cluster.aborted()  # decode finished every choice itself


async def test_without_a_seed_no_choice_gets_one(http, cluster):
    response = await http.post(COMPLETIONS_PATH, json={**COMPLETION, "n": 2, "max_tokens": 3})
    assert response.status_code == 200, response.text
    assert [c["text"] for c in response.json()["choices"]] == [EXPECTED[:3]] * 2
    assert list(reserved_seeds(cluster).values()) == [None, None]


def by_choice(chunks: list[dict]) -> dict[int, list[dict]]:
    grouped = defaultdict(list)
    for chunk in chunks:
        for choice in chunk["choices"]:
            grouped[choice["index"]].append(choice)
    return grouped


async def test_streamed_choices_carry_their_index(http, cluster):
    cluster.script.chunk_size = 1
    body = {**CHAT, "n": 2, "stream": True, "stream_options": {"include_usage": True}}
    response = await http.post(CHAT_PATH, json=body)
    assert response.status_code == 200, response.text
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(len(c["choices"]) <= 1 for c in chunks)
    grouped = by_choice(chunks)
    assert sorted(grouped) == [0, 1]
    for choices in grouped.values():
        assert choices[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["delta"].get("content", "") for c in choices) == EXPECTED
        assert [c["finish_reason"] for c in choices if c["finish_reason"]] == ["stop"]
        assert choices[-1]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == []
    usage = chunks[-1]["usage"]
    assert usage["prompt_tokens"] == prompt_len(cluster)
    assert usage["completion_tokens"] == 2 * len(cluster.script.output_ids)


@pytest.mark.parametrize("stream", [False, True])
async def test_echoed_completion_choices(http, cluster, stream):
    body = {**COMPLETION, "n": 2, "max_tokens": 5, "echo": True, "stream": stream}
    response = await http.post(COMPLETIONS_PATH, json=body)
    assert response.status_code == 200, response.text
    if stream:
        chunks = [json.loads(e) for e in sse_events(response.text)[:-1]]
        texts = {i: "".join(c["text"] for c in cs) for i, cs in by_choice(chunks).items()}
    else:
        texts = {c["index"]: c["text"] for c in response.json()["choices"]}
    assert texts == {0: "Once upon" + EXPECTED[:5], 1: "Once upon" + EXPECTED[:5]}


@pytest.mark.parametrize("stream", [False, True])
async def test_a_choice_failing_before_its_first_token_fails_the_request(patient, stream):
    cluster = patient.cluster
    cluster.decode.release.clear()  # the other choices wait before decode's first message
    cluster.decode.reserve_errors = [UnavailableError("decode is restarting")]
    body = {**CHAT, "n": 3, "stream": stream}
    response = await asyncio.wait_for(patient.http.post(CHAT_PATH, json=body), BOUND_S)
    assert response.status_code == 503, response.text
    assert "decode is restarting" in response.json()["error"]["message"]
    await wait_until(lambda: set(cluster.decode.reserved) <= set(cluster.aborted()))


async def test_a_choice_failing_mid_stream_ends_the_stream_and_aborts_the_others(patient):
    cluster = patient.cluster
    cluster.decode.release.clear()
    cluster.decode.hang_after = 2  # the other choices never finish by themselves
    body = {**CHAT, "n": 3, "stream": True}
    request = asyncio.ensure_future(patient.http.post(CHAT_PATH, json=body))
    await wait_until(lambda: len(cluster.decode.reserved) == 3)
    failing = sorted(cluster.decode.reserved)[1]
    cluster.decode.ended.add(failing)  # decode ends it with an error at its first message
    cluster.decode.release.set()
    response = await asyncio.wait_for(request, BOUND_S)
    assert response.status_code == 200, response.text
    events = sse_events(response.text)
    assert events[-1] == "[DONE]" and "error" in json.loads(events[-2])
    others = set(cluster.decode.reserved) - {failing}
    await wait_until(lambda: others <= set(cluster.aborted()))


async def test_temperature_zero_gives_identical_choices(http, cluster):
    response = await http.post(COMPLETIONS_PATH, json={**COMPLETION, "n": 8, "temperature": 0})
    assert response.status_code == 200, response.text
    texts = [c["text"] for c in response.json()["choices"]]
    assert texts == [TEXT.decode(cluster.script.output_ids[:-1])] * 8


async def test_max_n_bounds_n():
    limits = LimitsConfig(request_timeout_s=BOUND_S, max_n=2)
    async with serve(FlowConfig(), limits=limits) as served:
        message = await assert_400(served.http, CHAT_PATH, {**CHAT, "n": 3}, "n")
        assert message == "n must be <= 2 (this server's --max-n), got 3"
        ok = await served.http.post(CHAT_PATH, json={**CHAT, "n": 2, "max_tokens": 2})
        assert ok.status_code == 200, ok.text
