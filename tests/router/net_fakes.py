"""A fake network for the image fetcher: a resolver and an httpcore backend that record
every lookup and connection attempt, with canned HTTP servers at chosen addresses."""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Sequence
from typing import Any

import httpcore

from services.router.image_fetch import IPAddress

PUBLIC_IP = "93.184.216.34"  # images.test
OTHER_PUBLIC_IP = "93.184.216.35"  # cdn.test

Serve = Callable[[str], bytes]  # request path -> the raw HTTP response


def http_response(status: int, body: bytes = b"", headers: Sequence[tuple[str, str]] = ()) -> bytes:
    lines = [f"HTTP/1.1 {status} X", f"content-length: {len(body)}", "connection: close"]
    lines += [f"{name}: {value}" for name, value in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def redirect(location: str, status: int = 302) -> bytes:
    return http_response(status, headers=[("location", location)])


class FakeResolver:
    """Answers from ``answers`` (a name -> addresses, or a list of answers used in turn)."""

    def __init__(self, answers: dict[str, list[str] | list[list[str]]]) -> None:
        self._answers = answers
        self.lookups: list[str] = []

    async def resolve(self, host: str, port: int) -> Sequence[IPAddress]:
        self.lookups.append(host)
        try:
            return [ipaddress.ip_address(host)]
        except ValueError:
            pass
        answer = self._answers.get(host)
        if not answer:
            raise OSError(f"no such name {host!r}")
        if isinstance(answer[0], list):  # one answer per lookup (DNS rebinding)
            current = answer.pop(0) if len(answer) > 1 else answer[0]
            return [ipaddress.ip_address(a) for a in current]
        return [ipaddress.ip_address(a) for a in answer]


class FakeStream(httpcore.AsyncNetworkStream):
    def __init__(self, peer: tuple[str, int], serve: Serve) -> None:
        self._peer = peer
        self._serve = serve
        self._request = b""
        self._response: bytes | None = None

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._request += buffer

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        if self._response is None:
            path = self._request.split(b" ", 2)[1].decode()
            self._response = self._serve(path)
        chunk, self._response = self._response[:max_bytes], self._response[max_bytes:]
        return chunk

    async def aclose(self) -> None:
        pass

    async def start_tls(
        self, ssl_context: Any, server_hostname: str | None = None, timeout: float | None = None
    ) -> FakeStream:
        self.server_hostname = server_hostname  # TLS itself is not faked: the stream stays plain
        return self

    def get_extra_info(self, info: str) -> Any:
        return self._peer if info == "server_addr" else None


class FakeNetwork(httpcore.AsyncNetworkBackend):
    """HTTP servers by IP; records every connection attempt as (ip, port)."""

    def __init__(self, servers: dict[str, Serve], peer_override: str | None = None) -> None:
        self._servers = servers
        self._peer_override = peer_override  # the peer the socket reports (a transparent proxy)
        self.attempts: list[tuple[str, int]] = []

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Any = None,
    ) -> FakeStream:
        self.attempts.append((host, port))
        serve = self._servers.get(host)
        if serve is None:
            raise httpcore.ConnectError(f"connection to {host}:{port} refused")
        return FakeStream((self._peer_override or host, port), serve)

    async def sleep(self, seconds: float) -> None:
        pass

    def attempted_ips(self) -> set[str]:
        return {host for host, _ in self.attempts}
