"""Image URL fetching: no connection to non-public addresses (SSRF), redirects capped and
re-checked, one total deadline, one message for every way a fetch can fail to connect."""

from __future__ import annotations

import asyncio
import ipaddress
import time

import pytest

from services.common.errors import InvalidRequestError
from services.router.config import LimitsConfig
from services.router.image_fetch import (
    BAD_HOST_NAME,
    NON_PUBLIC,
    UNREACHABLE,
    GuardedBackend,
    ImageFetcher,
    SystemResolver,
    is_dns_name,
    is_public_address,
)
from services.router.images import ImageLoader
from tests.conftest import image_bytes
from tests.router.net_fakes import (
    OTHER_PUBLIC_IP,
    PUBLIC_IP,
    FakeNetwork,
    FakeResolver,
    http_response,
    redirect,
)

PNG = image_bytes(20, 20)
PARAM = "messages[0].content[0].image_url"
RESOLVER_ANSWERS = {
    "images.test": [PUBLIC_IP],
    "cdn.test": [OTHER_PUBLIC_IP],
    "evil.test": ["127.0.0.1"],
    "metadata.test": ["169.254.169.254"],
    "mixed.test": ["10.0.0.1", PUBLIC_IP],
    "v6loop.test": ["::1"],
    "2130706433": ["127.0.0.1"],  # what getaddrinfo makes of a decimal IPv4 literal
}


def serve_images(path: str) -> bytes:
    routes = {
        "/cat.png": http_response(200, PNG),
        "/to-metadata": redirect("http://169.254.169.254/latest/meta-data/"),
        "/to-evil": redirect("http://evil.test/x.png"),
        "/to-cdn": redirect("http://cdn.test/cat.png", 301),
        "/relative": redirect("/cat.png", 307),
        "/loop": redirect("/loop"),
        "/to-file": redirect("file:///etc/passwd"),
        "/no-location": http_response(302),
        "/missing": http_response(404),
        "/huge-declared": http_response(200, b"x" * 10, [("x-pad", "y")]).replace(
            b"content-length: 10", b"content-length: 999999999"
        ),
        "/huge": http_response(200, b"x" * 5000),
        "/not-http": b"SSH-2.0-OpenSSH_9.6\r\n",
        "/closed": b"",
    }
    return routes.get(path, http_response(404))


def make_fetcher(
    network: FakeNetwork,
    *,
    allow_private: bool = False,
    max_redirects: int = 3,
    resolver: FakeResolver | None = None,
) -> ImageFetcher:
    backend = GuardedBackend(
        allow_private, resolver or FakeResolver(dict(RESOLVER_ANSWERS)), network
    )
    return ImageFetcher(backend, max_image_bytes=4096, timeout_s=5.0, max_redirects=max_redirects)


@pytest.fixture
def network() -> FakeNetwork:
    servers = {
        ip: serve_images
        for ip in (PUBLIC_IP, OTHER_PUBLIC_IP, "127.0.0.1", "169.254.169.254", "10.0.0.1", "::1")
    }
    return FakeNetwork(servers)


async def fetch(fetcher: ImageFetcher, url: str) -> bytes:
    try:
        return await fetcher.fetch(url, PARAM)
    finally:
        await fetcher.close()


@pytest.mark.parametrize(
    "url",
    [
        "http://169.254.169.254/latest/meta-data/",
        "http://10.0.0.1/x.png",
        "http://[::1]:9/",
        "http://[::ffff:127.0.0.1]/x.png",
        "http://[::ffff:a9fe:a9fe]/",
        "http://0.0.0.0:1/",
        "https://127.0.0.1/x.png",
        "http://224.0.0.1/x.png",
    ],
)
async def test_non_public_literals_are_refused_without_a_connection(network, url):
    with pytest.raises(InvalidRequestError, match="non-public address") as info:
        await fetch(make_fetcher(network), url)
    assert info.value.param == PARAM
    assert network.attempts == []


