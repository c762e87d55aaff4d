"""The OpenAI HTTP API over fake workers, through FastAPI's ASGI app (httpx ASGITransport)."""

from __future__ import annotations

import base64
import json
import math

import httpx
import pytest

from services.common.errors import InvalidRequestError, UnavailableError
from services.router.http_api import create_app
from services.router.image_fetch import GuardedBackend
from services.router.images import ImageLoader
from tests.conftest import image_bytes
from tests.router.conftest import (
    MODEL_NAME,
    Cluster,
    router_config,
    start_router,
    stop_router,
    wait_until,
)
from tests.router.fakes import EOS_ID, NUM_IMAGE_TOKENS, TEXT, char_ids
from tests.router.hostile import png_bomb
from tests.router.net_fakes import PUBLIC_IP, FakeNetwork, FakeResolver, http_response, redirect

EXPECTED = "Hello there, world!"
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Say hello."}]}


def prompt_len(cluster: Cluster) -> int:
    return len(next(iter(cluster.decode.reserved.values())).prompt_token_ids)


def sse_events(body: str) -> list[str]:
    events = [line[len("data: ") :] for line in body.split("\n\n") if line.strip()]
    assert all(not e.startswith("data:") for e in events)
    return events


async def stream_chat(http: httpx.AsyncClient, **extra) -> list:
    response = await http.post("/v1/chat/completions", json={**CHAT, "stream": True, **extra})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


async def test_chat_completion(http, cluster):
    response = await http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 100})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["model"] == MODEL_NAME and isinstance(body["created"], int)
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": EXPECTED},
            "logprobs": None,
            "finish_reason": "stop",
        }
    ]
    num_prompt = prompt_len(cluster)
    num_completion = len(cluster.script.output_ids)  # EOS included
    assert body["usage"] == {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_completion,
        "total_tokens": num_prompt + num_completion,
    }
    assert not cluster.aborted()  # decode finished the request itself


async def test_max_tokens_gives_length(http, cluster):
    body = (
        await http.post("/v1/chat/completions", json={**CHAT, "max_completion_tokens": 5})
    ).json()
    assert body["choices"][0]["message"]["content"] == EXPECTED[:5]
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 5


async def test_max_tokens_one_is_answered_by_prefill_and_decode_is_aborted(http, cluster):
    body = (await http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1})).json()
    assert body["choices"][0]["message"]["content"] == "H"
    assert body["choices"][0]["finish_reason"] == "length"
    await wait_until(lambda: cluster.aborted() == list(cluster.decode.reserved))
    assert cluster.is_kv_written() == dict.fromkeys(
        cluster.decode.reserved, True
    )  # decode frees at once


async def test_prefill_failure_aborts_decode_with_kv_not_written(http, cluster):
    cluster.script.prefill_error = UnavailableError("decode's transfer engine is unreachable")
    response = await http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 10})
    assert response.status_code == 503
    await wait_until(lambda: cluster.aborted() == list(cluster.decode.reserved))
    assert cluster.is_kv_written() == dict.fromkeys(
        cluster.decode.reserved, False
    )  # decode quarantines


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
async def test_max_tokens_above_the_context_is_a_400_naming_it(http, cluster, field):
    num_prompt = len(TEXT.encode("<user>Say hello."))  # the fake tokenizer's chat rendering
    room = 4096 - num_prompt
    response = await http.post("/v1/chat/completions", json={**CHAT, field: room + 1})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and f"at most {room} can be generated" in error["message"]
    assert not cluster.decode.reserved  # refused before Reserve
    body = (await http.post("/v1/chat/completions", json={**CHAT, field: room})).json()
    assert body["choices"][0]["finish_reason"] == "stop"
    assert cluster.decode.max_new_tokens(next(iter(cluster.decode.reserved))) == room


async def test_default_max_tokens_is_the_rest_of_the_context(http, cluster):
    await http.post("/v1/chat/completions", json=CHAT)
    request_id = next(iter(cluster.decode.reserved))
    assert cluster.decode.max_new_tokens(request_id) == 4096 - prompt_len(cluster)


async def test_sampling_params_reach_decode_and_prefill(http, cluster):
    extra = {
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 7,
        "min_p": 0.1,
        "seed": -1,
        "frequency_penalty": 0.5,
        "presence_penalty": -0.5,
        "repetition_penalty": 1.1,
        "ignore_eos": True,
        "max_tokens": 8,
    }
    await http.post("/v1/chat/completions", json={**CHAT, **extra})
    params = next(iter(cluster.decode.reserved.values())).sampling_params
    assert params.temperature == 0.5 and params.top_k == 7 and params.ignore_eos
    assert params.seed == 2**64 - 1 and params.max_new_tokens == 8
    assert params.repetition_penalty == pytest.approx(1.1) and params.min_p == pytest.approx(0.1)
    assert cluster.prefill.requests[0].sampling_params == params


