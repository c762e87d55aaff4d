"""``decode_json`` accepts exactly what ``json.loads`` accepts, with equal values and the same
errors, and the router's routes parse their bodies with it."""

from __future__ import annotations

import json
import math

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.router import fast_json
from services.router.fast_json import decode_json
from tests.router.http_helpers import CHAT


def outcome(parse, body: bytes) -> tuple[str, object]:
    try:
        return "ok", _comparable(parse(body))
    except (ValueError, RecursionError) as exc:
        return type(exc).__name__, str(exc)


def _comparable(value):
    """NaN != NaN: compare its repr instead; containers element by element."""
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    if isinstance(value, list):
        return [_comparable(v) for v in value]
    if isinstance(value, dict):
        return {k: _comparable(v) for k, v in value.items()}
    return value


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=12,
)


@given(JSON_VALUES, st.booleans())
def test_values_python_writes_decode_as_json_loads_decodes_them(value, ensure_ascii):
    body = json.dumps(value, ensure_ascii=ensure_ascii).encode()
    assert outcome(decode_json, body) == outcome(json.loads, body)


@given(st.binary(max_size=40))
def test_any_bytes_are_accepted_or_refused_as_json_loads_does(body):
    assert outcome(decode_json, body) == outcome(json.loads, body)


@pytest.mark.parametrize(
    "body",
    [
        b'{"x": NaN, "y": -Infinity}',
        b'{"f": 1e400}',
        b'{"s": "\\ud800"}',
        '{"a": "\u00e9"}'.encode("utf-16"),
        b'{"a": 1, "a": 2}',
        b'{"n": 123456789012345678901234567890}',
        b"[" * 100_000,
        b'{"a": ',
        b"",
    ],
)
def test_bodies_msgspec_refuses_or_reads_differently_match_json_loads(body):
    assert outcome(decode_json, body) == outcome(json.loads, body)


async def test_the_router_parses_request_bodies_with_msgspec(http, monkeypatch):
    calls, decode = [], msgspec.json.decode

    def counting_decode(body: bytes):
        calls.append(len(body))
        return decode(body)

    monkeypatch.setattr(fast_json.msgspec.json, "decode", counting_decode)
    body = json.dumps(CHAT).encode()
    response = await http.post(
        "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
    )
    assert response.status_code == 200, response.text
    assert calls == [len(body)]


def _request(*chunks: bytes) -> fast_json.FastJSONRequest:
    """A request whose body arrives as ``chunks``, one ASGI message each."""
    messages = [
        {"type": "http.request", "body": chunk, "more_body": i < len(chunks) - 1}
        for i, chunk in enumerate(chunks)
    ]

    async def receive():
        return messages.pop(0)

    return fast_json.FastJSONRequest({"type": "http", "method": "POST", "headers": []}, receive)


async def test_a_body_in_one_message_is_that_message_and_several_are_joined():
    body = json.dumps({"text": "x" * 2_000_000}).encode()
    whole = _request(body)
    assert await whole.body() is body  # no copy of a body the size limit buffered
    assert await whole.json() == json.loads(body)
    parts = _request(body[:7], b"", body[7:1_500_000], body[1_500_000:])
    assert await parts.body() == body
    assert await parts.json() == json.loads(body)
    assert await _request(b"").body() == b""