@pytest.mark.parametrize(
    "url",
    [
        "http://evil.test/x.png",
        "http://metadata.test/",
        "http://v6loop.test/",
        "http://2130706433/x.png",
        "http://images.test/to-metadata",
        "http://images.test/to-evil",
    ],
)
async def test_names_and_redirects_to_non_public_addresses_never_connect_there(network, url):
    with pytest.raises(InvalidRequestError) as info:
        await fetch(make_fetcher(network), url)
    assert info.value.message in (UNREACHABLE, NON_PUBLIC)
    assert network.attempted_ips() <= {PUBLIC_IP}


async def test_a_name_with_public_and_private_addresses_connects_to_the_public_one(network):
    assert await fetch(make_fetcher(network), "http://mixed.test/cat.png") == PNG
    assert network.attempted_ips() == {PUBLIC_IP}


async def test_dns_rebinding_is_checked_at_every_connection(network):
    resolver = FakeResolver({"rebind.test": [[PUBLIC_IP], ["127.0.0.1"]]})
    fetcher = make_fetcher(network, resolver=resolver)
    try:
        assert (
            await fetcher.fetch("http://rebind.test/cat.png", PARAM) == PNG
        )  # first answer: public
        with pytest.raises(InvalidRequestError, match=UNREACHABLE):
            await fetcher.fetch("http://rebind.test/cat.png", PARAM)  # the name now points inside
    finally:
        await fetcher.close()
    assert resolver.lookups == ["rebind.test", "rebind.test"]
    assert network.attempted_ips() == {PUBLIC_IP}


async def test_a_peer_that_is_not_the_checked_address_is_refused():
    network = FakeNetwork({PUBLIC_IP: serve_images}, peer_override="127.0.0.1")
    with pytest.raises(InvalidRequestError, match=UNREACHABLE):
        await fetch(make_fetcher(network), "http://images.test/cat.png")


async def test_allowed_redirects_are_followed_and_checked(network):
    assert await fetch(make_fetcher(network), "http://images.test/to-cdn") == PNG
    assert network.attempted_ips() == {PUBLIC_IP, OTHER_PUBLIC_IP}
    assert await fetch(make_fetcher(network), "http://images.test/relative") == PNG


async def test_redirects_are_capped(network):
    with pytest.raises(InvalidRequestError, match="more than 3 redirects"):
        await fetch(make_fetcher(network), "http://images.test/loop")
    assert len(network.attempts) == 4  # the URL and three redirects
    with pytest.raises(InvalidRequestError, match="more than 0 redirects"):
        await fetch(make_fetcher(network, max_redirects=0), "http://images.test/relative")


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("/to-file", "data: URL or an http"),
        ("/no-location", "HTTP 302 without a Location"),
        ("/missing", "HTTP 404"),
        ("/huge-declared", "larger than the limit of 4096 bytes"),
        ("/huge", "larger than the limit of 4096 bytes"),
    ],
)
async def test_bad_answers(network, path, message):
    with pytest.raises(InvalidRequestError, match=message):
        await fetch(make_fetcher(network), f"http://images.test{path}")


@pytest.mark.parametrize(
    "url",
    [
        "http://images.test/not-http",
        "http://images.test/closed",
        "http://nowhere.test/x.png",
        "http://cdn.test:81/x.png",
    ],
)
async def test_connection_failures_share_one_message(url):
    network = FakeNetwork({PUBLIC_IP: serve_images})  # cdn.test has no server: refused
    with pytest.raises(InvalidRequestError) as info:
        await fetch(make_fetcher(network), url)
    assert info.value.message == UNREACHABLE


