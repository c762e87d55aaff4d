"""The encoder behind real gRPC with the in-process transfer: rows, cache, errors, dead peers."""

from __future__ import annotations

import asyncio
import hashlib

import msgspec
import pytest
import torch

from services.common.clients.vision_encoder import EncodeSpanInput, SpanResult, SpanStatus
from services.common.errors import InvalidRequestError, UnavailableError
from services.engine.sampler import SamplingParams
from tests.conftest import image_bytes
from tests.vision_encoder.conftest import running_encoder, span_input, spans_for

TIMEOUT_S = 30.0


def offline_rows(pipeline, images: list[bytes]) -> torch.Tensor:
    """The offline path: OfflinePipeline's pixel values through the model's ViT; [tokens, hidden]."""
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": "describe"}]
    request = pipeline.build_request([{"role": "user", "content": content}], images, SamplingParams())
    pixels = torch.cat(request.pixel_values)
    with torch.inference_mode():
        return pipeline.engine.runner.model.encode_images(pixels, [s.grid_thw for s in request.spans])


@pytest.mark.parametrize("sizes", [[(64, 48)], [(90, 60), (40, 120)]], ids=["one-image", "two-sizes"])
async def test_written_rows_equal_the_offline_vit(vision_model, image_processor, pipeline, sizes) -> None:
    images = [image_bytes(w, h, seed=i) for i, (w, h) in enumerate(sizes)]
    expected = offline_rows(pipeline, images)
    async with running_encoder(vision_model) as enc:
        spans = spans_for(image_processor, images)
        num_rows = sum(s.span.length for s in spans)
        assert num_rows == expected.shape[0]
        start = enc.rows.allocate(num_rows)
        dst = enc.receiver.destination("req-1", start + 7, num_rows)  # any window of the buffer
        results = await enc.client.encode("req-1", spans, dst, TIMEOUT_S)
        assert [r.status for r in results] == [SpanStatus.WRITTEN] * len(images)
        assert [r.is_cache_hit for r in results] == [False] * len(images)
        assert [r.content_hash for r in results] == [s.span.content_hash for s in spans]
        torch.testing.assert_close(enc.buffer.rows(start + 7, num_rows), expected, rtol=0, atol=0)
        assert torch.isnan(enc.buffer.tensor[: start + 7]).all()  # nothing outside the window
        assert torch.isnan(enc.buffer.tensor[start + 7 + num_rows :]).all()
        assert enc.counter("images_encoded") == len(images)
        assert enc.counter("vit_forwards") == 1  # every image of the call in one ViT batch


async def test_same_image_twice_is_encoded_once(vision_model, image_processor) -> None:
    image = image_bytes(80, 80, seed=3)
    async with running_encoder(vision_model) as enc:
        span = span_input(image_processor, image, 0)
        dst = enc.receiver.destination("a", 0, span.span.length)
        first = await enc.client.encode("a", [span], dst, TIMEOUT_S)
        rows_first = enc.buffer.rows(0, span.span.length).clone()
        dst2 = enc.receiver.destination("b", 100, span.span.length)
        second = await enc.client.encode("b", [span], dst2, TIMEOUT_S)
        assert [r.is_cache_hit for r in first + second] == [False, True]
        assert torch.equal(enc.buffer.rows(100, span.span.length), rows_first)
        assert enc.counter("images_encoded") == 1
        assert (enc.counter("cache_hits"), enc.counter("cache_misses")) == (1, 1)
        assert enc.registry.get_sample_value("stageserve_vision_encoder_cache_bytes") == rows_first.numel() * 4


async def test_repeated_image_in_one_request_runs_the_vit_once(vision_model, image_processor) -> None:
    a, b = image_bytes(56, 84, seed=5), image_bytes(70, 70, seed=6)
    async with running_encoder(vision_model) as enc:
        spans = spans_for(image_processor, [a, b, a])
        num_rows = sum(s.span.length for s in spans)
        results = await enc.client.encode("r", spans, enc.receiver.destination("r", 0, num_rows), TIMEOUT_S)
        assert [r.is_cache_hit for r in results] == [False, False, True]
        assert enc.counter("images_encoded") == 2
        first, third = spans[0], spans[2]
        assert torch.equal(enc.buffer.rows(third.dest_row, third.span.length), enc.buffer.rows(0, first.span.length))


