"""Bounded, deterministic fuzzing of the HTTP API (in process, fake workers, fake network).

Bodies follow the shapes of the served OpenAPI schema's request bodies, with fields
replaced by hostile values: huge, negative, NaN and infinite numbers, wrong types, lone
surrogates and line separators, deep nesting, long strings (some over the body limit),
and raw byte soup. Whatever comes in: never a 5xx, and every error is an OpenAI error.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.router.image_fetch import GuardedBackend
from services.router.images import ImageLoader
from tests.router.conftest import MODEL_NAME, asgi_client, router_config, start_router, stop_router
from tests.router.net_fakes import PUBLIC_IP, FakeNetwork, FakeResolver, http_response

MAX_REQUEST_BYTES = 128 * 1024
PATHS = ("/v1/chat/completions", "/v1/completions")
TOKEN_PATHS = ("/tokenize", "/detokenize")
NUMBER_FIELDS = (
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "n",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "logprobs",
    "min_tokens",
    "best_of",
    "top_logprobs",
)

HOSTILE_NUMBERS = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, -1, 1, 2**31, 2**32, 2**63, 2**64, 10**30, 2**31 - 1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([float("nan"), float("inf"), float("-inf"), 1e308, -1e308, 5e-324, 1.5, -0.0]),
)
HOSTILE_CHARS = ["\ud800", "\udfff", "\u2028", "\u2029", "\x85", "\x00", "\ufeff", "\U0010ffff"]
HOSTILE_TEXT = st.one_of(
    st.text(max_size=24),
    st.tuples(st.text(max_size=6), st.sampled_from(HOSTILE_CHARS), st.text(max_size=6)).map(
        "".join
    ),
    st.sampled_from(["", "<|im_start|>", "<|image_pad|>", "gpt-4", MODEL_NAME]),
    st.integers(min_value=1, max_value=200_000).map(lambda n: "x" * n),  # some over the body limit
)
SCALARS = st.one_of(st.none(), st.booleans(), HOSTILE_NUMBERS, HOSTILE_TEXT)
HOSTILE = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
DEEP = st.integers(min_value=2, max_value=300).map(lambda depth: _nested(depth))

IMAGE_URLS = st.sampled_from(
    [
        "data:image/png;base64,iVBORw0KGgo=",
        "data:image/png;base64,@@@",
        "data:text/plain;base64,aGk=",
        "http://169.254.169.254/latest/meta-data/",
        "http://[::1]:9/",
        "http://images.test/cat.png",
        "http://nowhere.test/x",
        "ftp://x/y",
        "file:///etc/passwd",
        "http://",
        "http://[::ffff:10.0.0.1]/",
    ]
)


@st.composite
def mutated(
    draw: st.DrawFn, base: dict[str, Any], values: dict[str, st.SearchStrategy]
) -> dict[str, Any]:
    """``base`` (valid) with one to three of its keys set to values drawn from ``values``, or
    dropped."""
    out = dict(base)
    for name in draw(
        st.lists(st.sampled_from(sorted(values)), min_size=1, max_size=3, unique=True)
    ):
        if draw(st.integers(0, 9)) == 0:
            out.pop(name, None)
        else:
            out[name] = draw(values[name])
    return out


PART = st.one_of(
    mutated(
        {"type": "text", "text": "hi"},
        {
            "type": st.one_of(st.sampled_from(["image_url", "audio"]), HOSTILE),
            "text": st.one_of(HOSTILE_TEXT, HOSTILE),
        },
    ),
    mutated(
        {"type": "image_url", "image_url": {"url": "http://images.test/cat.png"}},
        {"image_url": st.one_of(st.fixed_dictionaries({"url": IMAGE_URLS}), IMAGE_URLS, HOSTILE)},
    ),
)
MESSAGE = mutated(
    {"role": "user", "content": "hi"},
    {
        "role": st.one_of(st.sampled_from(["system", "assistant", "developer", "tool"]), HOSTILE),
        "content": st.one_of(HOSTILE_TEXT, st.lists(PART, min_size=1, max_size=3), HOSTILE, DEEP),
        "name": HOSTILE,
    },
)
FIELD_VALUES = {
    **dict.fromkeys(NUMBER_FIELDS, st.one_of(HOSTILE_NUMBERS, HOSTILE)),
    "model": st.one_of(st.just(MODEL_NAME), HOSTILE),
    "stop": st.one_of(HOSTILE_TEXT, st.lists(HOSTILE_TEXT, max_size=6), HOSTILE),
    "stream": st.one_of(st.booleans(), HOSTILE),
    "stream_options": st.one_of(
        st.fixed_dictionaries({"include_usage": st.one_of(st.booleans(), HOSTILE)}), HOSTILE
    ),
    "ignore_eos": st.one_of(st.booleans(), HOSTILE),
    "user": HOSTILE,
    "messages": st.one_of(st.lists(MESSAGE, min_size=1, max_size=3), HOSTILE, DEEP),
    "prompt": st.one_of(HOSTILE_TEXT, st.lists(HOSTILE_TEXT, max_size=2), HOSTILE, DEEP),
    "logit_bias": st.one_of(
        st.dictionaries(
            st.one_of(st.integers(-5, 3000).map(str), HOSTILE_TEXT),
            st.one_of(HOSTILE_NUMBERS, HOSTILE),
            max_size=4,
        ),
        HOSTILE,
    ),
    "stop_token_ids": st.one_of(st.lists(HOSTILE_NUMBERS, max_size=4), HOSTILE),
    "echo": st.one_of(st.booleans(), HOSTILE),
    "response_format": st.one_of(
        st.sampled_from([{"type": "text"}, {"type": "json_object"}]), HOSTILE
    ),
    "tools": HOSTILE,
    "suffix": st.one_of(HOSTILE_TEXT, HOSTILE),
    "unknown_field": HOSTILE,
}
TOKENIZE_VALUES = {
    "prompt": FIELD_VALUES["prompt"],
    "messages": FIELD_VALUES["messages"],
    "model": FIELD_VALUES["model"],
    **{
        name: st.one_of(st.booleans(), HOSTILE)
        for name in (
            "add_special_tokens",
            "add_generation_prompt",
            "continue_final_message",
            "return_token_strs",
        )
    },
    "tokens": st.one_of(st.lists(HOSTILE_NUMBERS, max_size=8), HOSTILE),
}


def _nested(depth: int) -> Any:
    value: Any = "leaf"
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


@st.composite
def json_bodies(draw: st.DrawFn) -> tuple[str, bytes]:
    """A valid body of either endpoint with one to three fields replaced or dropped."""
    path = draw(st.sampled_from(PATHS))
    base: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": 4}
    base.update(
        {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}
    )
    body = draw(mutated(base, FIELD_VALUES))
    return path, json.dumps(body).encode()  # NaN/Infinity literals, surrogates as \ud800 escapes


@st.composite
def text_bodies(draw: st.DrawFn) -> tuple[str, bytes]:
    """A valid body with hostile text where text reaches the tokenizer or the stop matcher."""
    text = draw(HOSTILE_TEXT)
    where = draw(
        st.sampled_from(["content", "text_part", "prompt", "prompt_list", "stop", "stop_list"])
    )
    chat = {"model": MODEL_NAME, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    completion = {"model": MODEL_NAME, "max_tokens": 4, "prompt": "hi"}
    if where == "content":
        return PATHS[0], json.dumps(
            {**chat, "messages": [{"role": "user", "content": text}]}
        ).encode()
    if where == "text_part":
        part = {"type": "text", "text": text}
        return PATHS[0], json.dumps(
            {**chat, "messages": [{"role": "user", "content": [part]}]}
        ).encode()
    if where.startswith("prompt"):
        return PATHS[1], json.dumps(
            {**completion, "prompt": [text] if where == "prompt_list" else text}
        ).encode()
    path = draw(st.sampled_from(PATHS))
    base = chat if path == PATHS[0] else completion
    return path, json.dumps({**base, "stop": [text] if where == "stop_list" else text}).encode()


@st.composite
def token_bodies(draw: st.DrawFn) -> tuple[str, bytes]:
    """A valid /tokenize (prompt or chat) or /detokenize body with one to three fields replaced or
    dropped."""
    path = draw(st.sampled_from(TOKEN_PATHS))
    if path == "/detokenize":
        base: dict[str, Any] = {"model": MODEL_NAME, "tokens": [1, 2, 3]}
    elif draw(st.booleans()):
        base = {"prompt": "hi"}
    else:
        base = {"messages": [{"role": "user", "content": "hi"}]}
    return path, json.dumps(draw(mutated(base, TOKENIZE_VALUES))).encode()


RAW_BODIES = st.tuples(
    st.sampled_from(PATHS + TOKEN_PATHS),
    st.one_of(
        st.binary(max_size=64),
        st.integers(min_value=1, max_value=100_000).map(lambda n: b"[" * n),
        st.integers(min_value=1, max_value=100_000).map(lambda n: b'{"a":' * n),
        st.sampled_from(
            [
                b"",
                b"null",
                b"[]",
                b'"x"',
                b"1e999",
                b'{"messages": [',
                b"\xff\xfe",
                b'{"model": NaN}',
            ]
        ),
    ),
)


@pytest.fixture
async def fuzz_http(cluster):
    cfg = router_config(cluster)
    cfg = replace(cfg, limits=replace(cfg.limits, max_request_bytes=MAX_REQUEST_BYTES))
    network = FakeNetwork({PUBLIC_IP: lambda path: http_response(200, b"not an image")})
    backend = GuardedBackend(False, FakeResolver({"images.test": [PUBLIC_IP]}), network)
    app = await start_router(cfg, ImageLoader.from_limits(cfg.limits, backend))
    try:
        async with asgi_client(app) as client:
            yield client
    finally:
        await stop_router(app)
    assert network.attempted_ips() <= {PUBLIC_IP}  # the fuzz never reached a non-public address


def assert_well_formed(response: httpx.Response) -> None:
    assert response.status_code < 500, response.text[:500]
    if response.status_code != 200:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert (
            isinstance(error["message"], str)
            and error["message"]
            and isinstance(error["type"], str)
        )
        return
    if response.headers["content-type"].startswith("text/event-stream"):
        lines = [line for line in response.text.splitlines() if line]
        assert lines[-1] == "data: [DONE]"
        for line in lines[:-1]:
            assert "error" not in json.loads(line.removeprefix("data: "))
    elif response.request.url.path in TOKEN_PATHS:
        assert set(response.json()) & {"tokens", "prompt"}
    else:
        assert response.json()["choices"]


FUZZ_SETTINGS = settings(
    max_examples=800,
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=True,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)


@pytest.mark.slow
@FUZZ_SETTINGS
@given(request=st.one_of(json_bodies(), text_bodies(), token_bodies(), RAW_BODIES))
async def test_fuzzed_bodies_never_get_a_5xx(fuzz_http, request):
    path, body = request
    response = await fuzz_http.post(
        path, content=body, headers={"content-type": "application/json"}
    )
    assert_well_formed(response)


@pytest.mark.slow
@settings(FUZZ_SETTINGS, max_examples=60)
@given(
    method=st.sampled_from(["GET", "PUT", "DELETE", "PATCH"]),
    path=st.sampled_from(
        [
            *PATHS,
            *TOKEN_PATHS,
            "/v1/models",
            "/health",
            "/nope",
            "/v1/models/x",
            "/openapi.json",
            "/version",
        ]
    ),
)
async def test_fuzzed_methods_and_paths_never_get_a_5xx(fuzz_http, method, path):
    response = await fuzz_http.request(method, path)
    assert response.status_code < 500
    if response.status_code >= 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
