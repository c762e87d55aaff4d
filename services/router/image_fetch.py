"""Fetching http(s) image URLs without letting a client reach the router's own network.

Every connection goes through ``GuardedBackend`` (an httpcore network backend): it
resolves the host itself, keeps only the addresses ``is_allowed_address`` accepts,
connects to one of them by IP and checks the peer it reached. The check happens at
connect time on the address actually used, so a name that resolves to a private
address (also after a first, public answer: DNS rebinding) is refused like a literal.

``ImageFetcher`` follows redirects itself (each hop connects through the same backend)
up to ``max_redirects``, and one deadline bounds the whole fetch: every hop, the
headers and the body. Failures that could tell a client what listens at an address
(refused, reset, not HTTP, too slow, a name behind which only refused addresses are)
share one message; the details are logged at DEBUG.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import typing
from collections.abc import Iterable, Sequence
from typing import Protocol

import httpcore
import httpx

from services.common.errors import InvalidRequestError

logger = logging.getLogger(__name__)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
UNREACHABLE = "fetching the image failed: the URL could not be fetched"
NON_PUBLIC = "image_url names a private, loopback, link-local or otherwise non-public address"
BAD_HOST_NAME = (
    "image_url's host is not a valid DNS name (each dot-separated label must have 1 to 63 "
    "characters, the whole name at most 253)"
)
REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


def is_public_address(ip: IPAddress) -> bool:
    """False for private, loopback, link-local, multicast, reserved and unspecified
    addresses, also when an IPv6 address embeds one (IPv4-mapped, NAT64, 6to4, Teredo)."""
    if isinstance(ip, ipaddress.IPv6Address):
        embedded = _embedded_ipv4(ip)
        if embedded is not None:
            return is_public_address(embedded)
        if ip.is_site_local:
            return False
    is_special = (
        ip.is_private
        or ip.is_loopback
        or ip.is_link_local
        or ip.is_multicast
        or ip.is_reserved
        or ip.is_unspecified
    )
    return ip.is_global and not is_special


def _embedded_ipv4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip.teredo is not None:
        return ip.teredo[1]  # the client's address
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFF_FFFF)
    return None


class Resolver(Protocol):
    async def resolve(self, host: str, port: int) -> Sequence[IPAddress]:
        """The addresses ``host`` stands for (``OSError`` when it resolves to none)."""
        ...


class SystemResolver:
    """The operating system's resolver (``getaddrinfo``), off the event loop."""

    async def resolve(self, host: str, port: int) -> Sequence[IPAddress]:
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except UnicodeError as exc:  # the name has no IDNA form: no query is sent
            raise socket.gaierror(socket.EAI_NONAME, f"not a valid host name: {exc}") from None
        return list(dict.fromkeys(ipaddress.ip_address(info[4][0]) for info in infos))


class BlockedAddressError(httpcore.ConnectError):
    """Every address of the host is one the policy refuses (or the peer turned out to be)."""


