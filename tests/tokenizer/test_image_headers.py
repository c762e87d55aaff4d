"""An image the client can read the header of travels to the tokenizer as its hash and size
(``ImageHeaderInput``), not its bytes; the prompt equals the one tokenized from the bytes,
and the tokenizer's limits and errors hold for both forms."""

from __future__ import annotations

import hashlib

import grpc
import pytest

from services.common import offload
from services.common.clients.tokenizer import chat_to_proto, read_image_headers
from services.common.pb.stageserve.v1 import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc
from tests.conftest import image_bytes
from tests.tokenizer.conftest import TEST_LIMITS, TIMEOUT_S, user
from tests.tokenizer.test_limits import slow_png

JPEG = image_bytes(120, 60, seed=11, fmt="JPEG")
PNG = image_bytes(50, 90, seed=12)


def parts(chat: common_pb2.ChatMessages) -> list[str]:
    return [part.WhichOneof("part") for m in chat.messages for part in m.content]


def test_the_client_sends_headers_where_they_tell_the_size() -> None:
    messages = [user("a", JPEG, "b", PNG, slow_png(3), b"not an image", b"")]
    headers = read_image_headers(messages)
    assert [h is not None for h in headers] == [True, True, False, False, False]
    chat = chat_to_proto(messages, headers)
    assert parts(chat) == ["text", "image_header", "text", "image_header"] + ["image"] * 3
    header = chat.messages[0].content[1].image_header
    assert header.content_hash == hashlib.sha256(JPEG).hexdigest()
    assert (header.height, header.width, header.num_bytes) == (60, 120, len(JPEG))
    assert parts(chat_to_proto(messages)) == ["text", "image", "text", "image"] + ["image"] * 3


async def _tokenize(stub, chat: common_pb2.ChatMessages) -> tokenizer_pb2.TokenizeResponse:
    request = tokenizer_pb2.TokenizeRequest(request_id="h", chat=chat, add_generation_prompt=True)
    return await stub.Tokenize(request, timeout=TIMEOUT_S)


async def test_headers_and_bytes_give_the_same_prompt(served) -> None:
    messages = [user("Compare ", JPEG, " and ", PNG, " and ", JPEG)]
    async with grpc.aio.insecure_channel(served.address) as channel:
        stub = tokenizer_pb2_grpc.TokenizerStub(channel)
        by_header = await _tokenize(stub, chat_to_proto(messages, read_image_headers(messages)))
        by_bytes = await _tokenize(stub, chat_to_proto(messages))
    assert by_header == by_bytes
    assert len(by_header.image_spans) == 3
    prompt = await served.client.tokenize_chat("h", messages, timeout_s=TIMEOUT_S)
    assert list(prompt.token_ids) == list(by_bytes.token_ids)
    assert prompt.images == {hashlib.sha256(d).hexdigest(): d for d in (JPEG, PNG)}


async def test_work_moved_off_the_loop_gives_the_same_prompt(served, monkeypatch) -> None:
    messages = [user("Compare ", JPEG, " and ", PNG, " and ", JPEG)]
    inline = await served.client.tokenize_chat("h", messages, timeout_s=TIMEOUT_S)
    # every size now counts as large: hashing, serializing and encoding run on threads
    monkeypatch.setattr(offload, "INLINE_MAX_BYTES", -1)
    assert await served.client.tokenize_chat("h", messages, timeout_s=TIMEOUT_S) == inline
    text = await served.client.tokenize_prompt("p", "a plain prompt", timeout_s=TIMEOUT_S)
    monkeypatch.undo()
    assert await served.client.tokenize_prompt("p", "a plain prompt", timeout_s=TIMEOUT_S) == text


def header_chat(content_hash: str, height: int, width: int, num_bytes: int):
    chat = common_pb2.ChatMessages()
    message = chat.messages.add(role="user")
    header = message.content.add().image_header
    header.content_hash, header.height, header.width = content_hash, height, width
    header.num_bytes = num_bytes
    message.content.add(text="what is it?")
    return chat


GOOD_HASH = "ab" * 32
BAD_HEADERS = {
    "over the byte limit": (
        (GOOD_HASH, 10, 10, TEST_LIMITS.max_image_bytes + 1),
        f"image is {TEST_LIMITS.max_image_bytes + 1} bytes; the limit is",
    ),
    "over the pixel limit": ((GOOD_HASH, 2000, 1000, 100), "2000000 pixels; the limit is"),
    "no bytes": ((GOOD_HASH, 10, 10, 0), "image data is empty"),
    "a zero size": ((GOOD_HASH, 0, 10, 100), "image size must be positive"),
    "a malformed hash": (("AB" * 32, 10, 10, 100), "64 lower-case hex digits"),
    "a short hash": (("ab", 10, 10, 100), "64 lower-case hex digits"),
}


@pytest.mark.parametrize("case", sorted(BAD_HEADERS))
async def test_a_bad_header_is_invalid_argument_naming_the_part(served, case) -> None:
    fields, message = BAD_HEADERS[case]
    async with grpc.aio.insecure_channel(served.address) as channel:
        stub = tokenizer_pb2_grpc.TokenizerStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _tokenize(stub, header_chat(*fields))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in info.value.details()
        assert "messages[0].content[0]" in info.value.details()
        ok = await _tokenize(stub, header_chat(GOOD_HASH, 56, 56, 100))  # still serving
    assert len(ok.image_spans) == 1 and ok.image_spans[0].content_hash == GOOD_HASH


async def test_an_oversized_image_gets_the_same_error_either_way(served) -> None:
    big = image_bytes(1000, 1000, seed=13)  # a noise PNG over TEST_LIMITS.max_image_bytes
    assert len(big) > TEST_LIMITS.max_image_bytes
    details = []
    async with grpc.aio.insecure_channel(served.address) as channel:
        stub = tokenizer_pb2_grpc.TokenizerStub(channel)
        messages = [user(big, "hi")]
        for headers in (read_image_headers(messages), ()):
            chat = chat_to_proto(messages, headers)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await _tokenize(stub, chat)
            details.append(info.value.details())
    assert details[0] == details[1]
    assert f"image is {len(big)} bytes" in details[0]
