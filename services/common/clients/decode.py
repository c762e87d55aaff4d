"""Typed client of the decode service, and the proto <-> domain conversions around it.

``KvRefInfo`` is the domain form of ``stageserve.v1.KvRef``: decode issues it signed
(``issue_kv_ref``), the router gets it from ``DecodeClient.reserve`` and hands it
unchanged to the prefill client (``kv_ref_to_proto``); prefill checks its MAC and turns it
back into a ``KvDestination`` (``KvRefInfo.to_destination``) to write the KV. Importing
this module does not import torch: only ``to_destination`` touches ``services.transfer``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING

import grpc
import msgspec

from services.common import signing, telemetry
from services.common.auth import Credentials
from services.common.client import create_channel
from services.common.errors import (
    DeadlineExceededError,
    InvalidRequestError,
    StageServeError,
    UnavailableError,
)
from services.common.grpc_errors import error_from_rpc, known_error_classes
from services.common.pb.stageserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from services.common.server import REQUEST_ID_KEY
from services.common.types import FinishReason, Usage

if TYPE_CHECKING:
    from services.engine.sampler import SamplingParams
    from services.transfer.base import KvDestination

DEFAULT_TIMEOUT_S = 10.0  # Abort / Stats, and the cap on Reserve when the deadline is far


class KvBufferInfo(msgspec.Struct, frozen=True):
    """One registered K or V buffer of decode's pool, ``[layers, pages, page_size, heads, dim]``."""

    kind: str  # "k" | "v"
    base_address: int
    size_bytes: int
    layer_stride_bytes: int
    page_stride_bytes: int
    slot_stride_bytes: int


class KvRefInfo(msgspec.Struct, frozen=True):
    """Where prefill writes one request's prompt KV (mirrors the proto ``KvRef``), signed by decode.

    ``mac`` covers every other field (``signed_fields``), so prefill trusts a KvRef only
    when ``has_valid_mac``: the pages, the layout and the endpoint are the ones decode
    issued for ``request_id``, until ``expires_unix_ms``.
    """

    request_id: str
    backend: str  # transfer backend name as services.transfer knows it ("mooncake", "inprocess")
    session_id: str  # the owning decode rank's transfer-engine endpoint (Mooncake: "host:rpc_port")
    dp_rank: int
    page_ids: tuple[int, ...]  # the prompt's pages, position order
    page_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name without prefix
    buffers: tuple[KvBufferInfo, ...]  # one "k", one "v"
    nonce: bytes  # signing.NONCE_BYTES random bytes, one per reservation
    expires_unix_ms: int  # the reservation's deadline, ms since the Unix epoch
    mac: bytes  # signing.sign(key, KV_REF, signed_fields())

    def buffer(self, kind: str) -> KvBufferInfo:
        return next(b for b in self.buffers if b.kind == kind)

    def signed_fields(self) -> tuple[object, ...]:
        """Every field but ``mac``, in declaration order: what the MAC covers."""
        return tuple(getattr(self, name) for name in self.__struct_fields__ if name != "mac")

    def has_valid_mac(self, key: bytes) -> bool:
        return signing.verify(key, signing.KV_REF, self.signed_fields(), self.mac)

    def to_destination(self) -> KvDestination:
        """The ``services.transfer`` destination prefill's KV sender writes to."""
        from services.transfer.base import KvDestination, KvPoolLayout

        k, v = self.buffer("k"), self.buffer("v")
        layout = KvPoolLayout(
            k_base=k.base_address,
            v_base=v.base_address,
            num_layers=self.num_layers,
            num_pages=k.layer_stride_bytes // k.page_stride_bytes,
            page_size=self.page_size,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
            page_nbytes=k.page_stride_bytes,
        )
        return KvDestination(self.backend, self.session_id, self.request_id, layout, self.page_ids)


