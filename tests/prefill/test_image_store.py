"""Images sent once: a router's PrefillClient names an image the worker already got by its hash
alone, the worker takes the bytes from its ImageStore (here: to hand the encoder, which asks
for them), and a worker that no longer holds the image answers ImageDataNeededError before
using the KvRef, so the client's resend with the bytes succeeds on the same reservation."""

from __future__ import annotations

import pytest

from services.common.errors import ImageDataNeededError
from services.common.types import SamplingParams
from services.prefill.image_store import ImageStore
from tests.conftest import image_bytes
from tests.prefill.conftest import Harness, make_case, reference
from tests.prefill.test_service import assert_matches


def test_the_store_resolves_sent_then_held_images_and_keeps_the_recent_ones() -> None:
    store = ImageStore(max_bytes=10)
    with pytest.raises(ImageDataNeededError, match="image.*b, c"):
        store.resolve(["a", "b", "c"], {"a": b"1"})
    store.put({"a": b"aaaa", "b": b"bbbb"})
    assert store.resolve(["a", "b", "a"], {}) == {"a": b"aaaa", "b": b"bbbb"}
    assert store.resolve(["a"], {"a": b"sent"}) == {"a": b"sent"}  # what the call brings wins
    store.resolve(["a"], {})  # a used most recently: b goes first
    store.put({"c": b"cccc"})
    assert len(store) == 2 and store.num_bytes == 8
    with pytest.raises(ImageDataNeededError, match="b"):
        store.resolve(["b"], {})
    store.put({"huge": b"x" * 11, "empty": b""})  # larger than the store, or empty: not held
    assert len(store) == 2 and store.num_bytes == 8


def _count_sent(harness: Harness) -> list[int]:
    """Images with bytes in each Prefill call the client makes."""
    sent: list[int] = []
    stub = harness.client._stub
    call = stub.Prefill

    async def counting(request, **kwargs):
        sent.append(len(request.images))
        return await call(request, **kwargs)

    stub.Prefill = counting
    return sent


async def test_an_image_goes_once_and_later_calls_name_it(pipeline, harness: Harness) -> None:
    image = image_bytes(120, 80, seed=11)
    greedy = SamplingParams(temperature=0.0)
    cases = [make_case(pipeline, f"again-{i}", "Describe it.", [image], greedy) for i in range(3)]
    ref = reference(pipeline, cases[0])
    sent = _count_sent(harness)
    for case in cases[:2]:
        result, dst = await harness.prefill(case)
        assert_matches(harness, case, result, dst, ref)
    assert sent == [1, 0] and len(harness.images) == 1
    # the second Encode went by hash; the encoder (no cache) asked for the bytes, and the
    # resend took them from the store
    assert harness.encoder.num_calls == 3
    harness.images.resolve([cases[0].prompt.spans[0].content_hash], {})  # held
    # evicted by a store-sized image: the call by hash fails before the KvRef is used, and the
    # resend with the bytes succeeds on the same reservation
    harness.images.put({"other": b"x" * harness.images.max_bytes})
    assert len(harness.images) == 1
    result, dst = await harness.prefill(cases[2])
    assert_matches(harness, cases[2], result, dst, ref)
    assert sent == [1, 0, 0, 1]
    harness.assert_all_free()
