"""The whole system through the official ``openai`` client, checked against transformers.

One system (``stageserve up --decode-dp 2 --router-workers 2`` on the bundled tiny model:
two decode ranks, two router processes on one HTTP port) serves every test in this
module; the last test checks that no KV page was lost over all of them.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import json
import random
import re
import time
import types
import urllib.request

import httpx
import jsonschema
import openai
import pytest
import torch

from services.common.paths import BUNDLED_MODEL
from services.common.types import GrammarKind, SamplingParams
from services.engine.grammar import GrammarCache
from services.router.openai_params import response_format
from tests.conftest import INTERNAL_AUTH, image_bytes
from tests.e2e.system import pid_alive, start_system
from tests.engine.test_model_parity import hf_inputs

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
MAX_TOKENS = 32


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def chat(text: str, images: list[bytes] = ()) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": data_url(i)}} for i in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


CASES = {
    "text": ("Tell me about the moon.", []),
    "one_image": ("What is shown here?", [image_bytes(300, 97, seed=11)]),
    "two_images": (
        "Compare the two pictures.",
        [image_bytes(224, 224, seed=12), image_bytes(90, 200, seed=13)],
    ),
}


# dp2: decode as two DP rank processes behind two router processes sharing the port;
# cp2: prefill as two CP rank processes, every batch sharded (--prefill-cp-min-tokens 1)
@pytest.fixture(
    scope="module",
    params=[
        ("--decode-dp", "2", "--router-workers", "2"),
        ("--prefill-cp", "2", "--prefill-cp-min-tokens", "1"),
    ],
    ids=["dp2", "cp2"],
)
def system(request, tmp_path_factory):
    system = start_system(tmp_path_factory.mktemp("system"), "--num-pages", "1024", *request.param)
    yield system
    assert system.stop() == 0
    assert not [pid for pid in system.child_pids() if pid_alive(pid)]


@pytest.fixture(scope="module")
def client(system):
    return openai.OpenAI(base_url=system.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_name(client):
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def initial_free_pages(system):
    return decode_stats(system).num_free_pages


def decode_stats(system):
    from services.common.clients.decode import DecodeClient

    async def stats():
        client = DecodeClient(system.address("decode"), auth=INTERNAL_AUTH)
        try:
            return await client.stats()
        finally:
            await client.close()

    return asyncio.run(stats())


def settled_stats(system, is_settled, timeout_s: float):
    """Decode's stats once ``is_settled(stats)``, else its last ones at the bound."""
    deadline_mono = time.monotonic() + timeout_s
    stats = decode_stats(system)
    while not is_settled(stats) and time.monotonic() < deadline_mono:
        time.sleep(0.2)
        stats = decode_stats(system)
    return stats


def holds_nothing(stats) -> bool:
    return not (stats.num_used_pages or stats.num_running_requests or stats.num_reserved_requests)


def reference(pipeline, hf_model, text: str, images: list[bytes]) -> tuple[str, int, int]:
    """transformers' greedy continuation: (text, completion tokens, prompt tokens)."""
    messages = [
        {
            "role": "user",
            "content": [*({"type": "image"} for _ in images), {"type": "text", "text": text}],
        }
    ]
    request = pipeline.build_request(messages, list(images), SamplingParams())
    with torch.no_grad():
        out = hf_model.generate(**hf_inputs(request), max_new_tokens=MAX_TOKENS, do_sample=False)
    tokens = out[0, len(request.prompt_ids) :].tolist()
    return (
        pipeline.text.decode(tokens, skip_special_tokens=True),
        len(tokens),
        len(request.prompt_ids),
    )


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


def test_sixteen_concurrent_requests(system, model_name, pipeline, hf_model):
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

    async def run():
        client = openai.AsyncOpenAI(
            base_url=system.base_url, api_key="unused", max_retries=0, timeout=300
        )
        calls = [
            client.chat.completions.create(
                model=model_name, messages=chat(t, imgs), max_tokens=MAX_TOKENS, temperature=0
            )
            for t, imgs in prompts
        ]
        try:
            return await asyncio.gather(*calls)
        finally:
            await client.close()

    replies = asyncio.run(run())
    assert [r.choices[0].message.content for r in replies] == expected


