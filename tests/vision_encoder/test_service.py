"""One encoder (one rank process) behind real gRPC, rows over shared memory: rows, cache, errors,
dead peers. The module shares the encoder: each test uses its own images and counts deltas."""

from __future__ import annotations

import asyncio
import hashlib

import grpc
import msgspec
import pytest
import torch

from services.common.clients.vision_encoder import (
    EncodeSpanInput,
    SpanResult,
    SpanStatus,
    VisionEncoderClient,
    encode_request_to_proto,
)
from services.common.errors import InvalidRequestError, UnavailableError
from services.common.types import SamplingParams
from tests.conftest import image_bytes
from tests.vision_encoder.conftest import rank_threads, serve_encoder, span_input, spans_for

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def enc():
    with serve_encoder(1) as served:
        yield served


def offline_rows(pipeline, images: list[bytes]) -> torch.Tensor:
    """The offline path: OfflinePipeline's pixels through the model's ViT; [tokens, hidden]."""
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": "describe"}]
    request = pipeline.build_request(
        [{"role": "user", "content": content}], images, SamplingParams()
    )
    pixels = torch.cat(request.pixel_values)
    with torch.inference_mode(), rank_threads():
        return pipeline.engine.runner.model.encode_images(
            pixels, [s.grid_thw for s in request.spans]
        )


@pytest.mark.parametrize(
    "sizes", [[(64, 48)], [(90, 60), (40, 120)]], ids=["one-image", "two-sizes"]
)
async def test_written_rows_equal_the_offline_vit(enc, image_processor, pipeline, sizes) -> None:
    images = [image_bytes(w, h, seed=100 + i + len(sizes)) for i, (w, h) in enumerate(sizes)]
    expected = offline_rows(pipeline, images)
    prefill = enc.prefill()
    encoded, forwards = enc.counter("images_encoded"), enc.counter("vit_forwards")
    spans = spans_for(image_processor, images)
    num_rows = sum(s.span.length for s in spans)
    assert num_rows == expected.shape[0]
    dst = prefill.destination("req-1", 7, num_rows)  # any window of the buffer
    results = await enc.encode("req-1", spans, dst)
    assert [r.status for r in results] == [SpanStatus.WRITTEN] * len(images)
    assert [r.is_cache_hit for r in results] == [False] * len(images)
    assert [r.content_hash for r in results] == [s.span.content_hash for s in spans]
    torch.testing.assert_close(prefill.buffer.rows(7, num_rows), expected, rtol=0, atol=0)
    assert torch.isnan(prefill.buffer.tensor[:7]).all()  # nothing outside the window
    assert torch.isnan(prefill.buffer.tensor[7 + num_rows :]).all()
    assert enc.counter("images_encoded") - encoded == len(images)
    assert enc.counter("vit_forwards") - forwards == 1  # every image of the call in one ViT batch


async def test_same_image_twice_is_encoded_once(enc, image_processor) -> None:
    image = image_bytes(80, 80, seed=3)
    prefill = enc.prefill()
    encoded, hits, misses = (
        enc.counter(n) for n in ("images_encoded", "cache_hits", "cache_misses")
    )
    cache_bytes = enc.value("cache_bytes")
    span = span_input(image_processor, image, 0)
    first = await enc.encode("a", [span], prefill.destination("a", 0, span.span.length))
    rows_first = prefill.buffer.rows(0, span.span.length).clone()
    second = await enc.encode("b", [span], prefill.destination("b", 100, span.span.length))
    assert [r.is_cache_hit for r in first + second] == [False, True]
    assert torch.equal(prefill.buffer.rows(100, span.span.length), rows_first)
    assert enc.counter("images_encoded") - encoded == 1
    assert (enc.counter("cache_hits") - hits, enc.counter("cache_misses") - misses) == (1, 1)
    assert enc.value("cache_bytes") - cache_bytes == rows_first.numel() * 4


