"""Every bad Tokenize input is INVALID_ARGUMENT with a precise message, and the server keeps serving."""

from __future__ import annotations

import io

import grpc
import pytest
from PIL import Image

from services.common.client import create_channel
from services.common.errors import InvalidRequestError
from services.common.grpc_errors import error_from_rpc
from services.common.pb.stageserve.v1 import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc
from services.common.types import ChatMessage, TextPart
from tests.conftest import image_bytes
from tests.tokenizer.conftest import TEST_LIMITS, TIMEOUT_S, user


def flat_png(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (30, 60, 90)).save(buf, format="PNG")
    return buf.getvalue()


BIG_FILE = image_bytes(400, 400, seed=4)  # noisy PNG: over TEST_LIMITS.max_image_bytes
MANY_PIXELS = flat_png(1100, 1000)  # a small file, but over TEST_LIMITS.max_image_pixels
LONG_TEXT = "hello world " * TEST_LIMITS.max_model_len

CHAT_CASES = {
    "unknown_role": (
        [ChatMessage(role="robot", content=(TextPart("hi"),))],
        "messages[0].role",
        "'robot'",
    ),
    "missing_content": (
        [user("hi"), ChatMessage(role="user", content=())],
        "messages[1].content",
        "messages[1].content is missing",
    ),
    "no_messages": ([], "messages", "non-empty"),
    "not_an_image": (
        [user("look", b"GIF89a but not really an image")],
        "messages[0].content[1]",
        "not an image",
    ),
    "empty_image": ([user(b"")], "messages[0].content[0]", "empty"),
    "truncated_image": (
        [user(image_bytes(64, 64)[:200])],
        "messages[0].content[0]",
        "truncated or corrupt",
    ),
    "image_too_large": (
        [user(BIG_FILE)],
        "messages[0].content[0]",
        f"bytes; the limit is {TEST_LIMITS.max_image_bytes} bytes",
    ),
    "too_many_pixels": (
        [user("a", MANY_PIXELS)],
        "messages[0].content[1]",
        f"1100x1000 = 1100000 pixels; the limit is {TEST_LIMITS.max_image_pixels}",
    ),
    "prompt_too_long": (
        [user(LONG_TEXT)],
        "messages",
        f"; the context limit is {TEST_LIMITS.max_model_len}",
    ),
}


async def assert_still_serving(served) -> None:
    prompt = await served.client.tokenize_chat("ok", [user("still there?")], timeout_s=TIMEOUT_S)
    assert len(prompt.token_ids) > 5


@pytest.mark.parametrize("name", sorted(CHAT_CASES))
async def test_bad_chat(served, name):
    messages, param, fragment = CHAT_CASES[name]
    with pytest.raises(InvalidRequestError) as info:
        await served.client.tokenize_chat(f"bad-{name}", messages, timeout_s=TIMEOUT_S)
    assert info.value.param == param
    assert fragment in info.value.message
    assert (
        served.metric("tokenizer_requests_total", method="Tokenize", outcome="INVALID_ARGUMENT")
        == 1
    )
    await assert_still_serving(served)


async def test_too_long_prompt_names_its_length(served):
    with pytest.raises(InvalidRequestError) as info:
        await served.client.tokenize_prompt("r", LONG_TEXT, timeout_s=TIMEOUT_S)
    assert info.value.param == "prompt"
    assert info.value.message.startswith("prompt has ")
    assert info.value.message.endswith(f" tokens; the context limit is {TEST_LIMITS.max_model_len}")
    await assert_still_serving(served)


async def test_a_chat_of_megabytes_is_refused_by_its_length(served):
    text = "hello world " * 200_000  # 2.4 MB: serialized and encoded off the event loops
    with pytest.raises(InvalidRequestError) as info:
        await served.client.tokenize_chat("r", [user(text)], timeout_s=TIMEOUT_S)
    assert info.value.param == "messages"
    assert info.value.message.startswith("prompt has at least ")
    with pytest.raises(InvalidRequestError, match="context limit"):
        await served.client.tokenize_prompt("r", text, timeout_s=TIMEOUT_S)
    await assert_still_serving(served)


async def test_images_push_a_prompt_over_the_limit(served):
    text = "hi " * (TEST_LIMITS.max_model_len - 100)  # fits without the image's placeholders
    with pytest.raises(InvalidRequestError, match="context limit"):
        await served.client.tokenize_chat(
            "r", [user(text, image_bytes(600, 600))], timeout_s=TIMEOUT_S
        )


@pytest.mark.parametrize(
    ("prompt", "fragment"),
    [("", "prompt is empty"), ("see <|image_pad|>", "raw prompts carry no images")],
)
async def test_bad_prompt(served, prompt, fragment):
    with pytest.raises(InvalidRequestError, match=fragment) as info:
        await served.client.tokenize_prompt("r", prompt, timeout_s=TIMEOUT_S)
    assert info.value.param == "prompt"
    await assert_still_serving(served)


@pytest.mark.parametrize(
    ("request_", "param"),
    [
        (tokenizer_pb2.TokenizeRequest(request_id="none"), "messages"),
        (
            tokenizer_pb2.TokenizeRequest(
                chat=common_pb2.ChatMessages(
                    messages=[
                        common_pb2.ChatMessage(role="user", content=[common_pb2.ContentPart()])
                    ]
                )
            ),
            "messages[0].content[0]",
        ),
    ],
)
async def test_malformed_requests(served, request_, param):
    """Shapes the typed client cannot send: no input at all, a content part with neither kind."""
    channel = create_channel(served.address)
    try:
        stub = tokenizer_pb2_grpc.TokenizerStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Tokenize(request_, timeout=TIMEOUT_S)
        error = error_from_rpc(info.value)
    finally:
        await channel.close()
    assert isinstance(error, InvalidRequestError) and error.param == param
    await assert_still_serving(served)


def test_an_image_url_is_refused_the_router_fetches_urls() -> None:
    from services.tokenizer.servicer import job_from_proto

    request = tokenizer_pb2.TokenizeRequest()
    message = request.chat.messages.add(role="user")
    message.content.add().image.url = "https://images.test/cat.png"
    with pytest.raises(InvalidRequestError, match="not URLs") as info:
        job_from_proto(request, TEST_LIMITS)
    assert info.value.param == "messages[0].content[0].image.url"
