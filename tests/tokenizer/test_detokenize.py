"""Detokenize streams through a real gRPC server: the deltas join to the full decode."""

from __future__ import annotations

import grpc
import pytest

from services.common.client import create_channel
from services.common.errors import InvalidRequestError
from services.common.grpc_errors import error_from_rpc
from services.common.pb.stageserve.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from services.engine.processing import TextProcessor
from tests.conftest import TINY_MODEL_DIR
from tests.tokenizer.conftest import TIMEOUT_S

TEXTS = [
    "Hello, world! Le café du coin; über die Brücke; Łódź.",
    "今天天气很好，我们去公园散步。山の上の小さな駅で。오늘은 비가 와서",
    "Emoji: 🙂 🚀 👍🏽 ❤️ 🇫🇷 👩‍💻 and symbols € ≤ ∞ → …",
]


@pytest.fixture(scope="module")
def text() -> TextProcessor:
    return TextProcessor.from_dir(TINY_MODEL_DIR)


async def detokenize(client, ids, chunk: int, skip_special_tokens: bool = True) -> tuple[list[str], str]:
    stream = client.detokenize_stream("r", skip_special_tokens, prompt_token_ids=[1, 2, 3], timeout_s=TIMEOUT_S)
    async with stream:
        deltas = [await stream.send(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
        return deltas, await stream.finish()


@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("sample", TEXTS)
async def test_stream_equals_full_decode(served, text, sample, chunk):
    ids = text.encode(sample)
    deltas, tail = await detokenize(served.client, ids, chunk)
    assert "".join(deltas) + tail == text.decode(ids) == sample
    assert tail == "" and not any("\ufffd" in delta for delta in deltas)
    if chunk == 1:
        assert "" in deltas  # multi-byte characters split across tokens are held back


async def test_special_tokens(served, text):
    ids = text.encode("<|im_start|>assistant\nhi<|im_end|>")
    skipped, _ = await detokenize(served.client, ids, 2, skip_special_tokens=True)
    kept, _ = await detokenize(served.client, ids, 2, skip_special_tokens=False)
    assert "".join(skipped) == "assistant\nhi"
    assert "".join(kept) == "<|im_start|>assistant\nhi<|im_end|>"
    assert served.metric("tokenizer_detokenized_tokens_total") == 2 * len(ids)


async def test_finish_flushes_a_partial_character(served, text):
    ids = text.encode("a🙂")[:-1]
    deltas, tail = await detokenize(served.client, ids, 1)
    assert "".join(deltas) == "a" and tail == "\ufffd"


async def test_finish_without_tokens(served):
    stream = served.client.detokenize_stream("r", timeout_s=TIMEOUT_S)
    assert await stream.finish() == ""
    with pytest.raises(RuntimeError):
        await stream.finish()


async def test_streams_are_independent(served, text):
    first = served.client.detokenize_stream("a", timeout_s=TIMEOUT_S)
    second = served.client.detokenize_stream("b", timeout_s=TIMEOUT_S)
    a, b = text.encode("🚀 go"), text.encode("日本")
    out_a = out_b = ""
    for i in range(max(len(a), len(b))):
        out_a += await first.send(a[i : i + 1])
        out_b += await second.send(b[i : i + 1])
    assert out_a + await first.finish() == "🚀 go"
    assert out_b + await second.finish() == "日本"


async def test_first_message_without_options_is_rejected(served):
    channel = create_channel(served.address)
    try:
        call = tokenizer_pb2_grpc.TokenizerStub(channel).Detokenize(timeout=TIMEOUT_S)
        await call.write(tokenizer_pb2.DetokenizeRequest(token_ids=[40]))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call.read()
    finally:
        await channel.close()
    error = error_from_rpc(info.value)
    assert isinstance(error, InvalidRequestError) and error.param == "options"
    assert served.metric("tokenizer_requests_total", method="Detokenize", outcome="INVALID_ARGUMENT") == 1


async def test_abandoned_stream_is_cancelled(served, text):
    stream = served.client.detokenize_stream("r", timeout_s=TIMEOUT_S)
    async with stream:
        assert await stream.send(text.encode("hi")) == "hi"
    with pytest.raises(RuntimeError):
        await stream.send([40])
    deltas, _ = await detokenize(served.client, text.encode("ok"), 1)  # the server keeps serving
    assert "".join(deltas) == "ok"