async def test_repeated_image_in_one_request_runs_the_vit_once(enc, image_processor) -> None:
    a, b = image_bytes(56, 84, seed=5), image_bytes(70, 70, seed=6)
    prefill = enc.prefill()
    encoded = enc.counter("images_encoded")
    spans = spans_for(image_processor, [a, b, a])
    num_rows = sum(s.span.length for s in spans)
    results = await enc.encode("r", spans, prefill.destination("r", 0, num_rows))
    assert [r.is_cache_hit for r in results] == [False, False, True]
    assert enc.counter("images_encoded") - encoded == 2
    first, third = spans[0], spans[2]
    rows = prefill.buffer.rows
    assert torch.equal(rows(third.dest_row, third.span.length), rows(0, first.span.length))


async def test_bad_requests_are_invalid_argument_and_the_server_keeps_serving(
    enc, image_processor
) -> None:
    good = span_input(image_processor, image_bytes(60, 60, seed=1), 0)
    not_image = b"definitely not an image"
    t, h, w = good.span.grid_thw
    replace = msgspec.structs.replace
    bad = {
        "bytes": replace(
            good,
            image_data=not_image,
            span=replace(good.span, content_hash=hashlib.sha256(not_image).hexdigest()),
        ),
        "grid": replace(
            good, span=replace(good.span, grid_thw=(t, h + 2, w), length=t * (h + 2) * w // 4)
        ),
        "length": replace(good, span=replace(good.span, length=good.span.length + 1)),
        "hash": replace(good, span=replace(good.span, content_hash="ab" * 32)),
        "rows": replace(good, dest_row=5),
    }
    params = {
        "bytes": "spans[0].image_data",
        "grid": "spans[0].span",
        "length": "spans[0].span.length",
        "hash": "spans[0].span.content_hash",
        "rows": "spans[0].dest_row",
    }
    prefill = enc.prefill()
    dst = prefill.destination("r", 0, good.span.length + 4)
    for name, span in bad.items():
        with pytest.raises(InvalidRequestError) as info:
            await enc.encode(f"bad-{name}", [span], dst)
        assert info.value.param == params[name], (name, info.value.message)
    results = await enc.encode("good", [good], dst)
    assert (
        results[0].status is SpanStatus.WRITTEN and not torch.isnan(prefill.buffer.rows(0, 1)).any()
    )


async def test_a_truncated_jpeg_is_invalid_argument(enc, image_processor) -> None:
    """The tokenizer reads headers only: a file cut short reaches the encoder, which refuses it."""
    whole = image_bytes(120, 90, seed=8, fmt="JPEG")
    cut = whole[: len(whole) // 2]
    good = span_input(image_processor, whole, 0)
    span = msgspec.structs.replace(
        good,
        image_data=cut,
        span=msgspec.structs.replace(good.span, content_hash=hashlib.sha256(cut).hexdigest()),
    )
    prefill = enc.prefill()
    with pytest.raises(InvalidRequestError, match="truncated or corrupt") as info:
        await enc.encode("cut", [span], prefill.destination("cut", 0, span.span.length))
    assert info.value.param == "spans[0].image_data"


async def test_a_cached_image_with_the_wrong_grid_is_still_invalid(enc, image_processor) -> None:
    good = span_input(image_processor, image_bytes(60, 60, seed=2), 0)
    t, h, w = good.span.grid_thw
    wrong_span = msgspec.structs.replace(
        good.span, grid_thw=(t, w + 2, h), length=t * (w + 2) * h // 4
    )
    wrong = msgspec.structs.replace(good, span=wrong_span)
    dst = enc.prefill().destination("r", 0, 64)
    await enc.encode("warm", [good], dst)
    with pytest.raises(InvalidRequestError, match="does not match the image's grid"):
        await enc.encode("wrong", [wrong], dst)


async def test_one_bad_request_does_not_fail_its_batch_neighbours(enc, image_processor) -> None:
    junk = b"junk bytes"
    prefill = enc.prefill()
    encoded = enc.counter("images_encoded")
    good = [
        span_input(image_processor, image_bytes(56, 56 + 28 * i, seed=20 + i), 0) for i in range(4)
    ]
    bad = msgspec.structs.replace(
        good[0],
        image_data=junk,
        span=msgspec.structs.replace(good[0].span, content_hash=hashlib.sha256(junk).hexdigest()),
    )
    dsts = [prefill.destination(f"r{i}", 200 * i, 200) for i in range(5)]
    calls = [enc.encode(f"r{i}", [s], dsts[i]) for i, s in enumerate(good)]
    calls.append(enc.encode("bad", [bad], dsts[4]))
    outcomes = await asyncio.gather(*calls, return_exceptions=True)
    assert all(isinstance(o, list) and o[0].status is SpanStatus.WRITTEN for o in outcomes[:4])
    assert isinstance(outcomes[4], InvalidRequestError)
    assert enc.counter("images_encoded") - encoded == 4


async def test_a_dead_destination_is_unavailable_not_a_hang(enc, image_processor) -> None:
    span = span_input(image_processor, image_bytes(56, 56, seed=4), 0)
    prefill = enc.prefill()
    dst = prefill.destination("r", 0, span.span.length)
    prefill.close()  # prefill went away: its segment is unlinked, the encoder cannot map it
    failed = enc.counter("requests", outcome="UnavailableError")
    with pytest.raises(UnavailableError):
        await enc.encode("r", [span], dst)
    assert enc.counter("requests", outcome="UnavailableError") - failed == 1


async def test_wrong_backend_and_hidden_size_are_invalid(enc, image_processor) -> None:
    span = span_input(image_processor, image_bytes(56, 56, seed=4), 0)
    dst = enc.prefill().destination("r", 0, span.span.length)
    for field, value in (("backend", "mooncake"), ("hidden_size", 7)):
        with pytest.raises(InvalidRequestError) as info:
            await enc.encode("r", [span], msgspec.structs.replace(dst, **{field: value}))
        assert info.value.param == f"embedding_refs[0].{field}"


async def test_rows_are_cast_to_the_destination_dtype(enc, image_processor) -> None:
    span = span_input(image_processor, image_bytes(56, 56, seed=9), 0)
    fp32, bf16 = enc.prefill(), enc.prefill(num_rows=64, dtype=torch.bfloat16)
    await enc.encode("fp32", [span], fp32.destination("fp32", 0, span.span.length))
    await enc.encode("bf16", [span], bf16.destination("bf16", 0, span.span.length))
    rows = span.span.length
    assert torch.equal(bf16.buffer.rows(0, rows), fp32.buffer.rows(0, rows).bfloat16())


async def test_every_destination_gets_every_row(enc, image_processor) -> None:
    images = [image_bytes(56, 84, seed=30), image_bytes(84, 56, seed=31)]
    spans = spans_for(image_processor, images)
    num_rows = sum(s.span.length for s in spans)
    prefills = [enc.prefill(), enc.prefill()]  # two prefill ranks of one request
    dsts = [p.destination("cp", 10 * i, num_rows) for i, p in enumerate(prefills)]
    await enc.encode("cp", spans, dsts)
    assert torch.equal(prefills[0].buffer.rows(0, num_rows), prefills[1].buffer.rows(10, num_rows))
    assert not torch.isnan(prefills[0].buffer.rows(0, num_rows)).any()


async def test_no_spans_is_an_empty_answer(enc) -> None:
    assert await enc.encode("r", [], enc.prefill().destination("r", 0, 1)) == []


def test_domain_types_round_trip(image_processor) -> None:
    span = span_input(image_processor, image_bytes(56, 56), 3)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(span), type=EncodeSpanInput) == span
    result = SpanResult("ab" * 32, SpanStatus.WRITTEN, True, 1)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(result), type=SpanResult) == result


