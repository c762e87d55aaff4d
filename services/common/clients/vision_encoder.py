"""Typed client of the vision encoder service, and the protobuf <-> domain conversions it
shares with it.

``VisionEncoderClient(address).encode(...)`` makes the encoder write every span's
embedding rows into prefill's registered buffer (``EmbeddingDestination``, from
``services.transfer.embeddings``) and returns one ``SpanResult`` per span. ``dest_row``
of a span is relative to the destination's window: row 0 is the destination's first row.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Mapping, Sequence

import grpc
import msgspec

from services.common import telemetry
from services.common.auth import Credentials
from services.common.client import create_channel
from services.common.clients.sent_hashes import REMEMBERED_IMAGES, SentHashes
from services.common.destinations import EmbeddingDestination
from services.common.errors import DeadlineExceededError
from services.common.grpc_errors import error_from_rpc
from services.common.pb.stageserve.v1 import common_pb2, vision_encoder_pb2, vision_encoder_pb2_grpc
from services.common.server import REQUEST_ID_KEY
from services.common.types import ImageSpanRef
from services.common.wire import image_span_from_proto, image_span_to_proto


class EncodeSpanInput(msgspec.Struct, frozen=True):
    """One image span to encode: its placeholder run, its compressed bytes, where its rows go."""

    span: ImageSpanRef
    image_data: bytes
    dest_row: (
        int  # first destination row (in the destination window) of the span's span.length rows
    )


class SpanStatus(enum.Enum):
    WRITTEN = "written"
    INVALID_IMAGE = "invalid_image"
    FAILED = "failed"
    NEEDS_IMAGE_DATA = "needs_image_data"  # sent without bytes and not cached: nothing written
    SKIPPED = "skipped"  # not attempted: another span of the call needs its image data


class SpanResult(msgspec.Struct, frozen=True):
    content_hash: str
    status: SpanStatus
    is_cache_hit: bool  # rows came from the encoder's embedding cache (no ViT forward)
    owner_rank: int = 0
    error_message: str = ""


class VisionEncoderClient:
    """Client of one vision encoder at ``address`` ("host:port").

    It sends an image's bytes only until a call with them succeeds: later spans of the same
    content hash go without bytes and are served from the encoder's cache (a 1080p JPEG is
    1.9 MB per call otherwise). When the encoder no longer holds one (evicted, restarted),
    it answers ``NEEDS_IMAGE_DATA`` having written nothing, and the call is sent again once
    with every span's bytes. ``remembered_images`` bounds how many hashes are remembered.
    """

    def __init__(
        self,
        address: str,
        *,
        auth: Credentials | None = None,
        remembered_images: int = REMEMBERED_IMAGES,
    ) -> None:
        """``auth``: the internal token sent on every call (None: none)."""
        self.address = address
        self._channel = create_channel(address, auth=auth)
        self._stub = vision_encoder_pb2_grpc.VisionEncoderStub(self._channel)
        self._sent = SentHashes(remembered_images)  # hashes the encoder got bytes for

    async def encode(
        self,
        request_id: str,
        spans: Sequence[EncodeSpanInput],
        destination: EmbeddingDestination | Sequence[EmbeddingDestination],
        timeout_s: float,
    ) -> list[SpanResult]:
        """Write every span's rows into ``destination`` (one, or one per prefill CP rank)
        within ``timeout_s``.

        Returns one result per span, in order, once all rows landed. Raises the
        ``StageServeError`` the encoder answered with: ``InvalidRequestError`` (bad image
        bytes, grid/length/hash mismatch, rows outside the destination),
        ``CapacityError``, ``UnavailableError`` (encoder down, or the destination
        unreachable), ``DeadlineExceededError``.
        """
        deadline_mono = time.monotonic() + timeout_s
        destinations = (
            [destination] if isinstance(destination, EmbeddingDestination) else list(destination)
        )
        light = [
            msgspec.structs.replace(s, image_data=b"") if s.span.content_hash in self._sent else s
            for s in spans
        ]
        results = await self._encode(request_id, light, destinations, deadline_mono)
        needed = {r.content_hash for r in results if r.status is SpanStatus.NEEDS_IMAGE_DATA}
        if needed and any(s.image_data for s in spans):  # it wrote nothing: again, with bytes
            self._sent.forget(needed)
            results = await self._encode(request_id, spans, destinations, deadline_mono)
        self._sent.remember(
            s.span.content_hash
            for s, r in zip(spans, results, strict=False)
            if r.status is SpanStatus.WRITTEN
        )
        return results

    async def cache(
        self,
        request_id: str,
        spans: Sequence[ImageSpanRef],
        images: Mapping[str, bytes],
        timeout_s: float,
    ) -> list[SpanResult]:
        """Encode the images of ``spans`` (bytes by hash in ``images``) into the encoder's
        cache, writing nowhere (``cache_only``).

        Each distinct image goes once; those this client already got cached (or sent with a
        call that succeeded) are left out, and with none left nothing is sent and the result
        is ``[]``. Otherwise one result per image sent, in order: ``WRITTEN`` once its rows
        are cached. Raises as ``encode`` does.
        """
        todo: list[EncodeSpanInput] = []
        row = 0  # rows are not written: each span gets its own range, as every call's must
        for span in {s.content_hash: s for s in spans}.values():
            data = images.get(span.content_hash, b"")
            if data and span.content_hash not in self._sent:
                todo.append(EncodeSpanInput(span, data, row))
                row += span.length
        if not todo:
            return []
        deadline_mono = time.monotonic() + timeout_s
        results = await self._encode(request_id, todo, [], deadline_mono, cache_only=True)
        self._sent.remember(r.content_hash for r in results if r.status is SpanStatus.WRITTEN)
        return results

    async def _encode(
        self,
        request_id: str,
        spans: Sequence[EncodeSpanInput],
        destinations: list[EmbeddingDestination],
        deadline_mono: float,
        *,
        cache_only: bool = False,
    ) -> list[SpanResult]:
        timeout_s = deadline_mono - time.monotonic()
        if timeout_s <= 0:
            raise DeadlineExceededError(f"encode of {request_id} not sent: no time left")
        deadline_ms = int((time.time() + timeout_s) * 1000)
        request = encode_request_to_proto(request_id, spans, destinations, deadline_ms)
        request.cache_only = cache_only
        metadata = telemetry.inject_metadata([(REQUEST_ID_KEY, request_id)])
        try:
            response = await self._stub.Encode(request, timeout=timeout_s, metadata=metadata)
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc, service="vision_encoder") from exc
        return [span_result_from_proto(r) for r in response.results]

    async def close(self) -> None:
        await self._channel.close()


# --- conversions (also used by the vision encoder servicer) -------------------------

_STATUS_TO_PROTO = {
    SpanStatus.WRITTEN: vision_encoder_pb2.SPAN_STATUS_WRITTEN,
    SpanStatus.INVALID_IMAGE: vision_encoder_pb2.SPAN_STATUS_INVALID_IMAGE,
    SpanStatus.FAILED: vision_encoder_pb2.SPAN_STATUS_FAILED,
    SpanStatus.NEEDS_IMAGE_DATA: vision_encoder_pb2.SPAN_STATUS_NEEDS_IMAGE_DATA,
    SpanStatus.SKIPPED: vision_encoder_pb2.SPAN_STATUS_SKIPPED,
}
_STATUS_FROM_PROTO = {v: k for k, v in _STATUS_TO_PROTO.items()}


def embedding_destination_to_proto(dst: EmbeddingDestination) -> common_pb2.EmbeddingRef:
    return common_pb2.EmbeddingRef(
        backend=dst.backend,
        engine_address=dst.engine_address,
        session_id=dst.session_id,
        cp_rank=dst.cp_rank,
        base_address=dst.base_address,
        num_rows=dst.num_rows,
        row_stride_bytes=dst.row_stride_bytes,
        hidden_size=dst.hidden_size,
        dtype=dst.dtype,
    )


def embedding_destination_from_proto(ref: common_pb2.EmbeddingRef) -> EmbeddingDestination:
    return EmbeddingDestination(
        backend=ref.backend,
        engine_address=ref.engine_address or ref.session_id,
        session_id=ref.session_id or ref.engine_address,
        cp_rank=ref.cp_rank,
        base_address=ref.base_address,
        num_rows=ref.num_rows,
        row_stride_bytes=ref.row_stride_bytes,
        hidden_size=ref.hidden_size,
        dtype=ref.dtype,
    )


def encode_request_to_proto(
    request_id: str,
    spans: Sequence[EncodeSpanInput],
    destinations: Sequence[EmbeddingDestination],
    deadline_unix_ms: int = 0,
) -> vision_encoder_pb2.EncodeRequest:
    request = vision_encoder_pb2.EncodeRequest(
        request_id=request_id,
        embedding_refs=[embedding_destination_to_proto(d) for d in destinations],
        deadline_unix_ms=deadline_unix_ms,
    )
    for s in spans:  # add(): the bytes are copied once
        request.spans.add(
            span=image_span_to_proto(s.span), image_data=s.image_data, dest_row=s.dest_row
        )
    return request


def encode_span_from_proto(span: vision_encoder_pb2.EncodeSpan) -> EncodeSpanInput:
    return EncodeSpanInput(
        span=image_span_from_proto(span.span), image_data=span.image_data, dest_row=span.dest_row
    )


def span_result_to_proto(result: SpanResult) -> vision_encoder_pb2.SpanResult:
    return vision_encoder_pb2.SpanResult(
        content_hash=result.content_hash,
        status=_STATUS_TO_PROTO[result.status],
        is_cache_hit=result.is_cache_hit,
        owner_rank=result.owner_rank,
        error_message=result.error_message,
    )


def span_result_from_proto(result: vision_encoder_pb2.SpanResult) -> SpanResult:
    return SpanResult(
        content_hash=result.content_hash,
        status=_STATUS_FROM_PROTO.get(result.status, SpanStatus.FAILED),
        is_cache_hit=result.is_cache_hit,
        owner_rank=result.owner_rank,
        error_message=result.error_message,
    )
