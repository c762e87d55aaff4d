"""The OpenAI HTTP API's errors: bad requests are 400s, failures 500/503, in OpenAI's shape."""

from __future__ import annotations

import math

import httpx
import pytest

from services.common.errors import MAX_PARAM_CHARS, InvalidRequestError, clip
from services.router.http_api import create_app
from tests.router.conftest import (
    MODEL_NAME,
    router_config,
    start_router,
    stop_router,
)
from tests.router.hostile import png_bomb
from tests.router.http_helpers import (
    CHAT,
    EXPECTED,
    _data_url,
    _image_chat,
    _raw,
)

BAD_REQUESTS = {
    "malformed_json": (b'{"model": "x", "messages": [', None),
    "not_an_object": (b"[1, 2]", None),
    "empty_body": (b"", None),
    "missing_messages": ({"model": MODEL_NAME}, "messages"),
    "empty_messages": ({**CHAT, "messages": []}, "messages"),
    "unknown_model": ({**CHAT, "model": "gpt-9"}, "model"),
    "unknown_role": (
        {**CHAT, "messages": [{"role": "wizard", "content": "hi"}]},
        "messages[0].role",
    ),
    "bad_part_type": (
        {**CHAT, "messages": [{"role": "user", "content": [{"type": "audio"}]}]},
        "messages[0].content[0].type",
    ),
    "max_tokens_zero": ({**CHAT, "max_tokens": 0}, "max_tokens"),
    "max_completion_tokens_negative": (
        {**CHAT, "max_completion_tokens": -1},
        "max_completion_tokens",
    ),
    "max_tokens_not_int": ({**CHAT, "max_tokens": "many"}, "max_tokens"),
    "temperature_negative": ({**CHAT, "temperature": -0.1}, "temperature"),
    "temperature_too_high": ({**CHAT, "temperature": 2.5}, "temperature"),
    "top_p_zero": ({**CHAT, "top_p": 0}, "top_p"),
    "n_over_max_n": ({**CHAT, "n": 9}, "n"),
    "five_stops": ({**CHAT, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    "empty_stop": ({**CHAT, "stop": [""]}, "stop"),
    "not_an_image": (
        _image_chat(_data_url(b"this is text, not an image")),
        "messages[0].content[0].image_url",
    ),
    "bad_base64": (
        _image_chat("data:image/png;base64,@@@notbase64"),
        "messages[0].content[0].image_url",
    ),
    "not_image_mime": (
        _image_chat(_data_url(b"abc", "text/plain")),
        "messages[0].content[0].image_url",
    ),
    "image_too_large": (
        _image_chat(_data_url(b"\x89PNG" + bytes(100 * 1024))),
        "messages[0].content[0].image_url",
    ),
    "bad_image_scheme": (
        _image_chat("ftp://example.com/a.png"),
        "messages[0].content[0].image_url",
    ),
    "image_host_label_too_long_for_idna": (
        _image_chat("http://" + "a" * 64 + ".invalid/x.png"),
        "messages[0].content[0].image_url",
    ),
    "image_host_too_long_for_idna": (
        _image_chat("http://" + "a" * 300 + "/x.png"),
        "messages[0].content[0].image_url",
    ),
    "image_host_empty_label": (
        _image_chat("http://a..invalid/x.png"),
        "messages[0].content[0].image_url",
    ),
    "decompression_bomb": (_image_chat(_data_url(png_bomb())), "messages[0].content[0].image_url"),
    "truncated_png_header": (
        _image_chat(_data_url(png_bomb()[:20])),
        "messages[0].content[0].image_url",
    ),
    "prompt_too_long": (
        {**CHAT, "messages": [{"role": "user", "content": "7" * 5000}]},
        "messages",
    ),
    "surrogate_in_content": (
        _raw({**CHAT, "messages": [{"role": "user", "content": "hi \ud800"}]}),
        "messages[0].content",
    ),
    "surrogate_in_text_part": (
        _raw(
            {
                **CHAT,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "ok"},
                            {"type": "text", "text": "\udfff"},
                        ],
                    }
                ],
            }
        ),
        "messages[0].content[1].text",
    ),
    "surrogate_in_stop": (_raw({**CHAT, "stop": ["ok", "\ud800"]}), "stop[1]"),
    "surrogate_in_single_stop": (_raw({**CHAT, "stop": "x\ud800"}), "stop"),
    "surrogate_in_image_url": (
        _raw(_image_chat("data:image/png;base64,AAAA\ud800")),
        "messages[0].content[0].image_url",
    ),
    "top_k_above_int32": ({**CHAT, "top_k": 2**31}, "top_k"),
    "top_k_above_uint32": ({**CHAT, "top_k": 2**40}, "top_k"),
    "top_k_below_minus_one": ({**CHAT, "top_k": -2}, "top_k"),
    "repetition_penalty_infinity": (
        _raw({**CHAT, "repetition_penalty": math.inf}),
        "repetition_penalty",
    ),
    "repetition_penalty_tiny": ({**CHAT, "repetition_penalty": 1e-300}, "repetition_penalty"),
    "temperature_nan": (_raw({**CHAT, "temperature": math.nan}), "temperature"),
    "temperature_infinity": (_raw({**CHAT, "temperature": math.inf}), "temperature"),
    "min_p_negative_infinity": (_raw({**CHAT, "min_p": -math.inf}), "min_p"),
    "stream_yes": ({**CHAT, "stream": "yes"}, "stream"),
    "stream_one": ({**CHAT, "stream": 1}, "stream"),
    "seed_true": ({**CHAT, "seed": True}, "seed"),
    "ignore_eos_no": ({**CHAT, "ignore_eos": "no"}, "ignore_eos"),
    "include_usage_string": (
        {**CHAT, "stream": True, "stream_options": {"include_usage": "true"}},
        "stream_options.include_usage",
    ),
    "max_tokens_fraction": ({**CHAT, "max_tokens": 1.5}, "max_tokens"),
    "max_tokens_float": ({**CHAT, "max_tokens": 10.0}, "max_tokens"),
    "temperature_string": ({**CHAT, "temperature": "0.5"}, "temperature"),
    "content_number": (
        {**CHAT, "messages": [{"role": "user", "content": 5}]},
        "messages[0].content",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
async def test_bad_input_gets_400_and_router_keeps_answering(http, cluster, case):
    body, param = BAD_REQUESTS[case]
    if isinstance(body, bytes):
        response = await http.post(
            "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
        )
    else:
        response = await http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert " at 0x" not in error["message"]  # no Python reprs (PIL's messages carry them)
    if case == "unknown_model":
        assert error["code"] == "model_not_found"
    if case.startswith("image_host_"):
        assert "not a valid DNS name" in error["message"]
    assert not cluster.decode.reserved  # nothing reached decode
    reply = await http.post("/v1/chat/completions", json=CHAT)
    assert reply.json()["choices"][0]["message"]["content"] == EXPECTED


async def test_tokenizer_rejection_is_a_400(http, cluster):
    cluster.script.tokenize_error = InvalidRequestError(
        "the image cannot be decoded", param="messages"
    )
    response = await http.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 400
    assert response.json()["error"] == {
        "message": "the image cannot be decoded",
        "type": "invalid_request_error",
        "param": "messages",
        "code": None,
    }


async def test_bad_completion_prompt(http):
    # a batch is texts or token-id lists, not both
    response = await http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": ["a", [1]]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt[1]"
    response = await http.post("/v1/completions", json={"model": MODEL_NAME})
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"


@pytest.mark.parametrize(("prompt", "param"), [("a\ud800", "prompt"), (["\ud800b"], "prompt[0]")])
async def test_completion_prompt_with_a_lone_surrogate_is_a_400(http, cluster, prompt, param):
    body = _raw({"model": MODEL_NAME, "prompt": prompt})
    response = await http.post(
        "/v1/completions", content=body, headers={"content-type": "application/json"}
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and "lone surrogate" in error["message"]
    assert not cluster.tokenizer.servicer.requests  # refused before the tokenizer


async def test_body_without_json_content_type_gets_a_clear_400(http):
    response = await http.post("/v1/chat/completions", content=b'{"model": "m", "messages": []}')
    assert response.status_code == 400
    assert "content-type: application/json" in response.json()["error"]["message"]


async def test_unexpected_exception_is_an_openai_500(router, monkeypatch):
    def broken() -> dict:
        raise RuntimeError("secret internals at 0x7f00")

    monkeypatch.setattr(router.api, "models", broken)
    transport = httpx.ASGITransport(app=create_app(router.api), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
        response = await client.get("/v1/models")
    assert response.status_code == 500
    assert response.json() == {
        "error": {
            "message": "internal error in the router",
            "type": "internal_error",
            "param": None,
            "code": None,
        }
    }


@pytest.mark.parametrize("kind", ["tokenizer", "prefill", "decode"])
async def test_dead_worker_503_names_no_internal_address(cluster, kind):
    app = await start_router(
        router_config(cluster, health_interval_s=3600.0)
    )  # no poll notices the death
    worker = {
        "tokenizer": cluster.tokenizer,
        "prefill": cluster.prefills[0],
        "decode": cluster.decodes[0],
    }[kind]
    try:
        await worker.server.stop(None)
        transport = httpx.ASGITransport(app=app.http_app)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://router", timeout=30
        ) as http:
            response = await http.post("/v1/chat/completions", json=CHAT)
        assert response.status_code == 503, response.text
        error = response.json()["error"]
        assert error["type"] == "service_unavailable"
        assert "127.0.0.1" not in error["message"] and "ipv4" not in error["message"], error[
            "message"
        ]
        assert str(worker.port) not in error["message"]
    finally:
        await stop_router(app)


LONG = "q" * 1_000_000


@pytest.mark.parametrize(
    ("body", "param", "explained"),
    [
        ({**CHAT, "model": LONG}, "model", "does not exist; this server serves"),
        ({**CHAT, LONG: 1}, LONG, "is not a field this server knows"),
        (
            _image_chat(f"data:text/{LONG};base64,AAAA"),
            "messages[0].content[0].image_url",
            "not image/*",
        ),
    ],
    ids=["model", "unknown_field", "media_type"],
)
async def test_echoed_client_strings_are_clipped(http, body, param, explained):
    response = await http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert len(response.content) < 2000  # not the megabyte the client sent
    error = response.json()["error"]
    assert "characters, cut]..." in error["message"] and explained in error["message"]
    assert error["param"] == clip(param, MAX_PARAM_CHARS)


async def test_n_below_one_is_out_of_range_not_unsupported(http):
    for n in (0, -3):
        response = await http.post("/v1/chat/completions", json={**CHAT, "n": n})
        assert response.status_code == 400
        error = response.json()["error"]
        assert (error["message"], error["param"]) == (f"n must be >= 1, got {n}", "n")
    response = await http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "a", "n": 0})
    assert response.json()["error"]["message"] == "n must be >= 1, got 0"


async def test_an_empty_or_omitted_model_is_the_served_one(http):
    """vLLM's rule (``_is_model_supported``: a falsy name is the default model)."""
    for body in ({**CHAT, "model": ""}, {k: v for k, v in CHAT.items() if k != "model"}):
        reply = await http.post("/v1/chat/completions", json=body)
        assert reply.status_code == 200, reply.text
        assert reply.json()["model"] == MODEL_NAME