class RecordingClient(VisionEncoderClient):
    """A client that records the image bytes of every span of every call it sends."""

    def __init__(self, address: str) -> None:
        super().__init__(address)
        self.sent: list[list[int]] = []  # per call: each span's image_data length
        encode = self._stub.Encode

        async def recorded(request, **kwargs):
            self.sent.append([len(s.image_data) for s in request.spans])
            return await encode(request, **kwargs)

        self._stub.Encode = recorded


async def test_an_image_s_bytes_are_sent_until_the_encoder_holds_it(enc, image_processor) -> None:
    image, other = image_bytes(72, 72, seed=21), image_bytes(64, 40, seed=22)
    prefill = enc.prefill()
    client = RecordingClient(enc.address)
    try:
        span = span_input(image_processor, image, 0)
        n = span.span.length
        first = await client.encode("a", [span], prefill.destination("a", 0, n), 30)
        rows = prefill.buffer.rows(0, n).clone()
        second = await client.encode("b", [span], prefill.destination("b", 200, n), 30)
        assert [r.is_cache_hit for r in first + second] == [False, True]
        assert client.sent == [[len(image)], [0]]  # the second call carried no bytes
        assert torch.equal(prefill.buffer.rows(200, n), rows)

        # The encoder forgot it (a re-formed rank starts with empty ledger entries): the
        # call without bytes writes nothing, then goes again with every span's bytes.
        needed = enc.counter("requests", outcome="needs_image_data")
        enc.run(_forget_cache(enc))
        both = [span, span_input(image_processor, other, n)]
        num_rows = n + both[1].span.length
        results = await client.encode("c", both, prefill.destination("c", 400, num_rows), 30)
        assert [r.status for r in results] == [SpanStatus.WRITTEN] * 2
        assert client.sent[2:] == [[0, len(other)], [len(image), len(other)]]
        assert enc.counter("requests", outcome="needs_image_data") - needed == 1
        assert torch.equal(prefill.buffer.rows(400, n), rows)
        assert client.sent[4:] == []
        await client.encode("d", both, prefill.destination("d", 600, num_rows), 30)
        assert client.sent[4:] == [[0, 0]]
    finally:
        await client.close()