def _metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    values = [float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)]
    return sum(values)


def test_both_decode_ranks_and_both_router_processes_served(system, request):
    """After the sixteen concurrent requests: each router process took some, each rank ran some."""
    callspec = getattr(
        request.node, "callspec", None
    )  # absent where a module's system is not parametrized
    if callspec is None or "--decode-dp" not in callspec.params["system"]:
        pytest.skip("one decode rank and one router process in this layout")
    stats = decode_stats(system)
    assert [r.is_serving for r in stats.ranks] == [True, True]
    routers = [name for name in system.state if name.startswith("router")]
    assert sorted(routers) == ["router", "router-2"]
    assert len({system.state[name]["http_port"] for name in routers}) == 1  # one shared HTTP port
    for name in routers:
        assert _metric(system.metrics_url(name), "stageserve_router_requests_total") > 0, name
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
    url = system.metrics_url("vision_encoder")
    names = ("cache_hits", "cache_misses", "images_encoded", "cache_only_spans")
    before = {n: _metric(url, f"stageserve_vision_encoder_{n}_total") for n in names}
    image = image_bytes(150, 150, seed=777)
    for _ in range(2):
        client.chat.completions.create(
            model=model_name, messages=chat("Again?", [image]), max_tokens=2, temperature=0
        )
    after = {n: _metric(url, f"stageserve_vision_encoder_{n}_total") - before[n] for n in names}
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
    "n_two": {"messages": chat("hi"), "n": 2},
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_input_gets_400_and_system_keeps_answering(
    case, system, client, model_name, pipeline, hf_model
):
    body = BAD_REQUESTS[case]
    if isinstance(body, dict):
        body = {"model": model_name, **body}
        response = httpx.post(f"{system.base_url}/chat/completions", json=body, timeout=120)
    else:
        response = httpx.post(
            f"{system.base_url}/chat/completions",
            content=body,
            headers={"content-type": "application/json"},
            timeout=120,
        )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
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
    assert httpx.get(f"http://127.0.0.1:{system.http_port}/health", timeout=10).status_code == 200


