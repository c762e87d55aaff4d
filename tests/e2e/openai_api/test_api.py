"""Chat and text completions, models and health, checked against transformers: outputs,
usage, concurrency, both router processes and decode ranks, the encoder's cache, bad input
and an aborted stream."""

from __future__ import annotations

import re
import urllib.request

import pytest

from services.launch_config import LaunchConfig
from tests.conftest import image_bytes
from tests.e2e.openai_api.helpers import (
    CASES,
    MAX_TOKENS,
    assert_400,
    chat,
    create_concurrently,
    decode_stats,
    holds_nothing,
    only_on,
    reference,
    settled_stats,
)
from tests.e2e.system import endless_stream

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PAGE = LaunchConfig.page_size  # the package's systems run up's default --page-size


@pytest.mark.parametrize("name", sorted(CASES))
def test_chat_matches_transformers(
    name, client, model_name, pipeline, hf_model, initial_free_pages
):
    text, images = CASES[name]
    expected, num_completion, num_prompt = reference(pipeline, hf_model, text, images)
    reply = client.chat.completions.create(
        model=model_name, messages=chat(text, images), max_tokens=MAX_TOKENS, temperature=0
    )
    assert reply.choices[0].message.content == expected
    assert reply.choices[0].finish_reason == ("length" if num_completion == MAX_TOKENS else "stop")
    assert reply.usage.prompt_tokens == num_prompt
    assert reply.usage.completion_tokens == num_completion
    assert reply.usage.total_tokens == num_prompt + num_completion

    stream = client.chat.completions.create(
        model=model_name,
        messages=chat(text, images),
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == expected
    assert [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ] == [reply.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == num_completion
    assert chunks[-1].usage.prompt_tokens == num_prompt


def test_sixteen_concurrent_requests(client, model_name, pipeline, hf_model):
    prompts = [
        (
            f"Request number {i}: say something about {w}.",
            [image_bytes(60 + 20 * i, 50 + 10 * i, seed=100 + i)] if i % 3 else [],
        )
        for i, w in enumerate(
            (
                "the sea,a tree,the sky,a cat,rain,a road,snow,a bird,fire,a lamp,ice,a door,sand,"
                "a ship,wind,a star"
            ).split(",")
        )
    ]
    expected = [reference(pipeline, hf_model, t, imgs)[0] for t, imgs in prompts]
    calls = [
        dict(
            model=model_name,
            messages=chat(t, imgs),
            max_tokens=MAX_TOKENS,
            temperature=0,
            timeout=300,
        )
        for t, imgs in prompts
    ]
    replies = create_concurrently(client, calls, len(calls))
    assert [r.choices[0].message.content for r in replies] == expected


def test_both_decode_ranks_and_both_router_processes_served(system, request):
    """After the sixteen concurrent requests: each router process took some, each rank ran some."""
    only_on(request, "dp2", "one decode rank and one router process in this layout")
    stats = decode_stats(system)
    assert [r.is_serving for r in stats.ranks] == [True, True]
    routers = [name for name in system.state if name.startswith("router")]
    assert sorted(routers) == ["router", "router-2"]
    assert len({system.state[name]["http_port"] for name in routers}) == 1  # one shared HTTP port
    for name in routers:
        assert system.metric(name, "stageserve_router_requests_total") > 0, name
    text = urllib.request.urlopen(system.metrics_url("decode"), timeout=10).read().decode()
    steps = {
        m.group(1): float(m.group(2))
        for m in re.finditer(
            r'^stageserve_decode_steps_total{[^}]*dp_rank="(\d+)"[^}]*} (\S+)$', text, re.M
        )
    }
    assert sorted(steps) == ["0", "1"] and min(steps.values()) > 0, steps


def test_same_image_twice_is_encoded_once(system, client, model_name):
    """The router prefetches the first request's image into the encoder's cache (a cache_only
    call); prefill's Encode finds it there, or encodes it itself had it come first: either
    way one ViT run for both requests, two lookups by prefill, one prefetch."""
    names = ("cache_hits", "cache_misses", "images_encoded", "cache_only_spans")

    def counts() -> dict[str, float]:
        return {
            n: system.metric("vision_encoder", f"stageserve_vision_encoder_{n}_total")
            for n in names
        }

    before = counts()
    image = image_bytes(150, 150, seed=777)
    for _ in range(2):
        client.chat.completions.create(
            model=model_name, messages=chat("Again?", [image]), max_tokens=2, temperature=0
        )
    after = {n: value - before[n] for n, value in counts().items()}
    assert after["images_encoded"] == 1
    assert after["cache_hits"] + after["cache_misses"] == 2 and after["cache_hits"] >= 1
    # one per router process that saw the image (a process remembers what it got cached)
    assert 1 <= after["cache_only_spans"] <= 2


BAD_REQUESTS = {
    "malformed_json": b'{"model": "x", "messages": [',
    "missing_messages": {"max_tokens": 4},
    "unknown_model": {"model": "no-such-model", "messages": chat("hi")},
    "not_an_image": {"messages": chat("hi", [b"this is text, not an image"])},
    "image_too_large": {"messages": chat("hi", [b"\x89PNG" + bytes(21 * 1024 * 1024)])},
    "prompt_too_long": {"messages": chat("7" * 5000)},
    "max_tokens_zero": {"messages": chat("hi"), "max_tokens": 0},
    "max_tokens_negative": {"messages": chat("hi"), "max_tokens": -3},
    "temperature_negative": {"messages": chat("hi"), "temperature": -0.5},
    "unknown_role": {"messages": [{"role": "wizard", "content": "hi"}]},
    "n_over_max_n": {"messages": chat("hi"), "n": 9},
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_input_gets_400_and_system_keeps_answering(
    case, system, client, model_name, pipeline, hf_model
):
    body = BAD_REQUESTS[case]
    if isinstance(body, dict):
        body = {"model": model_name, **body}
    error = assert_400(system, "chat/completions", body)
    assert error["message"] and error["type"] == "invalid_request_error"
    text, images = CASES["one_image"]
    reply = client.chat.completions.create(
        model=model_name, messages=chat(text, images), max_tokens=MAX_TOKENS, temperature=0
    )
    assert reply.choices[0].message.content == reference(pipeline, hf_model, text, images)[0]


def test_completions_and_models(system, client, model_name):
    assert [m.id for m in client.models.list().data] == [model_name]
    reply = client.completions.create(
        model=model_name, prompt="Once upon a time", max_tokens=5, temperature=0
    )
    assert reply.usage.completion_tokens <= 5 and reply.choices[0].finish_reason in (
        "stop",
        "length",
    )
    assert system.health() == 200


def test_aborted_stream_frees_pages(system, client, model_name, initial_free_pages):
    stream = endless_stream(client, model_name, chat("Go on and on."), 1000)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    stats = settled_stats(system, holds_nothing, 60)
    assert holds_nothing(stats), stats
    # every page is back, but those of earlier failed reservations, resting in quarantine
    assert stats.num_free_pages + stats.num_quarantined_pages == initial_free_pages


# Its own text (no other request starts with it): choice 0 of the first request reads none of
# it from prefill's prefix cache; a few pages long.
N_PROMPT = (
    "Four sailors sat by the harbor lamp and each told the story of the storm that had "
    "carried their ship past the lighthouse, the reef and the sleeping town, until dawn:"
)
PREFIX_HITS = "stageserve_prefill_prefix_cache_hits_total"


def test_n_choices_are_seeded_apart_repeat_and_share_one_prefill(system, client, model_name):
    """Choice i of n is what one choice with seed + i gives: the choices differ, yet repeat;
    choices 1.. read the prompt choice 0 prefilled from prefill's prefix cache (every full
    page but the last token's); decode gets every page back; streamed, each chunk names its
    choice; usage counts the prompt once."""
    call = dict(model=model_name, prompt=N_PROMPT, max_tokens=16, temperature=1.0)
    hits = system.metric("prefill", PREFIX_HITS)
    reply = client.completions.create(**call, n=4, seed=7)
    num_prompt = reply.usage.prompt_tokens
    reused = (num_prompt - 1) // PAGE * PAGE  # per later choice
    assert reused >= 2 * PAGE
    assert system.metric("prefill", PREFIX_HITS) - hits == 3 * reused
    assert reply.usage.prompt_tokens_details.cached_tokens == 0  # choice 0's: the prompt's
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    texts = [c.text for c in reply.choices]
    singles = [client.completions.create(**call, seed=7 + i) for i in range(4)]
    assert texts == [s.choices[0].text for s in singles]
    assert len(set(texts)) == 4
    assert reply.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert reply.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    streamed = dict.fromkeys(range(4), "")
    for chunk in client.completions.create(**call, n=4, seed=7, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert list(streamed.values()) == texts
    stats = settled_stats(system, holds_nothing, 60)
    assert holds_nothing(stats), stats
