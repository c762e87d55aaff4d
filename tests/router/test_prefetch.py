"""The router's image prefetch (services/router/prefetch.py): a request's images go to the one
ready encoder as a cache_only call in the background; no encoder, several, a text prompt or
the flag off send nothing; a failed prefetch is logged, never the request's error."""

from __future__ import annotations

import asyncio
import logging

import pytest

from services.common.errors import UnavailableError
from services.common.types import ImageSpanRef, TokenizedPrompt
from services.router.prefetch import ImagePrefetcher
from services.router.workers import Worker, WorkerKind, WorkerState

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