async def test_lru_eviction_under_a_small_budget(vision_model, image_processor) -> None:
    images = [image_bytes(56, 56, seed=s) for s in (10, 11, 12)]
    spans = [span_input(image_processor, data, 0) for data in images]
    entry_bytes = spans[0].span.length * vision_model.config.vision.out_hidden_size * 4
    async with running_encoder(vision_model, cache_bytes=2 * entry_bytes) as enc:
        dst = enc.receiver.destination("r", 0, spans[0].span.length)

        async def hits(order: list[int]) -> list[bool]:
            return [(await enc.client.encode("r", [spans[i]], dst, TIMEOUT_S))[0].is_cache_hit for i in order]

        assert await hits([0, 1, 0]) == [False, False, True]  # 0 is now the most recent
        assert await hits([2]) == [False]  # evicts 1, the least recently used
        assert await hits([0, 2, 1]) == [True, True, False]
        assert enc.app.worker.cache.num_bytes <= 2 * entry_bytes
        assert enc.counter("cache_evictions") == 2


async def test_bad_requests_are_invalid_argument_and_the_server_keeps_serving(vision_model, image_processor) -> None:
    good = span_input(image_processor, image_bytes(60, 60, seed=1), 0)
    not_image = b"definitely not an image"
    t, h, w = good.span.grid_thw
    bad = {
        "bytes": msgspec.structs.replace(
            good, image_data=not_image,
            span=msgspec.structs.replace(good.span, content_hash=hashlib.sha256(not_image).hexdigest()),
        ),
        "grid": msgspec.structs.replace(
            good, span=msgspec.structs.replace(good.span, grid_thw=(t, h + 2, w), length=t * (h + 2) * w // 4)
        ),
        "length": msgspec.structs.replace(good, span=msgspec.structs.replace(good.span, length=good.span.length + 1)),
        "hash": msgspec.structs.replace(good, span=msgspec.structs.replace(good.span, content_hash="ab" * 32)),
        "rows": msgspec.structs.replace(good, dest_row=5),
    }
    params = {
        "bytes": "spans[0].image_data", "grid": "spans[0].span", "length": "spans[0].span.length",
        "hash": "spans[0].span.content_hash", "rows": "spans[0].dest_row",
    }
    async with running_encoder(vision_model) as enc:
        dst = enc.receiver.destination("r", 0, good.span.length + 4)
        for name, span in bad.items():
            with pytest.raises(InvalidRequestError) as info:
                await enc.client.encode(f"bad-{name}", [span], dst, TIMEOUT_S)
            assert info.value.param == params[name], (name, info.value.message)
        results = await enc.client.encode("good", [good], dst, TIMEOUT_S)
        assert results[0].status is SpanStatus.WRITTEN and not torch.isnan(enc.buffer.rows(0, 1)).any()


async def test_a_cached_image_with_the_wrong_grid_is_still_invalid(vision_model, image_processor) -> None:
    good = span_input(image_processor, image_bytes(60, 60, seed=2), 0)
    t, h, w = good.span.grid_thw
    wrong_span = msgspec.structs.replace(good.span, grid_thw=(t, w + 2, h), length=t * (w + 2) * h // 4)
    wrong = msgspec.structs.replace(good, span=wrong_span)
    async with running_encoder(vision_model) as enc:
        dst = enc.receiver.destination("r", 0, 64)
        await enc.client.encode("warm", [good], dst, TIMEOUT_S)
        with pytest.raises(InvalidRequestError, match="does not match the image's grid"):
            await enc.client.encode("wrong", [wrong], dst, TIMEOUT_S)


async def test_one_bad_request_does_not_fail_its_batch_neighbours(vision_model, image_processor) -> None:
    junk = b"junk bytes"
    async with running_encoder(vision_model) as enc:
        good = [span_input(image_processor, image_bytes(56, 56 + 28 * i, seed=20 + i), 0) for i in range(4)]
        bad = msgspec.structs.replace(
            good[0], image_data=junk,
            span=msgspec.structs.replace(good[0].span, content_hash=hashlib.sha256(junk).hexdigest()),
        )
        dsts = [enc.receiver.destination(f"r{i}", 200 * i, 200) for i in range(5)]
        calls = [enc.client.encode(f"r{i}", [s], dsts[i], TIMEOUT_S) for i, s in enumerate(good)]
        calls.append(enc.client.encode("bad", [bad], dsts[4], TIMEOUT_S))
        outcomes = await asyncio.gather(*calls, return_exceptions=True)
        assert all(isinstance(o, list) and o[0].status is SpanStatus.WRITTEN for o in outcomes[:4])
        assert isinstance(outcomes[4], InvalidRequestError)
        assert enc.counter("images_encoded") == 4
        assert enc.counter("vit_forwards") <= 4


async def test_a_dead_destination_is_unavailable_not_a_hang(vision_model, image_processor) -> None:
    span = span_input(image_processor, image_bytes(56, 56, seed=4), 0)
    async with running_encoder(vision_model) as enc:
        dst = enc.receiver.destination("r", 0, span.span.length)
        enc.receiver.close()  # prefill went away: its buffer is no longer registered
        with pytest.raises(UnavailableError):
            await enc.client.encode("r", [span], dst, TIMEOUT_S)
        outcome = {"outcome": "UnavailableError"}
        assert enc.registry.get_sample_value("stageserve_vision_encoder_requests_total", outcome) == 1


async def test_wrong_backend_and_hidden_size_are_invalid(vision_model, image_processor) -> None:
    span = span_input(image_processor, image_bytes(56, 56, seed=4), 0)
    async with running_encoder(vision_model) as enc:
        dst = enc.receiver.destination("r", 0, span.span.length)
        for field, value in (("backend", "mooncake"), ("hidden_size", 7)):
            with pytest.raises(InvalidRequestError) as info:
                await enc.client.encode("r", [span], msgspec.structs.replace(dst, **{field: value}), TIMEOUT_S)
            assert info.value.param == f"embedding_refs[0].{field}"


async def test_rows_are_cast_to_the_destination_dtype(vision_model, image_processor) -> None:
    from services.transfer.embeddings import EmbeddingBuffer
    from services.transfer.embeddings_inprocess import InProcessEmbeddingReceiver

    span = span_input(image_processor, image_bytes(56, 56, seed=4), 0)
    async with running_encoder(vision_model) as enc:
        receiver = InProcessEmbeddingReceiver(enc.fabric)
        buffer = EmbeddingBuffer(64, enc.app.worker.hidden_size, torch.bfloat16)
        receiver.register(buffer)
        await enc.client.encode("fp32", [span], enc.receiver.destination("fp32", 0, span.span.length), TIMEOUT_S)
        await enc.client.encode("bf16", [span], receiver.destination("bf16", 0, span.span.length), TIMEOUT_S)
        assert torch.equal(buffer.rows(0, span.span.length), enc.buffer.rows(0, span.span.length).bfloat16())
        receiver.close()


async def test_no_spans_is_an_empty_answer(vision_model) -> None:
    async with running_encoder(vision_model) as enc:
        assert await enc.client.encode("r", [], enc.receiver.destination("r", 0, 1), TIMEOUT_S) == []


def test_domain_types_round_trip(image_processor) -> None:
    span = span_input(image_processor, image_bytes(56, 56), 3)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(span), type=EncodeSpanInput) == span
    result = SpanResult("ab" * 32, SpanStatus.WRITTEN, True, 1)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(result), type=SpanResult) == result