def test_aborted_stream_frees_pages(system, client, model_name, initial_free_pages):
    stream = client.chat.completions.create(
        model=model_name,
        messages=chat("Go on and on."),
        max_tokens=1000,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    stats = settled_stats(system, holds_nothing, 60)
    assert holds_nothing(stats), stats
    # every page is back, but those of earlier failed reservations, resting in quarantine
    assert stats.num_free_pages + stats.num_quarantined_pages == initial_free_pages


LOGPROB_TOLERANCE = 1e-4  # fp32 on both sides


def reference_logprobs(hf_model, prompt_ids: list[int], max_new_tokens: int):
    """transformers' greedy tokens after ``prompt_ids`` and the log-softmax at each of them."""
    with torch.no_grad():
        out = hf_model.generate(
            input_ids=torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False
        )
        logits = hf_model(input_ids=out[:, :-1]).logits[0].float()
    tokens = out[0, len(prompt_ids) :].tolist()
    return tokens, logits[len(prompt_ids) - 1 :].log_softmax(dim=-1)  # [len(tokens), V]


def check_token_logprobs(pipeline, tokens, reference, got, num_top):
    """``got``: (bytes, logprob, [(bytes, logprob)] top) per token, as the API returned them."""
    token_bytes = pipeline.text.token_bytes
    assert len(got) == len(tokens)
    for i, (token_id, (raw, logprob, top)) in enumerate(zip(tokens, got, strict=True)):
        assert raw == token_bytes(token_id), i
        assert abs(logprob - reference[i, token_id].item()) < LOGPROB_TOLERANCE, i
        values, ids = reference[i].topk(num_top)
        assert [t for t, _ in top] == [token_bytes(t) for t in ids.tolist()], i
        assert all(
            abs(a - b) < LOGPROB_TOLERANCE for (_, a), b in zip(top, values.tolist(), strict=True)
        )
        assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
        assert top[0] == (raw, logprob)  # greedy: the sampled token leads


def chat_entries(content) -> list:
    return [
        (bytes(c.bytes), c.logprob, [(bytes(t.bytes), t.logprob) for t in c.top_logprobs])
        for c in content
    ]


def test_chat_logprobs_match_transformers(client, model_name, pipeline, hf_model):
    text = "Tell me about the moon."
    request = pipeline.build_request(
        [{"role": "user", "content": [{"type": "text", "text": text}]}], [], SamplingParams()
    )
    tokens, reference = reference_logprobs(hf_model, list(request.prompt_ids), 8)
    call = dict(model=model_name, messages=chat(text), max_tokens=8, temperature=0)
    reply = client.chat.completions.create(**call, logprobs=True, top_logprobs=5)
    content = reply.choices[0].logprobs.content
    check_token_logprobs(pipeline, tokens, reference, chat_entries(content), 5)
    stream = client.chat.completions.create(**call, logprobs=True, top_logprobs=5, stream=True)
    streamed = [
        e
        for c in stream
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert chat_entries(streamed) == chat_entries(content)
    assert client.chat.completions.create(**call).choices[0].logprobs is None


def test_completion_logprobs_match_transformers(system, client, model_name, pipeline, hf_model):
    prompt = "Once upon a time"
    tokenized = httpx.post(
        f"http://127.0.0.1:{system.http_port}/tokenize", json={"prompt": prompt}, timeout=30
    )
    prompt_ids = tokenized.json()["tokens"]
    tokens, reference = reference_logprobs(hf_model, prompt_ids, 6)
    reply = client.completions.create(
        model=model_name, prompt=prompt, max_tokens=6, temperature=0, logprobs=3
    )
    logprobs = reply.choices[0].logprobs
    token_bytes = pipeline.text.token_bytes
    as_text = [token_bytes(t).decode("utf-8", errors="replace") for t in tokens]
    assert logprobs.tokens == as_text
    assert logprobs.text_offset == [sum(map(len, as_text[:i])) for i in range(len(tokens))]
    for i, token_id in enumerate(tokens):
        assert abs(logprobs.token_logprobs[i] - reference[i, token_id].item()) < LOGPROB_TOLERANCE
        values, ids = reference[i].topk(3)
        top = logprobs.top_logprobs[i]
        assert list(top) == [token_bytes(t).decode("utf-8", errors="replace") for t in ids.tolist()]
        assert all(
            abs(a - b) < LOGPROB_TOLERANCE
            for a, b in zip(top.values(), values.tolist(), strict=True)
        )


ECHO_PROMPT = " ".join(f"The {i}th cat sat on the mat." for i in range(20))


def test_echo_logprobs_match_transformers(system, model_name, pipeline, hf_model):
    # ~200 tokens: under cp2 the prompt spans both ranks' blocks
    tokenize = f"http://127.0.0.1:{system.http_port}/tokenize"
    ids = httpx.post(tokenize, json={"prompt": ECHO_PROMPT}, timeout=30)
    prompt_ids = ids.json()["tokens"]
    with torch.no_grad():
        logits = hf_model(input_ids=torch.tensor([prompt_ids])).logits[0].float()
    reference = logits.log_softmax(dim=-1)  # [n, V]: row i predicts token i + 1
    body = dict(
        model=model_name, prompt=ECHO_PROMPT, max_tokens=1, temperature=0, echo=True, logprobs=2
    )
    url = f"{system.base_url}/completions"
    reply = httpx.post(url, json={**body, "prompt_logprobs": 3}, timeout=120).json()
    choice = reply["choices"][0]
    token_bytes = pipeline.text.token_bytes
    n = len(prompt_ids)
    as_text = [token_bytes(t).decode("utf-8", errors="replace") for t in prompt_ids]
    got = choice["logprobs"]
    assert got["tokens"][:n] == as_text and len(got["tokens"]) == n + 1
    assert got["token_logprobs"][0] is None and got["top_logprobs"][0] is None
    assert got["text_offset"][: n + 1] == [sum(map(len, as_text[:i])) for i in range(n + 1)]
    generated = int(reference[n - 1].argmax())
    for i, token_id in enumerate([*prompt_ids[1:], generated], start=1):
        assert abs(got["token_logprobs"][i] - reference[i - 1, token_id].item()) < 1e-4, i
        values, top_ids = reference[i - 1].topk(2)
        top = got["top_logprobs"][i]
        assert list(top) == [token_bytes(t).decode("utf-8", errors="replace") for t in top_ids]
        assert all(abs(a - b) < 1e-4 for a, b in zip(top.values(), values.tolist(), strict=True))
    assert choice["text"].startswith(ECHO_PROMPT)
    vllm = choice["prompt_logprobs"]
    assert vllm[0] is None and len(vllm) == n
    for i, entry in enumerate(vllm[1:], start=1):
        values, top_ids = reference[i - 1].topk(3)
        wanted = {*map(str, top_ids.tolist()), str(prompt_ids[i])}
        assert set(entry) == wanted, i
        for token_id, value in entry.items():
            assert abs(value["logprob"] - reference[i - 1, int(token_id)].item()) < 1e-4
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: {")]
    streamed = [json.loads(e)["choices"][0]["logprobs"] for e in events]
    assert streamed[0]["token_logprobs"] == got["token_logprobs"][:n]
    assert streamed[1]["text_offset"] == got["text_offset"][n:]


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        ("completions", {"prompt_logprobs": 21}, "prompt_logprobs"),
        ("completions", {"prompt_logprobs": -1}, "prompt_logprobs"),
        ("completions", {"echo": True, "logprobs": 21}, "logprobs"),
        ("completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ("completions", {"echo": True, "max_tokens": 0}, "max_tokens"),
        ("chat/completions", {"prompt_logprobs": 1}, "prompt_logprobs"),
    ],
)
def test_bad_prompt_logprobs_are_a_400(system, model_name, path, extra, param):
    body = {"model": model_name, "max_tokens": 1, **extra}
    if path == "completions":
        body["prompt"] = "Hello"
    else:
        body["messages"] = chat("Hello")
    response = httpx.post(f"{system.base_url}/{path}", json=body, timeout=120)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    kinds = ["enum", "integer", "number", "boolean", "string"]
    kind = rng.choice(kinds + (["object", "array"] if depth < 2 else []))
    if kind == "object":
        names = rng.sample(["a", "b", "c", "id", "name", "tags"], rng.randint(1, 3))
        properties = {n: random_schema(rng, depth + 1) for n in names}
        return {
            "type": "object",
            "properties": properties,
            "required": names[: rng.randint(0, len(names))],
            "additionalProperties": False,
        }
    if kind == "array":
        low = rng.randint(0, 2)
        items = random_schema(rng, depth + 1)
        return {"type": "array", "items": items, "minItems": low, "maxItems": low + 2}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 7, True, None], 3)}
    if kind in ("integer", "number"):
        low = rng.randint(-50, 50)
        return {"type": kind, "minimum": low, "maximum": low + rng.randint(0, 100)}
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 8)}
    return {"type": "boolean"}


