"""``stageserve.client`` against a router serving fake workers: results, streams, images by
bytes and by URL, the API key, deadlines, request ids, and every failure as its typed error.

The blocking ``Client`` runs in a thread (``asyncio.to_thread``): the router serves from this
test's event loop.
"""

from __future__ import annotations

import asyncio
import base64
import socket

import pytest

from services.common.auth import API_KEY, Credentials
from services.common.server import REQUEST_ID_KEY
from services.router.auth import RouterAccess
from services.router.image_fetch import GuardedBackend
from services.router.images import ImageLoader
from stageserve.client import (
    AbortedError,
    AsyncClient,
    Client,
    DeadlineExceededError,
    FinishReason,
    Image,
    InvalidRequestError,
    Message,
    NotFoundError,
    Sampling,
    UnauthenticatedError,
    UnavailableError,
    calls,
)
from tests.conftest import image_bytes
from tests.router.conftest import BOUND_S, router_config, start_router, stop_router
from tests.router.fakes import HANG_S
from tests.router.net_fakes import PUBLIC_IP, FakeNetwork, FakeResolver, http_response

EXPECTED = "Hello there, world!"
GREEDY = Sampling(temperature=0, max_new_tokens=100)


def address(router) -> str:
    return f"127.0.0.1:{router.grpc_port}"


def chat(*parts: str | Image) -> list[Message]:
    return [Message("user", list(parts))]


async def test_generate_returns_the_whole_completion(router, cluster):
    with Client(address(router), timeout_s=BOUND_S) as client:
        done = await asyncio.to_thread(
            client.generate, messages=chat(Image(image_bytes(30, 30)), "hi"), sampling=GREEDY
        )
    assert done.text == EXPECTED
    assert list(done.token_ids) == cluster.script.output_ids
    assert done.finish_reason is FinishReason.STOP
    assert done.usage.num_completion_tokens == len(cluster.script.output_ids)
    assert len(done.request_id) == 32  # the client's fresh uuid4().hex
    assert len(cluster.prefill.requests[0].images) == 1


async def test_stream_yields_chunks_with_the_request_id_and_the_ending_last(router):
    def read() -> list:
        with Client(address(router), timeout_s=BOUND_S) as client:
            with client.stream("Once", sampling=GREEDY, request_id="mine-1") as stream:
                assert stream.request_id == "mine-1"
                return list(stream)

    chunks = await asyncio.to_thread(read)
    assert len(chunks) > 1
    assert "".join(c.text for c in chunks) == EXPECTED
    assert {c.request_id for c in chunks} == {"mine-1"}
    assert all(c.finish_reason is None and c.usage is None for c in chunks[:-1])
    assert chunks[-1].finish_reason is FinishReason.STOP and chunks[-1].usage is not None


async def test_async_client_streams_and_generates_concurrently(router):
    async with AsyncClient(address(router), timeout_s=BOUND_S) as client:
        async with client.stream(messages=chat("hi"), sampling=GREEDY) as stream:
            texts = [chunk.text async for chunk in stream]
        many = await asyncio.gather(
            *(client.generate("Once", sampling=GREEDY, stop=["there"]) for _ in range(3))
        )
    assert "".join(texts) == EXPECTED
    assert [done.text for done in many] == ["Hello "] * 3
    assert len({done.request_id for done in many}) == 3


async def test_images_by_url_are_fetched_by_the_router(cluster):
    image = image_bytes(20, 20)

    def serve(path: str) -> bytes:
        return http_response(404) if path == "/missing.png" else http_response(200, image)

    network = FakeNetwork({PUBLIC_IP: serve})
    cfg = router_config(cluster)
    backend = GuardedBackend(False, FakeResolver({"images.test": [PUBLIC_IP]}), network)
    router = await start_router(cfg, ImageLoader.from_limits(cfg.limits, backend))
    data_url = f"data:image/png;base64,{base64.b64encode(image).decode()}"
    try:
        async with AsyncClient(address(router), timeout_s=BOUND_S) as client:
            for url in ("https://images.test/cat.png", data_url):
                done = await client.generate(messages=chat(Image(url=url), "hi"), sampling=GREEDY)
                assert done.text == EXPECTED
            with pytest.raises(InvalidRequestError) as info:
                await client.generate(
                    messages=chat("hi", Image(url="https://images.test/missing.png")),
                    request_id="bad-url",
                )
    finally:
        await stop_router(router)
    assert info.value.param == "chat.messages[0].content[1].image.url"
    assert info.value.request_id == "bad-url"
    kinds = [
        [part.WhichOneof("part") for part in r.chat.messages[0].content]
        for r in cluster.tokenizer.servicer.requests
    ]
    assert kinds == [["image_header", "text"]] * 2  # as bytes the router fetched and read
    assert network.attempted_ips() == {PUBLIC_IP}