@pytest.mark.parametrize(
    "host",
    [
        "a" * 64 + ".test",
        "a" * 300,
        ("a" * 60 + ".") * 5 + "test",
        "a..test",
        ".a.test",
        "a.test..",
    ],
)
async def test_host_names_without_a_dns_form_are_refused_before_resolving(network, host):
    resolver = FakeResolver(dict(RESOLVER_ANSWERS))
    with pytest.raises(InvalidRequestError) as info:
        await fetch(make_fetcher(network, resolver=resolver), f"http://{host}/x.png")
    assert info.value.message == BAD_HOST_NAME and info.value.param == PARAM
    assert resolver.lookups == [] and network.attempts == []


@pytest.mark.parametrize(
    ("raw_host", "is_valid"),
    [
        (b"images.test", True),
        (b"images.test.", True),
        (b"a" * 63 + b".test", True),
        (b"xn--bcher-kva.de", True),
        ((b"a" * 63 + b".") * 3 + b"a" * 61, True),  # 253
        ((b"a" * 63 + b".") * 3 + b"a" * 62, False),  # 254
        (b"a" * 64 + b".test", False),
        (b"a..test", False),
        (b"", False),
        (b".", False),
    ],
)
def test_is_dns_name(raw_host, is_valid):
    assert is_dns_name(raw_host) is is_valid


async def test_the_system_resolver_turns_an_idna_failure_into_an_oserror():
    with pytest.raises(OSError, match="not a valid host name"):
        await SystemResolver().resolve("a" * 64 + ".invalid", 80)


async def test_private_addresses_can_be_allowed(network):
    assert await fetch(make_fetcher(network, allow_private=True), "http://127.0.0.1/cat.png") == PNG
    assert await fetch(make_fetcher(network, allow_private=True), "http://evil.test/cat.png") == PNG
    assert network.attempted_ips() == {"127.0.0.1"}


@pytest.mark.parametrize(
    ("address", "is_public"),
    [
        ("93.184.216.34", True),
        ("2606:4700::1111", True),
        ("::ffff:8.8.8.8", True),
        ("10.0.0.1", False),
        ("172.16.0.1", False),
        ("192.168.1.1", False),
        ("127.0.0.1", False),
        ("169.254.169.254", False),
        ("100.64.0.1", False),
        ("0.0.0.0", False),
        ("224.0.0.1", False),
        ("240.0.0.1", False),
        ("255.255.255.255", False),
        ("::1", False),
        ("::", False),
        ("fe80::1", False),
        ("fc00::1", False),
        ("fec0::1", False),
        ("ff02::1", False),
        ("::ffff:127.0.0.1", False),
        ("::ffff:169.254.169.254", False),
        ("64:ff9b::a9fe:a9fe", False),
        ("2002:a9fe:a9fe::1", False),
        ("2001:0:4136:e378:8000:63bf:3fff:fdd2", False),
        ("::7f00:1", False),
    ],
)
def test_is_public_address(address, is_public):
    assert is_public_address(ipaddress.ip_address(address)) is is_public


async def test_a_dripping_server_is_cut_at_the_total_deadline():
    """One byte every 0.3 s never trips a per-read timeout; the fetch's total deadline cuts it."""
    sent = []

    async def drip(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n")
        try:
            for _ in range(1000):
                writer.write(b"x")
                await writer.drain()
                sent.append(time.monotonic())
                await asyncio.sleep(0.3)
        except ConnectionError:
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(drip, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    limits = LimitsConfig(
        max_image_bytes=4096, image_fetch_timeout_s=1.5, allow_private_image_urls=True
    )
    loader = ImageLoader.from_limits(limits)  # the real resolver and sockets, loopback allowed
    started = time.monotonic()
    try:
        with pytest.raises(InvalidRequestError) as info:
            await loader.load(f"http://127.0.0.1:{port}/drip", PARAM)
        elapsed_s = time.monotonic() - started
    finally:
        await loader.close()
        server.close()
        await server.wait_closed()
    assert info.value.message == UNREACHABLE
    assert len(sent) >= 3  # the server kept sending: no read ever waited 1.5 s
    assert (
        elapsed_s < 15.0
    )  # cut at the 1.5 s bound, not after 1000 bytes x 0.3 s (a generous no-hang bound)