class GuardedBackend(httpcore.AsyncNetworkBackend):
    """Connects only to addresses ``allow_private`` permits; see the module docstring."""

    def __init__(
        self,
        allow_private: bool,
        resolver: Resolver | None = None,
        inner: httpcore.AsyncNetworkBackend | None = None,
    ) -> None:
        self._allow_private = allow_private
        self._resolver = resolver or SystemResolver()
        self._inner = inner or httpcore.AnyIOBackend()

    def is_allowed(self, ip: IPAddress) -> bool:
        return self._allow_private or is_public_address(ip)

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[typing.Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        try:
            addresses = await self._resolver.resolve(host, port)
        except OSError as exc:
            raise httpcore.ConnectError(f"cannot resolve {host!r}: {exc}") from exc
        allowed = [ip for ip in addresses if self.is_allowed(ip)]
        if not allowed:
            raise BlockedAddressError(f"{host!r} resolves only to refused addresses {addresses}")
        errors = []
        for ip in allowed:
            try:
                stream = await self._inner.connect_tcp(
                    str(ip), port, timeout, local_address, socket_options
                )
            except httpcore.ConnectError as exc:
                errors.append(f"{ip}: {exc}")
                continue
            await self._check_peer(stream, host)
            return stream
        raise httpcore.ConnectError(f"cannot connect to {host!r}: {'; '.join(errors)}")

    async def _check_peer(self, stream: httpcore.AsyncNetworkStream, host: str) -> None:
        peer = stream.get_extra_info("server_addr")
        ip = None if peer is None else ipaddress.ip_address(peer[0])
        if ip is None or not self.is_allowed(ip):
            await stream.aclose()
            raise BlockedAddressError(f"the connection for {host!r} reached {peer}, a refused peer")

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


# What a connection or an HTTP exchange can fail with: all become the one message.
_FETCH_ERRORS = (
    httpcore.NetworkError,
    httpcore.TimeoutException,
    httpcore.ProtocolError,
    httpcore.UnsupportedProtocol,
    OSError,
    TimeoutError,
)


class ImageFetcher:
    """GETs image URLs through a ``GuardedBackend``: redirects, byte limit, total deadline."""

    def __init__(
        self,
        backend: GuardedBackend,
        *,
        max_image_bytes: int,
        timeout_s: float,
        max_redirects: int,
    ) -> None:
        self._backend = backend
        self._max_image_bytes = max_image_bytes
        self._timeout_s = timeout_s
        self._max_redirects = max_redirects
        # No proxy (the environment's would resolve names for us) and no retries.
        self._pool = httpcore.AsyncConnectionPool(
            network_backend=backend, max_connections=100, retries=0
        )

    async def fetch(self, url: str, param: str) -> bytes:
        """The body of ``url`` (HTTP 200); ``InvalidRequestError`` on ``param`` for anything
        else."""
        try:
            async with asyncio.timeout(self._timeout_s):
                return await self._follow(url, param)
        except _FETCH_ERRORS as exc:
            logger.debug("fetching %s for %s failed: %s: %s", url, param, type(exc).__name__, exc)
            raise InvalidRequestError(UNREACHABLE, param=param) from None

    async def _follow(self, url: str, param: str) -> bytes:
        target = self._checked_url(url, param)
        for _ in range(self._max_redirects + 1):
            core_url = httpcore.URL(
                scheme=target.raw_scheme,
                host=target.raw_host,
                port=target.port,
                target=target.raw_path,
            )
            headers = [(b"accept", b"image/*")]
            async with self._pool.stream("GET", core_url, headers=headers) as response:
                if response.status in REDIRECT_STATUSES:
                    target = self._checked_url(_location(response, param), param, base=target)
                    continue
                if response.status != 200:
                    message = f"fetching the image failed: HTTP {response.status}"
                    raise InvalidRequestError(message, param=param)
                return await self._read_body(response, param)
        message = f"fetching the image failed: more than {self._max_redirects} redirects"
        raise InvalidRequestError(message, param=param)

    def _checked_url(self, text: str, param: str, base: httpx.URL | None = None) -> httpx.URL:
        """``text`` (relative to ``base``) parsed; refused unless http(s) to a name or an allowed
        IP."""
        try:
            url = httpx.URL(text) if base is None else base.join(text)
        except (httpx.InvalidURL, UnicodeError, ValueError):
            raise InvalidRequestError("image_url is not a valid URL", param=param) from None
        if url.scheme not in ("http", "https") or not url.host:
            raise InvalidRequestError(
                "image_url must be a data: URL or an http(s) URL", param=param
            )
        try:
            literal = ipaddress.ip_address(url.host)
        except ValueError:
            if not is_dns_name(url.raw_host):
                raise InvalidRequestError(BAD_HOST_NAME, param=param) from None
            return url  # a name: GuardedBackend checks what it resolves to
        if not self._backend.is_allowed(literal):
            raise InvalidRequestError(NON_PUBLIC, param=param)
        return url

    async def _read_body(self, response: httpcore.Response, param: str) -> bytes:
        declared = _header(response, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self._max_image_bytes:
            raise self.too_large(param)
        chunks: list[bytes] = []
        size = 0
        async for chunk in response.aiter_stream():
            size += len(chunk)
            if size > self._max_image_bytes:
                raise self.too_large(param)
            chunks.append(chunk)
        return b"".join(chunks)

    def too_large(self, param: str) -> InvalidRequestError:
        message = f"the image is larger than the limit of {self._max_image_bytes} bytes"
        return InvalidRequestError(message, param=param)

    async def close(self) -> None:
        await self._pool.aclose()


def is_dns_name(raw_host: bytes) -> bool:
    """Whether a (parsed, IDNA-encoded) host name can be looked up: labels of 1 to 63
    characters, at most 253 in all; one trailing dot (the root) is allowed."""
    name = raw_host[:-1] if raw_host.endswith(b".") else raw_host
    return 0 < len(name) <= 253 and all(0 < len(label) <= 63 for label in name.split(b"."))


def _header(response: httpcore.Response, name: bytes) -> str | None:
    for key, value in response.headers:
        if key.lower() == name:
            return value.decode("latin-1").strip()
    return None


def _location(response: httpcore.Response, param: str) -> str:
    location = _header(response, b"location")
    if not location:
        message = f"fetching the image failed: HTTP {response.status} without a Location"
        raise InvalidRequestError(message, param=param)
    return location
