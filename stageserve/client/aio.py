"""The asyncio client of ``stageserve.v1.Router`` (``grpc.aio``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Any, Unpack

import grpc

from services.common.errors import AbortedError
from services.common.pb.stageserve.v1 import router_pb2_grpc
from stageserve.client.calls import CHANNEL_OPTIONS, BaseClient, CallOptions, check_one_choice
from stageserve.client.errors import error_from_rpc
from stageserve.client.types import Chunk, Completion, CompletionBuilder, chunk_from_proto


class AsyncStream:
    """One call's chunks as they arrive: ``async for`` over it, or ``await completion()``. A
    failure raises its ``StageServeError`` class. ``cancel()`` (or leaving an ``async with``
    block, or cancelling the task reading it) ends the call on the router."""

    def __init__(self, call: Any, request_id: str) -> None:
        self.request_id = request_id
        self._call = call
        self._responses = call.__aiter__()
        self._is_cancelled = False

    def __aiter__(self) -> AsyncIterator[Chunk]:
        return self

    async def __anext__(self) -> Chunk:
        try:
            response = await anext(self._responses)
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc, self.request_id) from exc
        except asyncio.CancelledError:  # grpc.aio's answer to reading a cancelled call
            task = asyncio.current_task()
            if not self._is_cancelled or (task is not None and task.cancelling()):
                raise  # this task itself is being cancelled
            error = AbortedError("the call was cancelled by the client (cancel())")
            error.request_id = self.request_id
            raise error from None
        return chunk_from_proto(response)

    async def completion(self) -> Completion:
        """Every remaining chunk, joined (a call of one choice)."""
        return (await self._builder()).completion()

    async def completions(self) -> tuple[Completion, ...]:
        """Every remaining chunk, joined per choice, by choice index."""
        return (await self._builder()).completions()

    async def _builder(self) -> CompletionBuilder:
        builder = CompletionBuilder()
        async for chunk in self:
            builder.add(chunk)
        return builder

    def cancel(self) -> None:
        self._is_cancelled = True
        self._call.cancel()

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.cancel()


class AsyncClient(BaseClient):
    """``Client`` for asyncio: the same arguments, awaitable. Create it inside the event loop
    that uses it; ``await close()`` (or ``async with``) when done."""

    def __init__(
        self, address: str, *, api_key: str | None = None, timeout_s: float | None = 300.0
    ) -> None:
        super().__init__(api_key, timeout_s)
        self._channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub = router_pb2_grpc.RouterStub(self._channel)

    def stream(self, prompt: str | None = None, **options: Unpack[CallOptions]) -> AsyncStream:
        """``Client.stream``: the call starts now; iterate the result with ``async for``."""
        spec = self._call_spec(prompt, options)
        call = self._stub.Generate(spec.request, timeout=spec.timeout_s, metadata=spec.metadata)
        return AsyncStream(call, spec.request_id)

    async def generate(
        self, prompt: str | None = None, **options: Unpack[CallOptions]
    ) -> Completion:
        """``Client.generate``: ``stream`` with the same arguments, one choice, joined."""
        check_one_choice(options)
        async with self.stream(prompt, **options) as stream:
            return await stream.completion()

    async def generate_choices(
        self, prompt: str | None = None, **options: Unpack[CallOptions]
    ) -> tuple[Completion, ...]:
        """``stream`` with the same arguments, joined into each choice's ``Completion``."""
        async with self.stream(prompt, **options) as stream:
            return await stream.completions()

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()