async def test_router_errors_arrive_as_their_classes_with_param_and_request_id(router):
    async with AsyncClient(address(router), timeout_s=BOUND_S) as client:
        with pytest.raises(NotFoundError) as not_found:
            await client.generate("x", model="other", request_id="r-404")
        with pytest.raises(InvalidRequestError) as invalid:
            await client.generate("x", sampling=Sampling(temperature=-1))
        with pytest.raises(InvalidRequestError) as bad_image:
            await client.generate(messages=chat(Image(b"not an image")))
    assert (not_found.value.param, not_found.value.request_id) == ("model", "r-404")
    assert "other" in not_found.value.message
    assert invalid.value.param == "temperature"
    assert bad_image.value.param == "chat.messages[0].content[0].image.data"


async def test_the_api_key_is_sent_and_a_missing_one_is_unauthenticated(cluster):
    access = RouterAccess(api_key=Credentials("sesame", API_KEY))
    router = await start_router(router_config(cluster), access=access)
    try:
        async with AsyncClient(address(router), api_key="sesame", timeout_s=BOUND_S) as client:
            assert (await client.generate("Once", sampling=GREEDY)).text == EXPECTED
        for key in (None, "wrong"):
            async with AsyncClient(address(router), api_key=key, timeout_s=BOUND_S) as client:
                with pytest.raises(UnauthenticatedError):
                    await client.generate("Once")
    finally:
        await stop_router(router)


async def test_the_deadline_ends_a_call_that_takes_longer(router, cluster):
    cluster.script.chunk_delay_s = HANG_S
    with Client(address(router), timeout_s=BOUND_S) as client:
        with pytest.raises(DeadlineExceededError) as info:
            await asyncio.to_thread(client.generate, "Once", timeout_s=0.5, request_id="slow")
    assert info.value.request_id == "slow"


async def test_cancel_ends_the_stream_with_aborted(router, cluster):
    cluster.script.chunk_delay_s = HANG_S
    async with AsyncClient(address(router), timeout_s=BOUND_S) as client:
        stream = client.stream("Once")
        stream.cancel()
        with pytest.raises(AbortedError):
            await stream.completion()


async def test_no_router_at_the_address_is_unavailable():
    with socket.socket() as probe:  # a port nothing listens on once it is closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    async with AsyncClient(f"127.0.0.1:{port}", timeout_s=BOUND_S) as client:
        with pytest.raises(UnavailableError):
            await client.generate("Once")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"prompt": "x", "messages": chat("x")},
        {},
        {"prompt": "x", "sampling": Sampling(max_new_tokens=-1)},
        {"prompt": "x", "sampling": Sampling(top_k=2**40)},
        {"messages": [Message("user", [b"bytes are no part"])]},
        {"prompt": "x", "timeout_s": 0},
    ],
    ids=["both-inputs", "no-input", "negative-uint", "overflow", "bad-part", "zero-timeout"],
)
def test_input_the_proto_cannot_carry_is_refused_before_sending(kwargs):
    with Client("127.0.0.1:1") as client, pytest.raises(InvalidRequestError):
        client.stream(**kwargs)


def test_images_and_keys_are_checked_where_they_are_made():
    with pytest.raises(InvalidRequestError):
        Image()
    with pytest.raises(InvalidRequestError):
        Image(data=b"x", url="https://images.test/x.png")
    with pytest.raises(InvalidRequestError) as info:
        Client("127.0.0.1:1", api_key="two words")
    assert info.value.param == "api_key"


def test_the_request_id_rides_in_the_metadata_every_service_logs():
    assert calls.REQUEST_ID_KEY == REQUEST_ID_KEY
    spec = calls.call_spec(
        prompt="x",
        messages=None,
        sampling=None,
        stop=(),
        model="",
        request_id="abc",
        timeout_s=None,
        credentials=Credentials("k", API_KEY),
    )
    assert spec.metadata == ((REQUEST_ID_KEY, "abc"), ("authorization", "Bearer k"))
    assert spec.request.request_id == "abc"
    assert not spec.request.sampling_params.ListFields()  # every field: the server's default