async def _forget_cache(enc) -> None:
    for rank in range(enc.num_ranks):
        enc.app.leader.on_rank_down(rank)


async def test_a_cache_only_call_encodes_ahead_and_writes_nowhere(enc, image_processor) -> None:
    """The router's prefetch: a ``cache_only`` call runs the ViT into the owner's cache and
    touches no buffer; the call that writes the rows then hits it. The client sends each
    distinct image once and nothing for images it already got cached."""
    image, other = image_bytes(66, 54, seed=31), image_bytes(54, 66, seed=32)
    prefill = enc.prefill()
    client = RecordingClient(enc.address)
    try:
        spans = spans_for(image_processor, [image, other, image])
        refs = [s.span for s in spans]
        data = {s.span.content_hash: s.image_data for s in spans}
        encoded, hits, misses = (
            enc.counter(n) for n in ("images_encoded", "cache_hits", "cache_misses")
        )
        cached = enc.counter("cache_only_spans")
        results = await client.cache("pre", refs, data, 30)
        assert [r.status for r in results] == [SpanStatus.WRITTEN] * 2  # each image once
        assert client.sent == [[len(image), len(other)]]
        assert torch.isnan(prefill.buffer.tensor).all()  # nothing written anywhere
        assert enc.counter("images_encoded") - encoded == 2
        assert enc.counter("cache_only_spans") - cached == 2
        # hits and misses count the calls that write rows only
        assert (enc.counter("cache_hits") - hits, enc.counter("cache_misses") - misses) == (0, 0)
        assert await client.cache("again", refs, data, 30) == []  # known cached: nothing sent
        assert len(client.sent) == 1

        num_rows = sum(s.span.length for s in spans)
        written = await enc.encode("req", spans, prefill.destination("req", 0, num_rows))
        assert [r.is_cache_hit for r in written] == [True, True, True]
        assert enc.counter("images_encoded") - encoded == 2  # no ViT run for the writing call
    finally:
        await client.close()


async def test_cache_only_takes_no_destination_and_a_write_needs_one(enc, image_processor) -> None:
    span = span_input(image_processor, image_bytes(40, 40, seed=33), 0)
    dst = enc.prefill().destination("x", 0, span.span.length)
    client = VisionEncoderClient(enc.address)
    try:
        for cache_only, refs in ((True, [dst]), (False, [])):
            request = encode_request_to_proto("x", [span], refs)
            request.cache_only = cache_only
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await client._stub.Encode(request, timeout=30)
            assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert "embedding_refs" in info.value.details()
    finally:
        await client.close()
