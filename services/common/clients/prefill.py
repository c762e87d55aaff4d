"""Typed client of the prefill service, and the protobuf <-> domain conversions it shares with it.

``PrefillClient(address).prefill(...)`` runs one prompt on a prefill worker: the worker
encodes the prompt's images (through the vision encoder), runs the forward pass, writes
the prompt's KV into the decode pages described by ``kv_ref`` and returns the first token.
"""

from __future__ import annotations

import time

import grpc
import msgspec

from services.common import telemetry
from services.common.client import create_channel
from services.common.errors import DeadlineExceededError
from services.common.grpc_errors import error_from_rpc
from services.common.pb.stageserve.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc
from services.common.server import REQUEST_ID_KEY
from services.common.types import FinishReason, ImageSpanRef, TokenizedPrompt
from services.engine.sampler import SamplingParams
from services.transfer.base import KvDestination, KvPoolLayout


class PrefillResult(msgspec.Struct, frozen=True):
    """Outcome of one prefill; the prompt's KV is fully written into decode's pages."""

    first_token_id: int
    num_kv_bytes: int
    kv_transfer_us: int
    num_cached_image_tokens: int = 0
    # Set when the first token already ends the request (EOS / stop token,
    # max_new_tokens == 1, context limit): the router aborts decode's reservation.
    finish_reason: FinishReason | None = None