async def test_stream_chat(http, cluster):
    chunks = await stream_chat(http, max_tokens=100)
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == MODEL_NAME for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == EXPECTED
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "stop"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"][0]["delta"] == {}
    assert all("usage" not in c for c in chunks)


async def test_stream_chat_with_usage(http, cluster):
    chunks = await stream_chat(http, max_tokens=6, stream_options={"include_usage": True})
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 6
    assert chunks[-1]["usage"]["prompt_tokens"] == prompt_len(cluster)
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert (
        "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
        == EXPECTED[:6]
    )


async def test_completions(http, cluster):
    body = (
        await http.post(
            "/v1/completions", json={"model": MODEL_NAME, "prompt": ["Once"], "max_tokens": 3}
        )
    ).json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["choices"] == [
        {"index": 0, "text": EXPECTED[:3], "logprobs": None, "finish_reason": "length"}
    ]
    assert body["usage"]["prompt_tokens"] == len(TEXT.encode("Once"))
    assert cluster.tokenizer.servicer.requests[0].prompt == "Once"

    response = await http.post(
        "/v1/completions",
        json={
            "model": MODEL_NAME,
            "prompt": "Once",
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == EXPECTED
    assert chunks[-1]["usage"]["completion_tokens"] == len(cluster.script.output_ids)


async def test_models_health_metrics(http, router, cluster):
    models = (await http.get("/v1/models")).json()
    assert [m["id"] for m in models["data"]] == [MODEL_NAME] and models["object"] == "list"
    health = await http.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    await http.post("/v1/chat/completions", json=CHAT)
    assert (await http.get("/metrics")).status_code == 404  # served on --metrics-port only
    metrics = router.metrics.render().decode()
    assert (
        'stageserve_router_requests_total{endpoint="/v1/chat/completions",outcome="ok"} 1.0'
        in metrics
    )
    for name in (
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "e2e_request_latency_seconds",
        "router_requests_in_flight",
        "router_worker_ready",
    ):
        assert f"stageserve_{name}" in metrics


@pytest.mark.parametrize("chunk_size", [1, 3, 100])
@pytest.mark.parametrize("stream", [False, True])
async def test_stop_strings(http, cluster, chunk_size, stream):
    cluster.script.chunk_size = chunk_size
    body = {**CHAT, "stop": ["zzz", "ere, wo"], "max_tokens": 100}
    if stream:
        chunks = await stream_chat(http, **body)
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    else:
        reply = (await http.post("/v1/chat/completions", json=body)).json()
        text = reply["choices"][0]["message"]["content"]
        assert reply["choices"][0]["finish_reason"] == "stop"
        assert reply["usage"]["completion_tokens"] == len("Hello there, wo")
    assert text == "Hello th"
    if chunk_size < 100:  # decode was still generating: the router stops it
        await wait_until(lambda: cluster.aborted() == list(cluster.decode.reserved))
        assert cluster.is_kv_written() == dict.fromkeys(cluster.decode.reserved, True)
    else:  # the stop string came in decode's last message: nothing to abort
        assert not cluster.aborted()


async def test_stop_string_partial_match_is_released_at_the_end(http, cluster):
    cluster.script.output_ids = [*char_ids("abc STO"), EOS_ID]
    reply = (await http.post("/v1/chat/completions", json={**CHAT, "stop": "STOP"})).json()
    assert reply["choices"][0]["message"]["content"] == "abc STO"
    assert reply["choices"][0]["finish_reason"] == "stop"


def _image_chat(url: str) -> dict:
    content = [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": "What is it?"},
    ]
    return {**CHAT, "messages": [{"role": "user", "content": content}]}


def _data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


async def test_image_data_url_reaches_tokenizer_and_prefill(http, cluster):
    image = image_bytes(40, 30)
    reply = await http.post("/v1/chat/completions", json=_image_chat(_data_url(image)))
    assert reply.status_code == 200, reply.text
    tokenized = cluster.tokenizer.servicer.requests[0]
    assert tokenized.chat.messages[0].content[0].image.data == image
    assert tokenized.add_generation_prompt
    prefill = cluster.prefill.requests[0]
    assert prefill.images[0].data == image and prefill.image_spans[0].length == NUM_IMAGE_TOKENS


def _raw(body: dict) -> bytes:
    """``body`` as JSON with NaN/Infinity literals and escaped lone surrogates, as a client may
    send."""
    return json.dumps(body).encode()


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
    "n_two": ({**CHAT, "n": 2}, "n"),
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
    response = await http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": ["a", "b"]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
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


async def test_numbers_may_be_integers_and_top_k_minus_one_is_off(http, cluster):
    reply = await http.post(
        "/v1/chat/completions", json={**CHAT, "temperature": 1, "top_p": 1, "top_k": -1}
    )
    assert reply.status_code == 200, reply.text
    params = next(iter(cluster.decode.reserved.values())).sampling_params
    assert params.temperature == 1.0 and params.top_k == 0


async def test_image_over_http_is_fetched_with_a_limit(cluster):
    image = image_bytes(20, 20)

    def serve(path: str) -> bytes:
        if path == "/big.png":
            return http_response(200, b"\x89PNG" + bytes(200 * 1024))
        if path == "/missing.png":
            return http_response(404)
        if path == "/to-metadata":
            return redirect("http://169.254.169.254/latest/meta-data/")
        return http_response(200, image)

    network = FakeNetwork({PUBLIC_IP: serve, "169.254.169.254": serve})
    cfg = router_config(cluster)
    backend = GuardedBackend(False, FakeResolver({"images.test": [PUBLIC_IP]}), network)
    app = await start_router(cfg, ImageLoader.from_limits(cfg.limits, backend))
    try:
        transport = httpx.ASGITransport(app=app.http_app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as http:
            ok = await http.post(
                "/v1/chat/completions", json=_image_chat("https://images.test/cat.png")
            )
            assert ok.status_code == 200, ok.text
            assert (
                cluster.tokenizer.servicer.requests[0].chat.messages[0].content[0].image.data
                == image
            )
            for path in ("/big.png", "/missing.png", "/to-metadata"):
                bad = await http.post(
                    "/v1/chat/completions", json=_image_chat(f"https://images.test{path}")
                )
                assert bad.status_code == 400, bad.text
                assert bad.json()["error"]["param"] == "messages[0].content[0].image_url"
        assert network.attempted_ips() == {PUBLIC_IP}
    finally:
        await stop_router(app)


async def test_body_without_json_content_type_gets_a_clear_400(http):
    response = await http.post("/v1/chat/completions", content=b'{"model": "m", "messages": []}')
    assert response.status_code == 400
    assert "content-type: application/json" in response.json()["error"]["message"]


LINE_BREAKING_TEXT = "one\u2028two\u2029three\x85four\nfive"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_stream_survives_str_splitlines(http, cluster, path):
    """U+2028, U+2029 and U+0085 are line breaks to str.splitlines (httpx aiter_lines): escaped."""
    cluster.script.output_ids = [*TEXT.encode(LINE_BREAKING_TEXT), EOS_ID]
    body = (
        {**CHAT, "stream": True}
        if "chat" in path
        else {"model": MODEL_NAME, "prompt": "x", "stream": True}
    )
    response = await http.post(path, json=body)
    assert response.status_code == 200, response.text
    lines = [line for line in response.text.splitlines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: ") :]) for line in lines[:-1]]
    choices = [c["choices"][0] for c in chunks]
    text = "".join(c["delta"].get("content", "") if "delta" in c else c["text"] for c in choices)
    assert text == LINE_BREAKING_TEXT


async def test_full_response_keeps_line_breaking_text(http, cluster):
    cluster.script.output_ids = [*TEXT.encode(LINE_BREAKING_TEXT), EOS_ID]
    response = await http.post("/v1/chat/completions", json=CHAT)
    assert "\u2028" not in response.text and "\x85" not in response.text
    assert response.json()["choices"][0]["message"]["content"] == LINE_BREAKING_TEXT


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


async def test_openapi_schema_is_served_from_the_real_bodies(http):
    response = await http.get("/openapi.json")
    assert response.status_code == 200
    schema = response.json()
    components = schema["components"]["schemas"]
    for path, body in (
        ("/v1/chat/completions", "ChatCompletionBody"),
        ("/v1/completions", "CompletionBody"),
    ):
        operation = schema["paths"][path]["post"]
        ref = operation["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref == f"#/components/schemas/{body}"
        assert "422" not in operation["responses"]
        for status in ("400", "413", "503"):
            error = operation["responses"][status]["content"]["application/json"]["schema"]["$ref"]
            assert error == "#/components/schemas/ErrorResponse"
    assert "HTTPValidationError" not in components
    chat = components["ChatCompletionBody"]
    assert "messages" in chat["required"]
    assert chat["properties"]["stream"]["type"] == "boolean"
    assert components["ErrorDetail"]["required"] == ["message", "type", "param", "code"]