def issue_kv_ref(
    destination: KvDestination, key: bytes, nonce: bytes, expires_unix_ms: int, dp_rank: int = 0
) -> KvRefInfo:
    """Decode's signed KvRef of ``destination`` (a reservation of ``destination.request_id``)."""
    layout = destination.layout
    layer_stride = layout.num_pages * layout.page_nbytes
    buffers = tuple(
        KvBufferInfo(
            kind=kind,
            base_address=base,
            size_bytes=layout.num_layers * layer_stride,
            layer_stride_bytes=layer_stride,
            page_stride_bytes=layout.page_nbytes,
            slot_stride_bytes=layout.page_nbytes // layout.page_size,
        )
        for kind, base in (("k", layout.k_base), ("v", layout.v_base))
    )
    unsigned = KvRefInfo(
        request_id=destination.request_id,
        backend=destination.backend,
        session_id=destination.session_id,
        dp_rank=dp_rank,
        page_ids=tuple(destination.page_ids),
        page_size=layout.page_size,
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        dtype=layout.dtype,
        buffers=buffers,
        nonce=nonce,
        expires_unix_ms=expires_unix_ms,
        mac=b"",
    )
    mac = signing.sign(key, signing.KV_REF, unsigned.signed_fields())
    return msgspec.structs.replace(unsigned, mac=mac)


_BUFFER_KINDS = {"k": common_pb2.KV_BUFFER_KIND_K, "v": common_pb2.KV_BUFFER_KIND_V}
_BUFFER_KIND_NAMES = {code: name for name, code in _BUFFER_KINDS.items()}


def kv_ref_to_proto(info: KvRefInfo) -> common_pb2.KvRef:
    return common_pb2.KvRef(
        request_id=info.request_id,
        backend=info.backend,
        session_id=info.session_id,
        dp_rank=info.dp_rank,
        page_ids=info.page_ids,
        page_size=info.page_size,
        num_layers=info.num_layers,
        num_kv_heads=info.num_kv_heads,
        head_dim=info.head_dim,
        dtype=info.dtype,
        buffers=[
            common_pb2.KvBuffer(
                kind=_BUFFER_KINDS[b.kind],
                base_address=b.base_address,
                size_bytes=b.size_bytes,
                layer_stride_bytes=b.layer_stride_bytes,
                page_stride_bytes=b.page_stride_bytes,
                slot_stride_bytes=b.slot_stride_bytes,
            )
            for b in info.buffers
        ],
        nonce=info.nonce,
        expires_unix_ms=info.expires_unix_ms,
        mac=info.mac,
    )


def kv_ref_from_proto(message: common_pb2.KvRef) -> KvRefInfo:
    """``InvalidRequestError`` unless the message names exactly one K and one V buffer."""
    from services.common.errors import InvalidRequestError

    kinds = sorted(_BUFFER_KIND_NAMES.get(b.kind, "?") for b in message.buffers)
    if (
        kinds != ["k", "v"]
        or message.page_size == 0
        or any(b.page_stride_bytes == 0 for b in message.buffers)
    ):
        raise InvalidRequestError(
            "kv_ref must carry one K and one V buffer and a page size", param="kv_ref"
        )
    return KvRefInfo(
        request_id=message.request_id,
        backend=message.backend,
        session_id=message.session_id,
        dp_rank=message.dp_rank,
        page_ids=tuple(message.page_ids),
        page_size=message.page_size,
        num_layers=message.num_layers,
        num_kv_heads=message.num_kv_heads,
        head_dim=message.head_dim,
        dtype=message.dtype,
        buffers=tuple(
            KvBufferInfo(
                kind=_BUFFER_KIND_NAMES[b.kind],
                base_address=b.base_address,
                size_bytes=b.size_bytes,
                layer_stride_bytes=b.layer_stride_bytes,
                page_stride_bytes=b.page_stride_bytes,
                slot_stride_bytes=b.slot_stride_bytes,
            )
            for b in message.buffers
        ),
        nonce=message.nonce,
        expires_unix_ms=message.expires_unix_ms,
        mac=message.mac,
    )


_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
)


