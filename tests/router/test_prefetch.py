"""The router's image prefetch (services/router/prefetch.py): a request's images go to the one
ready encoder as a cache_only call in the background, before tokenization with the grids the
tokenizer gives them, after it the images not sent yet; no encoder, several, a text prompt or
the flag off send nothing; a failed prefetch is logged, never the request's error."""

from __future__ import annotations

import asyncio
import logging

import pytest
from msgspec.structs import replace

from services.common.clients.tokenizer import read_image_headers
from services.common.errors import UnavailableError
from services.common.types import ChatMessage, ImagePart, ImageSpanRef, TextPart, TokenizedPrompt
from services.engine.processing import ImageProcessor
from services.router.prefetch import ImagePrefetcher
from services.router.workers import Worker, WorkerKind, WorkerState
from services.tokenizer.config import Limits
from services.tokenizer.pipeline import TokenizePipeline
from tests.conftest import TINY_MODEL_DIR, image_bytes

SPAN = ImageSpanRef(offset=3, length=4, content_hash="h1", grid_thw=(1, 4, 4))
IMAGE_PROMPT = TokenizedPrompt((1, 2, 3, 9, 9, 9, 9, 4), spans=(SPAN,), images={"h1": b"jpeg"})


class FakeEncoder:
    def __init__(self, error: Exception | None = None) -> None:
        self.calls: list[tuple] = []
        self.error = error

    async def cache(self, request_id, spans, images, timeout_s):
        self.calls.append((request_id, tuple(spans), dict(images), timeout_s))
        if self.error is not None:
            raise self.error
        return []


class FakeRegistry:
    def __init__(self, *workers: Worker) -> None:
        self.workers = list(workers)

    def ready_workers(self, kind: WorkerKind) -> list[Worker]:
        return [w for w in self.workers if w.kind is kind and w.is_ready]


def _encoder(client, state: WorkerState = WorkerState.READY) -> Worker:
    return Worker(WorkerKind.ENCODER, f"enc-{id(client)}:1", client, state)


def _prefetcher(registry: FakeRegistry, **kwargs) -> tuple[ImagePrefetcher, list]:
    spawned: list = []
    return ImagePrefetcher(registry, lambda coro, name: spawned.append((coro, name)), **kwargs), (
        spawned
    )


async def test_the_images_go_to_the_one_ready_encoder_in_the_background() -> None:
    client = FakeEncoder()
    prefetcher, spawned = _prefetcher(FakeRegistry(_encoder(client)))
    assert prefetcher.start("r1", IMAGE_PROMPT, 30.0)
    assert client.calls == []  # nothing ran yet: it is a task of its own
    [(coro, name)] = spawned
    assert name == "prefetch-r1"
    await coro
    assert client.calls == [("r1", (SPAN,), {"h1": b"jpeg"}, 30.0)]


@pytest.mark.parametrize(
    "case",
    ["text prompt", "no encoder", "encoder not ready", "two encoders", "flag off"],
)
async def test_nothing_is_sent_without_one_ready_encoder_or_an_image(case: str) -> None:
    client = FakeEncoder()
    workers = {
        "text prompt": [_encoder(client)],
        "no encoder": [],
        "encoder not ready": [_encoder(client, WorkerState.NOT_READY)],
        "two encoders": [_encoder(client), _encoder(FakeEncoder())],
        "flag off": [_encoder(client)],
    }[case]
    prompt = TokenizedPrompt((1, 2, 3)) if case == "text prompt" else IMAGE_PROMPT
    prefetcher, spawned = _prefetcher(FakeRegistry(*workers), is_enabled=case != "flag off")
    assert not prefetcher.start("r1", prompt, 30.0)
    assert spawned == [] and client.calls == []


async def test_a_failed_prefetch_is_logged_not_raised(caplog) -> None:
    client = FakeEncoder(UnavailableError("the encoder is restarting"))
    prefetcher, spawned = _prefetcher(FakeRegistry(_encoder(client)))
    assert prefetcher.start("r1", IMAGE_PROMPT, 30.0)
    with caplog.at_level(logging.INFO, logger="services.router.prefetch"):
        await asyncio.wait_for(spawned[0][0], 5)
    assert "the encoder is restarting" in caplog.text


def _messages(*images: bytes) -> list[ChatMessage]:
    return [ChatMessage("user", (TextPart("look"), *(ImagePart(d) for d in images)))]


async def test_before_tokenization_the_spans_are_the_tokenizers_but_for_offsets() -> None:
    """The images whose header tells their size go with the grid and length the tokenizer
    gives them (the router's processor is the checkpoint's); one without such a header is
    left to the prefetch after tokenization."""
    jpeg, png = image_bytes(130, 70, seed=1, fmt="JPEG"), image_bytes(60, 90, seed=2)
    unreadable = b"not an image"
    messages = _messages(jpeg, png, jpeg, unreadable)
    headers = read_image_headers(messages)
    assert headers[3] is None
    client = FakeEncoder()
    prefetcher, spawned = _prefetcher(
        FakeRegistry(_encoder(client)), processor=ImageProcessor.from_dir(TINY_MODEL_DIR)
    )
    images = [jpeg, png, jpeg, unreadable]
    sent = prefetcher.start_from_headers("r1", images, headers, 30.0)
    [(coro, name)] = spawned
    await coro
    [(request_id, spans, by_hash, timeout_s)] = client.calls
    pipeline = TokenizePipeline.from_dir(TINY_MODEL_DIR, Limits(max_model_len=4096))
    tokenized = pipeline.tokenize_chat(_messages(jpeg, png, jpeg))
    assert [replace(s, offset=0) for s in tokenized.spans] == list(spans)
    assert by_hash == tokenized.images and sent == set(tokenized.images)
    assert (request_id, name, timeout_s) == ("r1", "prefetch-r1", 30.0)
    # After tokenization only what was not sent goes (here: nothing left, so no call).
    assert not prefetcher.start("r1", tokenized, 30.0, sent)
    assert prefetcher.start("r1", tokenized, 30.0, sent - {spans[0].content_hash})
    await spawned[1][0]
    assert {s.content_hash for s in client.calls[1][1]} == {spans[0].content_hash}


async def test_before_tokenization_nothing_goes_without_the_checkpoints_processor() -> None:
    messages = _messages(image_bytes(40, 40, seed=3))
    client = FakeEncoder()
    prefetcher, spawned = _prefetcher(FakeRegistry(_encoder(client)))
    data = [image_bytes(40, 40, seed=3)]
    assert prefetcher.start_from_headers("r1", data, read_image_headers(messages), 30.0) == set()
    assert spawned == []
