"""Shared helpers of the gRPC skeleton tests: a fake Decode servicer and a served server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import trace

from services.common.errors import (
    CapacityError,
    InvalidRequestError,
    UnavailableError,
)
from services.common.grpc_errors import handle_errors
from services.common.pb.stageserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from services.common.server import (
    HealthState,
    RpcMetrics,
    current_request_id,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
DECODE = decode_pb2.DESCRIPTOR.services_by_name["Decode"].full_name
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
TIMEOUT_S = 10.0  # generous per-call bound: a hang fails the test instead of stalling it


class FakeDecode(decode_pb2_grpc.DecodeServicer):
    """Fails on request ids that name a failure; records the request ids it saw."""

    def __init__(self) -> None:
        self.seen_request_ids: list[str] = []
        self.seen_trace_ids: list[str] = []  # of the current span context in Abort ("" when none)

    @handle_errors
    async def Stats(self, request: Any, context: Any) -> decode_pb2.StatsResponse:
        return decode_pb2.StatsResponse(page_size=16, num_total_pages=8, num_free_pages=8)

    @handle_errors
    async def Reserve(self, request: Any, context: Any) -> decode_pb2.ReserveResponse:
        if request.request_id == "invalid":
            raise InvalidRequestError("prompt is empty", param="prompt_token_ids")
        if request.request_id == "capacity":
            raise CapacityError("need 4 KV pages, only 1 of 8 free")
        if request.request_id == "crash":
            raise RuntimeError("bookkeeping bug")
        return decode_pb2.ReserveResponse(kv_ref=common_pb2.KvRef(page_ids=[0, 1], page_size=16))

    @handle_errors
    async def Stream(
        self, requests: Any, context: Any
    ) -> AsyncIterator[decode_pb2.DecodeStreamResponse]:
        request = (await anext(aiter(requests))).generate
        for token_id in (5, 6, 7):
            yield decode_pb2.DecodeStreamResponse(
                request_ids=[request.request_id], token_ids=[token_id]
            )
        if request.request_id == "peer-lost":
            raise UnavailableError("prefill went away")
        if request.request_id == "crash":
            raise KeyError("slot")
        if request.request_id == "slow":
            await asyncio.sleep(60)
        end = decode_pb2.RequestEnd(
            request_id=request.request_id, finish_reason=common_pb2.FINISH_REASON_LENGTH
        )
        yield decode_pb2.DecodeStreamResponse(ends=[end])

    @handle_errors
    async def Abort(self, request: Any, context: Any) -> decode_pb2.AbortResponse:
        self.seen_request_ids.append(current_request_id.get())
        span_context = trace.get_current_span().get_span_context()
        trace_id = trace.format_trace_id(span_context.trace_id) if span_context.is_valid else ""
        self.seen_trace_ids.append(trace_id)
        return decode_pb2.AbortResponse(is_found=False)


def generate(request_id: str = "") -> list[decode_pb2.DecodeStreamRequest]:
    """The one message of a Stream call that starts ``request_id``."""
    return [
        decode_pb2.DecodeStreamRequest(
            generate=decode_pb2.DecodeGenerateRequest(request_id=request_id)
        )
    ]


@dataclass
class Served:
    server: grpc.aio.Server
    port: int
    health: HealthState
    metrics: RpcMetrics
    servicer: FakeDecode
    channel: grpc.aio.Channel

    @property
    def decode(self) -> decode_pb2_grpc.DecodeStub:
        return decode_pb2_grpc.DecodeStub(self.channel)

    async def health_status(self, service: str = "") -> int:
        stub = health_pb2_grpc.HealthStub(self.channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT_S)
        return reply.status


async def _rpc_error(call: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value
