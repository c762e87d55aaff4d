"""The OpenAI HTTP API over fake workers, through FastAPI's ASGI app (httpx ASGITransport):
the endpoints and what reaches the workers."""

from __future__ import annotations

import hashlib
import json

import pytest

from services.common.errors import UnavailableError
from services.router.image_fetch import GuardedBackend
from services.router.images import ImageLoader
from tests.conftest import image_bytes
from tests.router.conftest import (
    MODEL_NAME,
    asgi_client,
    router_config,
    start_router,
    stop_router,
    wait_until,
)
from tests.router.fakes import NUM_IMAGE_TOKENS, TEXT
from tests.router.http_helpers import (
    CHAT,
    EXPECTED,
    _data_url,
    _image_chat,
    prompt_len,
    sse_events,
)
from tests.router.net_fakes import PUBLIC_IP, FakeNetwork, FakeResolver, http_response, redirect


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
        "prompt_tokens_details": {"cached_tokens": 0, "cached_image_tokens": 0},
    }
    assert not cluster.aborted()  # decode finished the request itself


async def test_usage_reports_the_prefix_cached_tokens_prefill_read(http, cluster):
    for prefill in cluster.prefills:
        prefill.servicer.prefix_cached = (32, 16)
    body = (await http.post("/v1/chat/completions", json=CHAT)).json()
    assert body["usage"]["prompt_tokens_details"] == {
        "cached_tokens": 32,
        "cached_image_tokens": 16,
    }
    stream = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    async with http.stream("POST", "/v1/chat/completions", json=stream) as response:
        events = [line async for line in response.aiter_lines() if line.startswith("data: {")]
    usage = json.loads(events[-1][len("data: ") :])["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 32, "cached_image_tokens": 16}


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


def assert_sent_as_header(part, image: bytes, size: tuple[int, int]) -> None:
    """The router read the image's header: the tokenizer got its hash and size, not its bytes."""
    assert part.WhichOneof("part") == "image_header"
    header = part.image_header
    assert header.content_hash == hashlib.sha256(image).hexdigest()
    assert (header.height, header.width, header.num_bytes) == (*size, len(image))


async def test_image_data_url_reaches_tokenizer_and_prefill(http, cluster):
    image = image_bytes(40, 30)
    reply = await http.post("/v1/chat/completions", json=_image_chat(_data_url(image)))
    assert reply.status_code == 200, reply.text
    tokenized = cluster.tokenizer.servicer.requests[0]
    assert_sent_as_header(tokenized.chat.messages[0].content[0], image, (30, 40))
    assert tokenized.add_generation_prompt
    prefill = cluster.prefill.requests[0]
    assert prefill.images[0].data == image and prefill.image_spans[0].length == NUM_IMAGE_TOKENS


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
        async with asgi_client(app) as http:
            ok = await http.post(
                "/v1/chat/completions", json=_image_chat("https://images.test/cat.png")
            )
            assert ok.status_code == 200, ok.text
            part = cluster.tokenizer.servicer.requests[0].chat.messages[0].content[0]
            assert_sent_as_header(part, image, (20, 20))
            for path in ("/big.png", "/missing.png", "/to-metadata"):
                bad = await http.post(
                    "/v1/chat/completions", json=_image_chat(f"https://images.test{path}")
                )
                assert bad.status_code == 400, bad.text
                assert bad.json()["error"]["param"] == "messages[0].content[0].image_url"
        assert network.attempted_ips() == {PUBLIC_IP}
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