def check_structured(grammar_cache, grammar, choice) -> None:
    text = choice.message.content
    if choice.finish_reason == "length":
        assert grammar_cache.matcher(grammar).accept_string(text), text
        return
    assert choice.finish_reason == "stop", choice.finish_reason
    value = json.loads(text)
    if grammar.kind is GrammarKind.JSON_SCHEMA:
        jsonschema.validate(value, json.loads(grammar.spec))
    else:
        assert isinstance(value, dict)


@pytest.fixture(scope="module")
def grammar_cache():
    return GrammarCache(BUNDLED_MODEL)


def test_json_schemas_hold_at_temperature_one(system, client, model_name, grammar_cache):
    rng = random.Random(39)
    schemas = [random_schema(rng) for _ in range(40)]
    schemas = [s for s in schemas if s.get("type") == "object"][:10]
    formats = [
        {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": s, "strict": True}}
        for i, s in enumerate(schemas)
    ] + [{"type": "json_object"}] * 2

    def ask(fmt: dict):
        reply = client.chat.completions.create(
            model=model_name,
            messages=chat("Reply in JSON.", []),
            max_tokens=96,
            temperature=1.0,
            response_format=fmt,
        )
        return response_format(fmt), reply.choices[0]

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(ask, formats))
    for grammar, choice in results:
        check_structured(grammar_cache, grammar, choice)
    assert any(choice.finish_reason == "stop" for _, choice in results)