class PrefillClient:
    """Client of one prefill worker at ``address`` ("host:port")."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._channel = create_channel(address)
        self._stub = prefill_pb2_grpc.PrefillStub(self._channel)

    async def prefill(
        self,
        request_id: str,
        prompt: TokenizedPrompt,
        params: SamplingParams,
        kv_ref: KvDestination,
        deadline_s: float,
    ) -> PrefillResult:
        """Prefill ``prompt`` and write its KV into ``kv_ref``'s pages, by ``deadline_s``.

        ``deadline_s`` is absolute: seconds since the Unix epoch (``time.time()`` clock).
        Raises the ``StageServeError`` the worker answered with (``InvalidRequestError``,
        ``CapacityError``, ``UnavailableError``, ``DeadlineExceededError``, ...).
        """
        timeout_s = deadline_s - time.time()
        if timeout_s <= 0:
            raise DeadlineExceededError(f"prefill of {request_id} not sent: its deadline has passed")
        request = prefill_request_to_proto(request_id, prompt, params, kv_ref, deadline_s)
        metadata = telemetry.inject_metadata([(REQUEST_ID_KEY, request_id)])
        try:
            response = await self._stub.Prefill(request, timeout=timeout_s, metadata=metadata)
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc) from exc
        return prefill_result_from_proto(response)

    async def close(self) -> None:
        await self._channel.close()


# --- conversions (also used by the prefill servicer) ---------------------------------

_FINISH_TO_PROTO = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
}
_FINISH_FROM_PROTO = {v: k for k, v in _FINISH_TO_PROTO.items()}


def prefill_request_to_proto(
    request_id: str, prompt: TokenizedPrompt, params: SamplingParams, kv_ref: KvDestination, deadline_s: float
) -> prefill_pb2.PrefillRequest:
    return prefill_pb2.PrefillRequest(
        request_id=request_id,
        token_ids=prompt.token_ids,
        image_spans=[span_to_proto(span) for span in prompt.spans],
        images=[common_pb2.ImageData(content_hash=h, data=data) for h, data in prompt.images.items()],
        sampling_params=sampling_params_to_proto(params),
        kv_ref=kv_destination_to_proto(kv_ref),
        deadline_unix_ms=int(deadline_s * 1000),
    )


def prefill_result_to_proto(result: PrefillResult) -> prefill_pb2.PrefillResponse:
    return prefill_pb2.PrefillResponse(
        first_token_id=result.first_token_id,
        finish_reason=_FINISH_TO_PROTO[result.finish_reason],
        kv_state=common_pb2.KV_TRANSFER_STATE_SUCCESS,
        num_kv_bytes=result.num_kv_bytes,
        kv_transfer_us=result.kv_transfer_us,
        num_cached_image_tokens=result.num_cached_image_tokens,
    )


def prefill_result_from_proto(response: prefill_pb2.PrefillResponse) -> PrefillResult:
    return PrefillResult(
        first_token_id=response.first_token_id,
        num_kv_bytes=response.num_kv_bytes,
        kv_transfer_us=response.kv_transfer_us,
        num_cached_image_tokens=response.num_cached_image_tokens,
        finish_reason=_FINISH_FROM_PROTO.get(response.finish_reason),
    )


def span_to_proto(span: ImageSpanRef) -> common_pb2.ImageSpan:
    t, h, w = span.grid_thw
    return common_pb2.ImageSpan(
        offset=span.offset, length=span.length, content_hash=span.content_hash, grid_t=t, grid_h=h, grid_w=w
    )


def span_from_proto(span: common_pb2.ImageSpan) -> ImageSpanRef:
    return ImageSpanRef(
        offset=span.offset, length=span.length, content_hash=span.content_hash,
        grid_thw=(span.grid_t, span.grid_h, span.grid_w),
    )


_SAMPLING_OPTIONAL = (
    "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty",
    "presence_penalty", "seed", "max_new_tokens",
)


def sampling_params_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    fields = {name: getattr(params, name) for name in _SAMPLING_OPTIONAL if getattr(params, name) is not None}
    return common_pb2.SamplingParams(
        **fields, stop_token_ids=params.stop_token_ids, ignore_eos=params.ignore_eos
    )


def sampling_params_from_proto(message: common_pb2.SamplingParams) -> SamplingParams:
    """Unset optional fields take the engine defaults (``SamplingParams()``'s)."""
    fields = {name: getattr(message, name) for name in _SAMPLING_OPTIONAL if message.HasField(name)}
    return SamplingParams(
        **fields, stop_token_ids=tuple(message.stop_token_ids), ignore_eos=message.ignore_eos
    )


def kv_destination_to_proto(dst: KvDestination, dp_rank: int = 0) -> common_pb2.KvRef:
    """The wire ``KvRef`` of ``dst`` (``session_id`` is the engine address on every backend)."""
    layout = dst.layout
    layer_stride = layout.num_pages * layout.page_nbytes
    buffers = [
        common_pb2.KvBuffer(
            kind=kind, base_address=base, size_bytes=layout.num_layers * layer_stride,
            layer_stride_bytes=layer_stride, page_stride_bytes=layout.page_nbytes,
            slot_stride_bytes=layout.page_nbytes // layout.page_size,
        )
        for kind, base in ((common_pb2.KV_BUFFER_KIND_K, layout.k_base), (common_pb2.KV_BUFFER_KIND_V, layout.v_base))
    ]
    return common_pb2.KvRef(
        backend=dst.backend, engine_address=dst.session_id, session_id=dst.session_id, dp_rank=dp_rank,
        page_ids=dst.page_ids, page_size=layout.page_size, num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim, dtype=layout.dtype, buffers=buffers,
    )


def kv_destination_from_proto(request_id: str, ref: common_pb2.KvRef) -> KvDestination:
    """``KvDestination`` of a wire ``KvRef``; ``ValueError`` when its buffers are malformed."""
    by_kind = {b.kind: b for b in ref.buffers}
    k, v = by_kind.get(common_pb2.KV_BUFFER_KIND_K), by_kind.get(common_pb2.KV_BUFFER_KIND_V)
    if k is None or v is None or len(ref.buffers) != 2:
        raise ValueError("kv_ref needs exactly one K and one V buffer")
    if k.page_stride_bytes == 0 or k.layer_stride_bytes % k.page_stride_bytes:
        raise ValueError("kv_ref buffer strides are inconsistent")
    if (k.layer_stride_bytes, k.page_stride_bytes) != (v.layer_stride_bytes, v.page_stride_bytes):
        raise ValueError("kv_ref K and V buffers have different strides")
    layout = KvPoolLayout(
        k_base=k.base_address, v_base=v.base_address, num_layers=ref.num_layers,
        num_pages=k.layer_stride_bytes // k.page_stride_bytes, page_size=ref.page_size,
        num_kv_heads=ref.num_kv_heads, head_dim=ref.head_dim, dtype=ref.dtype,
        page_nbytes=k.page_stride_bytes,
    )
    session_id = ref.session_id or ref.engine_address
    return KvDestination(
        backend=ref.backend, session_id=session_id, request_id=request_id, layout=layout,
        page_ids=tuple(ref.page_ids),
    )