def sampling_params_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    message = common_pb2.SamplingParams(
        top_k=params.top_k,
        max_new_tokens=params.max_new_tokens,
        stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos,
        min_tokens=params.min_tokens,
        logit_bias=[common_pb2.LogitBias(token_id=t, bias=b) for t, b in params.logit_bias],
        **{name: getattr(params, name) for name in _FLOAT_FIELDS},
    )
    if params.seed is not None:
        message.seed = params.seed
    return message


def sampling_params_from_proto(message: common_pb2.SamplingParams) -> SamplingParams:
    """Unset optional fields take ``SamplingParams``' defaults; not validated here."""
    from services.engine.sampler import SamplingParams

    optional = (*_FLOAT_FIELDS, "top_k", "seed", "max_new_tokens")
    values = {name: getattr(message, name) for name in optional if message.HasField(name)}
    return SamplingParams(
        stop_token_ids=tuple(message.stop_token_ids),
        ignore_eos=message.ignore_eos,
        min_tokens=message.min_tokens,
        logit_bias=tuple((b.token_id, b.bias) for b in message.logit_bias),
        **values,
    )


_FINISH_REASONS = {
    common_pb2.FINISH_REASON_STOP: FinishReason.STOP,
    common_pb2.FINISH_REASON_LENGTH: FinishReason.LENGTH,
}
FINISH_REASON_TO_PROTO = {reason: code for code, reason in _FINISH_REASONS.items()}


class DecodeChunk(msgspec.Struct, frozen=True):
    """Tokens generated since the previous chunk; the last chunk carries finish_reason and usage.

    The stream never repeats ``first_token_id``: completion tokens = 1 + all streamed
    tokens, which is what ``usage.num_completion_tokens`` says.
    """

    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    usage: Usage | None = None


def stream_error_to_proto(error: StageServeError) -> decode_pb2.StreamError:
    return decode_pb2.StreamError(
        code=error.grpc_code,
        error_type=type(error).__name__,
        message=error.message,
        param=error.param or "",
    )


def stream_error_from_proto(message: decode_pb2.StreamError) -> StageServeError:
    """The error a Stream request ended with: its own class when it matches the code."""
    cls = known_error_classes().get(message.error_type)
    if cls is None or cls.grpc_code != message.code:
        cls = UnavailableError if message.code == "UNAVAILABLE" else StageServeError
    return cls(message.message or message.code, param=message.param or None)


def _usage_from_proto(message: common_pb2.Usage) -> Usage:
    return Usage(
        message.num_prompt_tokens, message.num_completion_tokens, message.num_cached_image_tokens
    )


Queued = DecodeChunk | StageServeError


def _trace_fields() -> dict[str, str]:
    """The current W3C trace context as DecodeGenerateRequest's traceparent / tracestate."""
    carrier = dict(telemetry.inject_metadata())
    return {key: carrier[key] for key in ("traceparent", "tracestate") if key in carrier}