def test_json_object_streams_with_an_image(client, model_name, grammar_cache):
    text, images = CASES["one_image"]
    fmt = {"type": "json_object"}
    stream = client.chat.completions.create(
        model=model_name,
        messages=chat(text, images),
        max_tokens=64,
        temperature=1.0,
        seed=5,
        response_format=fmt,
        stream=True,
    )
    chunks = [c for c in stream if c.choices]
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    reason = chunks[-1].choices[0].finish_reason
    message = types.SimpleNamespace(content=content)
    check_structured(
        grammar_cache,
        response_format(fmt),
        types.SimpleNamespace(message=message, finish_reason=reason),
    )


@pytest.mark.parametrize(
    "schema",
    [{"type": "no-such-type"}, {"properties": {"a": {"$ref": "#/nowhere"}}}, "nested"],
)
def test_bad_schema_is_a_400_naming_response_format(system, model_name, schema):
    if schema == "nested":
        schema = {"type": "object"}
        for _ in range(40):
            schema = {"type": "array", "items": schema}
    fmt = {"type": "json_schema", "json_schema": {"name": "bad", "schema": schema}}
    body = {"model": model_name, "messages": chat("hi"), "response_format": fmt}
    response = httpx.post(f"{system.base_url}/chat/completions", json=body, timeout=120)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "response_format"


WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo"]}, "metric": {"type": "boolean"}},
    "required": ["city"],
}
TIME_PARAMETERS = {  # bounded, so a sampled call ends well within max_tokens
    "type": "object",
    "properties": {"zone": {"type": "string", "maxLength": 8}},
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMETERS}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME_PARAMETERS}},
]


def only_on_dp2(request) -> None:
    callspec = getattr(request.node, "callspec", None)
    if callspec is None or "--decode-dp" not in callspec.params["system"]:
        pytest.skip("tools run once, on the dp2 layout")


def test_required_and_named_tool_calls_follow_the_tools(request, client, model_name):
    only_on_dp2(request)
    named = {"type": "function", "function": {"name": "get_weather"}}
    choices = [("required", False)] * 3 + [(named, True)] * 3

    def ask(choice) -> tuple:
        reply = client.chat.completions.create(
            model=model_name,
            messages=chat("What is the weather in Oslo?"),
            max_tokens=96,
            temperature=1.0,
            tools=TOOLS,
            tool_choice=choice[0],
            parallel_tool_calls=choice[1],
        )
        return choice[0], reply.choices[0]

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        results = list(pool.map(ask, choices))
    for tool_choice, choice in results:
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None
        [call] = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        if tool_choice is named:
            assert call.function.name == "get_weather"
        parameters = {"get_weather": WEATHER_PARAMETERS, "get_time": TIME_PARAMETERS}
        jsonschema.validate(json.loads(call.function.arguments), parameters[call.function.name])


def test_a_tool_result_turn_is_answered(request, client, model_name):
    only_on_dp2(request)
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
    }
    messages = [
        *chat("What is the weather in Oslo?"),
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Rain, 8 degrees."},
    ]
    reply = client.chat.completions.create(
        model=model_name, messages=messages, max_tokens=8, temperature=0.0, tools=TOOLS
    )
    choice = reply.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert reply.usage.prompt_tokens > 100  # the tools and the tool turns are in the prompt


def test_stream_with_tools_is_a_400(request, system, model_name):
    only_on_dp2(request)
    body = {"model": model_name, "messages": chat("hi"), "tools": TOOLS, "stream": True}
    response = httpx.post(f"{system.base_url}/chat/completions", json=body, timeout=120)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "stream"


def test_zz_no_kv_page_is_lost(system, initial_free_pages):
    # An aborted stream's pages come back asynchronously; those of a reservation that failed
    # before its KV was ready (a prefill error) only after decode's quarantine (35 s).
    stats = settled_stats(
        system,
        lambda s: not s.num_quarantined_pages and s.num_free_pages == initial_free_pages,
        90,
    )
    assert stats.num_quarantined_pages == 0
    assert stats.num_free_pages == initial_free_pages
