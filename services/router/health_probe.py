"""The router's readiness probe of its workers: ``grpc.health.v1`` ``Check`` of a whole worker
(service ""), one channel per address, polled by the registry."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2_grpc

from services.common.auth import Credentials
from services.common.client import create_channel
from services.common.healthcheck import HealthAnswer, check_async


class HealthProbe:
    """``grpc.health.v1`` ``Check`` of whole workers (service ""), one channel per address."""

    def __init__(self, timeout_s: float, *, auth: Credentials | None = None) -> None:
        """``auth``: the internal token its channels send (health itself needs none)."""
        self._timeout_s = timeout_s
        self._auth = auth
        self._stubs: dict[str, health_pb2_grpc.HealthStub] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _stub(self, address: str) -> health_pb2_grpc.HealthStub:
        if address not in self._stubs:
            channel = create_channel(address, auth=self._auth)
            self._channels[address] = channel
            self._stubs[address] = health_pb2_grpc.HealthStub(channel)
        return self._stubs[address]

    async def check(self, address: str) -> HealthAnswer:
        return await check_async(self._stub(address), timeout_s=self._timeout_s)

    async def forget(self, address: str) -> None:
        """Close the channel to ``address`` (a later ``check`` opens a new one)."""
        self._stubs.pop(address, None)
        channel = self._channels.pop(address, None)
        if channel is not None:
            await channel.close()

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
        self._stubs.clear()