class _TokenStream:
    """One Stream call carrying every ``generate`` of a client: each request's chunks to its queue.

    Messages to decode go through an unbounded outbox (never awaited by the caller); a
    reader task splits each message by request. When the call ends, every open request
    gets the error, and the next ``generate`` opens a new call.
    """

    def __init__(self, stub: decode_pb2_grpc.DecodeStub) -> None:
        self._outbox: asyncio.Queue[decode_pb2.DecodeStreamRequest | None] = asyncio.Queue()
        self._queues: dict[str, asyncio.Queue[Queued]] = {}
        self.is_closed = False
        self._call = stub.Stream(self._messages(), metadata=telemetry.inject_metadata())
        self._reader = asyncio.create_task(self._read(), name="decode-token-stream")

    def open(self, request_id: str) -> asyncio.Queue[Queued]:
        if request_id in self._queues:
            raise InvalidRequestError(
                f"generate already started for {request_id}", param="request_id"
            )
        queue: asyncio.Queue[Queued] = asyncio.Queue()
        self._queues[request_id] = queue
        return queue

    def send(self, message: decode_pb2.DecodeStreamRequest) -> None:
        if not self.is_closed:
            self._outbox.put_nowait(message)

    def forget(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    async def close(self) -> None:
        self._outbox.put_nowait(None)
        self._call.cancel()
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)

    async def _messages(self) -> AsyncIterator[decode_pb2.DecodeStreamRequest]:
        while (message := await self._outbox.get()) is not None:
            yield message

    async def _read(self) -> None:
        error: StageServeError = UnavailableError("the decode service ended its token stream")
        try:
            async for response in self._call:
                self._dispatch(response)
        except grpc.RpcError as exc:
            error = error_from_rpc(exc, service="decode")
        except asyncio.CancelledError:
            error = UnavailableError("the decode client was closed")
            raise
        finally:
            self.is_closed = True
            for queue in self._queues.values():
                queue.put_nowait(error)
            self._queues.clear()

    def _dispatch(self, response: decode_pb2.DecodeStreamResponse) -> None:
        tokens: dict[str, list[int]] = {}
        for request_id, token_id in zip(response.request_ids, response.token_ids, strict=True):
            tokens.setdefault(request_id, []).append(token_id)
        ends = {end.request_id: end for end in response.ends}
        for request_id in tokens.keys() | ends.keys():
            queue = self._queues.get(request_id)
            if queue is None:  # the caller left already
                continue
            token_ids, end = tuple(tokens.get(request_id, ())), ends.get(request_id)
            if end is None:
                queue.put_nowait(DecodeChunk(token_ids))
            elif end.HasField("error"):
                if token_ids:
                    queue.put_nowait(DecodeChunk(token_ids))
                queue.put_nowait(stream_error_from_proto(end.error))
            else:
                reason = _FINISH_REASONS.get(end.finish_reason)
                queue.put_nowait(DecodeChunk(token_ids, reason, _usage_from_proto(end.usage)))


class DecodeRankStats(msgspec.Struct, frozen=True):
    dp_rank: int
    num_total_pages: int
    num_free_pages: int
    num_used_pages: int
    num_running_requests: int
    num_reserved_requests: int
    num_quarantined_pages: int  # neither free nor used: a late KV write may still land in them
    is_serving: bool = True  # False: the rank is down or restarting (every count 0)


class DecodeStats(msgspec.Struct, frozen=True):
    page_size: int
    num_total_pages: int
    num_free_pages: int
    num_used_pages: int
    num_running_requests: int
    num_reserved_requests: int
    num_quarantined_pages: int  # free + used + quarantined = total
    ranks: tuple[DecodeRankStats, ...] = ()


def _stats_fields(message: object, struct: type[msgspec.Struct]) -> dict[str, int]:
    return {name: getattr(message, name) for name in struct.__struct_fields__ if name != "ranks"}


class DecodeClient:
    """Async client of one decode service at ``address`` ("host:port")."""

    def __init__(
        self, address: str, *, timeout_s: float = DEFAULT_TIMEOUT_S, auth: Credentials | None = None
    ) -> None:
        """``auth``: the internal token sent on every call (None: none)."""
        self.address = address
        self._timeout_s = timeout_s
        self._channel = create_channel(address, auth=auth)
        self._stub = decode_pb2_grpc.DecodeStub(self._channel)
        self._tokens: _TokenStream | None = None  # every generate of this client, one Stream call

    @staticmethod
    def _metadata(request_id: str) -> list[tuple[str, str]]:
        return telemetry.inject_metadata([(REQUEST_ID_KEY, request_id)])

    async def reserve(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        mrope_position_delta: int,
        params: SamplingParams,
        deadline_s: float,
    ) -> KvRefInfo:
        """Reserve KV pages; returns where prefill writes the prompt's KV.

        ``deadline_s``: the request's absolute deadline, seconds since the Unix epoch
        (``time.time()``); the reservation expires then unless Generate started. Raises
        ``CapacityError`` (no pages now; retryable elsewhere), ``InvalidRequestError``
        (bad params, prompt too long, duplicate id), ``DeadlineExceededError``,
        ``UnavailableError``.
        """
        remaining_s = deadline_s - time.time()
        if remaining_s <= 0:
            raise DeadlineExceededError(f"{request_id}: deadline passed before Reserve")
        request = decode_pb2.ReserveRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            mrope_position_delta=mrope_position_delta,
            sampling_params=sampling_params_to_proto(params),
            deadline_unix_ms=int(deadline_s * 1000),
        )
        try:
            reply = await self._stub.Reserve(
                request,
                timeout=min(remaining_s, self._timeout_s),
                metadata=self._metadata(request_id),
            )
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, service="decode") from exc
        return kv_ref_from_proto(reply.kv_ref)

    async def generate(
        self, request_id: str, first_token_id: int, timeout_s: float, *, kv_written_proof: bytes
    ) -> AsyncIterator[DecodeChunk]:
        """Stream the tokens after ``first_token_id`` until the request finishes.

        Every generate of this client shares one Stream call, whose messages carry every
        request's tokens of a decode step. ``kv_written_proof``: what prefill returned for
        this request (``PrefillResult``); decode starts no reservation without it. Leaving
        the iteration early (``break``, ``aclose``, cancellation) aborts the request on
        decode, which frees its pages. Raises ``NotFoundError`` (unknown or expired request),
        ``InvalidRequestError`` (missing or wrong proof), ``AbortedError`` (aborted meanwhile),
        ``DeadlineExceededError`` (``timeout_s`` passed), ``UnavailableError``.
        """
        if self._tokens is None or self._tokens.is_closed:
            self._tokens = _TokenStream(self._stub)
        tokens = self._tokens
        queue = tokens.open(request_id)
        deadline = asyncio.get_running_loop().time() + timeout_s
        start = decode_pb2.DecodeGenerateRequest(
            request_id=request_id,
            first_token_id=first_token_id,
            kv_written_proof=kv_written_proof,
            deadline_unix_ms=int((time.time() + timeout_s) * 1000),
            **_trace_fields(),
        )
        tokens.send(decode_pb2.DecodeStreamRequest(generate=start))
        is_done = False
        try:
            while not is_done:
                try:
                    async with asyncio.timeout_at(deadline):
                        item = await queue.get()
                except TimeoutError:
                    raise DeadlineExceededError(
                        f"{request_id}: decode did not finish within {timeout_s:g} s"
                    ) from None
                if isinstance(item, StageServeError):
                    is_done = True
                    raise item
                is_done = item.finish_reason is not None
                yield item
        finally:
            tokens.forget(request_id)
            if not is_done:
                abort = decode_pb2.AbortRequest(
                    request_id=request_id, reason="the caller left", is_kv_written=True
                )
                tokens.send(decode_pb2.DecodeStreamRequest(abort=abort))

    async def abort(
        self, request_id: str, reason: str = "", *, is_kv_written: bool = False
    ) -> bool:
        """Abort ``request_id`` wherever it is (idempotent); True when it was live.

        ``is_kv_written``: prefill returned successfully for this request, so no late KV
        write can land and decode frees a reservation's pages at once instead of
        quarantining them.
        """
        request = decode_pb2.AbortRequest(
            request_id=request_id, reason=reason, is_kv_written=is_kv_written
        )
        try:
            reply = await self._stub.Abort(
                request, timeout=self._timeout_s, metadata=self._metadata(request_id)
            )
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, service="decode") from exc
        return reply.is_found

    async def stats(self) -> DecodeStats:
        try:
            reply = await self._stub.Stats(
                decode_pb2.StatsRequest(),
                timeout=self._timeout_s,
                metadata=telemetry.inject_metadata(),
            )
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, service="decode") from exc
        ranks = tuple(DecodeRankStats(**_stats_fields(r, DecodeRankStats)) for r in reply.ranks)
        return DecodeStats(**_stats_fields(reply, DecodeStats), ranks=ranks)

    async def close(self) -> None:
        if self._tokens is not None:
            await self._tokens.close()
        await self._channel.close()
