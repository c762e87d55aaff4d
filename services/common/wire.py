"""Proto <-> domain conversions of every ``common.proto`` message (sampling parameters, KV
refs, finish reasons, image spans, usage) and of Stream errors. Clients and servicers call
these and convert only their own RPC's messages themselves.

``KvRefInfo`` is the domain form of ``stageserve.v1.KvRef``: decode issues it signed
(``issue_kv_ref``), the router gets it from ``DecodeClient.reserve`` and hands it
unchanged to the prefill client (``kv_ref_to_proto``); prefill checks its MAC and turns it
back into a ``KvDestination`` (``KvRefInfo.to_destination``) to write the KV. Importing
this module does not import torch.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from services.common import signing
from services.common.destinations import KvDestination, KvPoolLayout
from services.common.errors import (
    ErrorRecord,
    InvalidRequestError,
    StageServeError,
    UnavailableError,
)
from services.common.pb.stageserve.v1 import common_pb2, decode_pb2
from services.common.types import (
    FinishReason,
    Grammar,
    GrammarKind,
    ImageSpanRef,
    SamplingParams,
    TokenLogprob,
    Usage,
)


class KvBufferInfo(msgspec.Struct, frozen=True):
    """One registered K or V buffer of decode's pool, ``[layers, pages, page_size, heads, dim]``."""

    kind: str  # "k" | "v"
    base_address: int
    size_bytes: int
    layer_stride_bytes: int
    page_stride_bytes: int
    slot_stride_bytes: int


class KvShardInfo(msgspec.Struct, frozen=True):
    """One more tensor-parallel decode rank's pool of a ``KvRefInfo`` (the proto ``KvRefShard``)."""

    session_id: str
    buffers: tuple[KvBufferInfo, ...]  # one "k", one "v"
    head_start: int  # the model's first KV head it holds


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
    # a tensor-parallel decode rank: TP ranks 1 .. T-1's pools (the fields above: TP rank 0's,
    # from head 0), the same pages in each; (): one pool holds every head
    tp_shards: tuple[KvShardInfo, ...] = ()

    def buffer(self, kind: str) -> KvBufferInfo:
        return _buffer(self.buffers, kind)

    def signed_fields(self) -> tuple[object, ...]:
        """Every field but ``mac``, in declaration order: what the MAC covers."""
        return tuple(getattr(self, name) for name in self.__struct_fields__ if name != "mac")

    def has_valid_mac(self, key: bytes) -> bool:
        return signing.verify(key, signing.KV_REF, self.signed_fields(), self.mac)

    def to_destination(self) -> KvDestination:
        """The destination prefill's KV sender writes to (TP rank 0's pool of a decode rank)."""
        return self._destination(self.session_id, self.buffers, 0)

    def to_destinations(self) -> tuple[KvDestination, ...]:
        """Every pool of the decode rank, TP rank order (one without tensor parallelism)."""
        return (
            self.to_destination(),
            *(self._destination(s.session_id, s.buffers, s.head_start) for s in self.tp_shards),
        )

    def _destination(
        self, session_id: str, buffers: tuple[KvBufferInfo, ...], head_start: int
    ) -> KvDestination:
        k, v = _buffer(buffers, "k"), _buffer(buffers, "v")
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
            head_start=head_start,
        )
        return KvDestination(self.backend, session_id, self.request_id, layout, self.page_ids)


def _buffer(buffers: tuple[KvBufferInfo, ...], kind: str) -> KvBufferInfo:
    return next(b for b in buffers if b.kind == kind)


def _buffers(layout: KvPoolLayout) -> tuple[KvBufferInfo, ...]:
    layer_stride = layout.num_pages * layout.page_nbytes
    return tuple(
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


def issue_kv_ref(
    destination: KvDestination,
    key: bytes,
    nonce: bytes,
    expires_unix_ms: int,
    dp_rank: int = 0,
    tp_destinations: tuple[KvDestination, ...] = (),
) -> KvRefInfo:
    """Decode's signed KvRef of ``destination`` (a reservation of ``destination.request_id``;
    ``tp_destinations``: the same pages in the pools of TP ranks 1 .. T-1 of a tensor-parallel
    decode rank, whose TP rank 0 holds ``destination``)."""
    layout = destination.layout
    for other in tp_destinations:
        if other.page_ids != destination.page_ids or other.request_id != destination.request_id:
            raise ValueError(f"{destination.request_id}: TP ranks' destinations disagree")
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
        buffers=_buffers(layout),
        nonce=nonce,
        expires_unix_ms=expires_unix_ms,
        mac=b"",
        tp_shards=tuple(
            KvShardInfo(d.session_id, _buffers(d.layout), d.layout.head_start)
            for d in tp_destinations
        ),
    )
    mac = signing.sign(key, signing.KV_REF, unsigned.signed_fields())
    return msgspec.structs.replace(unsigned, mac=mac)


_BUFFER_KINDS = {"k": common_pb2.KV_BUFFER_KIND_K, "v": common_pb2.KV_BUFFER_KIND_V}
_BUFFER_KIND_NAMES = {code: name for name, code in _BUFFER_KINDS.items()}


# Fields copied as they are between KvRefInfo / KvBufferInfo and their protos.
_KV_REF_FIELDS = (
    "request_id",
    "backend",
    "session_id",
    "dp_rank",
    "page_size",
    "num_layers",
    "num_kv_heads",
    "head_dim",
    "dtype",
    "nonce",
    "expires_unix_ms",
    "mac",
)
_KV_BUFFER_FIELDS = (
    "base_address",
    "size_bytes",
    "layer_stride_bytes",
    "page_stride_bytes",
    "slot_stride_bytes",
)


def _buffers_to_proto(buffers: tuple[KvBufferInfo, ...]) -> list[common_pb2.KvBuffer]:
    return [
        common_pb2.KvBuffer(
            kind=_BUFFER_KINDS[b.kind], **{f: getattr(b, f) for f in _KV_BUFFER_FIELDS}
        )
        for b in buffers
    ]


def _buffers_from_proto(buffers: Sequence[common_pb2.KvBuffer]) -> tuple[KvBufferInfo, ...]:
    """``InvalidRequestError`` unless ``buffers`` are exactly one K and one V buffer."""
    kinds = sorted(_BUFFER_KIND_NAMES.get(b.kind, "?") for b in buffers)
    if kinds != ["k", "v"] or any(b.page_stride_bytes == 0 for b in buffers):
        raise InvalidRequestError(
            "kv_ref must carry one K and one V buffer and a page size", param="kv_ref"
        )
    return tuple(
        KvBufferInfo(
            kind=_BUFFER_KIND_NAMES[b.kind], **{f: getattr(b, f) for f in _KV_BUFFER_FIELDS}
        )
        for b in buffers
    )


def kv_ref_to_proto(info: KvRefInfo) -> common_pb2.KvRef:
    return common_pb2.KvRef(
        page_ids=info.page_ids,
        buffers=_buffers_to_proto(info.buffers),
        tp_shards=[
            common_pb2.KvRefShard(
                session_id=s.session_id,
                buffers=_buffers_to_proto(s.buffers),
                head_start=s.head_start,
            )
            for s in info.tp_shards
        ],
        **{f: getattr(info, f) for f in _KV_REF_FIELDS},
    )


def kv_ref_from_proto(message: common_pb2.KvRef) -> KvRefInfo:
    """``InvalidRequestError`` unless the message and each TP shard name exactly one K and one
    V buffer."""
    if message.page_size == 0:
        raise InvalidRequestError(
            "kv_ref must carry one K and one V buffer and a page size", param="kv_ref"
        )
    return KvRefInfo(
        page_ids=tuple(message.page_ids),
        buffers=_buffers_from_proto(message.buffers),
        tp_shards=tuple(
            KvShardInfo(s.session_id, _buffers_from_proto(s.buffers), s.head_start)
            for s in message.tp_shards
        ),
        **{f: getattr(message, f) for f in _KV_REF_FIELDS},
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
        return_logprobs=params.return_logprobs,
        num_top_logprobs=params.num_top_logprobs,
        **{name: getattr(params, name) for name in _FLOAT_FIELDS},
    )
    if params.seed is not None:
        message.seed = params.seed
    if params.num_prompt_logprobs >= 0:
        message.num_prompt_logprobs = params.num_prompt_logprobs
    if params.grammar is not None:
        grammar = params.grammar
        message.grammar.CopyFrom(
            common_pb2.Grammar(
                kind=grammar.kind.value, spec=grammar.spec, is_strict=grammar.is_strict
            )
        )
    return message


def _grammar_from_proto(message: common_pb2.SamplingParams) -> Grammar | None:
    if not message.HasField("grammar"):
        return None
    grammar = message.grammar
    try:
        kind = GrammarKind(grammar.kind)
    except ValueError:
        known = ", ".join(k.value for k in GrammarKind)
        raise InvalidRequestError(
            f"grammar.kind must be one of {known}, got {grammar.kind!r}", param="grammar"
        ) from None
    return Grammar(kind, grammar.spec, grammar.is_strict)


def sampling_params_from_proto(message: common_pb2.SamplingParams) -> SamplingParams:
    """Unset optional fields take ``SamplingParams``' defaults; not validated here."""
    optional = (*_FLOAT_FIELDS, "top_k", "seed", "max_new_tokens", "num_prompt_logprobs")
    values = {name: getattr(message, name) for name in optional if message.HasField(name)}
    return SamplingParams(
        stop_token_ids=tuple(message.stop_token_ids),
        ignore_eos=message.ignore_eos,
        min_tokens=message.min_tokens,
        logit_bias=tuple((b.token_id, b.bias) for b in message.logit_bias),
        return_logprobs=message.return_logprobs,
        num_top_logprobs=message.num_top_logprobs,
        grammar=_grammar_from_proto(message),
        **values,
    )


def token_logprob_to_proto(logprob: TokenLogprob) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(
        token_id=logprob.token_id,
        logprob=logprob.logprob,
        top_token_ids=logprob.top_token_ids,
        top_logprobs=logprob.top_logprobs,
    )


def token_logprob_from_proto(message: common_pb2.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(
        message.token_id,
        message.logprob,
        tuple(message.top_token_ids),
        tuple(message.top_logprobs),
    )


_FINISH_REASONS = {
    common_pb2.FINISH_REASON_UNSPECIFIED: None,
    common_pb2.FINISH_REASON_STOP: FinishReason.STOP,
    common_pb2.FINISH_REASON_LENGTH: FinishReason.LENGTH,
}
_FINISH_REASON_CODES = {reason: code for code, reason in _FINISH_REASONS.items()}


def finish_reason_to_proto(reason: FinishReason | None) -> int:
    """``None`` (the request goes on) is ``FINISH_REASON_UNSPECIFIED``."""
    return _FINISH_REASON_CODES[reason]


def finish_reason_from_proto(code: int) -> FinishReason | None:
    """``None`` for ``FINISH_REASON_UNSPECIFIED`` and for a code this build does not know."""
    return _FINISH_REASONS.get(code)


def image_span_to_proto(span: ImageSpanRef) -> common_pb2.ImageSpan:
    t, h, w = span.grid_thw
    return common_pb2.ImageSpan(
        offset=span.offset,
        length=span.length,
        content_hash=span.content_hash,
        grid_t=t,
        grid_h=h,
        grid_w=w,
    )


def image_span_from_proto(span: common_pb2.ImageSpan) -> ImageSpanRef:
    return ImageSpanRef(
        offset=span.offset,
        length=span.length,
        content_hash=span.content_hash,
        grid_thw=(span.grid_t, span.grid_h, span.grid_w),
    )


def usage_to_proto(usage: Usage) -> common_pb2.Usage:
    return common_pb2.Usage(
        num_prompt_tokens=usage.num_prompt_tokens,
        num_completion_tokens=usage.num_completion_tokens,
        num_cached_image_tokens=usage.num_cached_image_tokens,
        num_prefix_cached_tokens=usage.num_prefix_cached_tokens,
        num_prefix_cached_image_tokens=usage.num_prefix_cached_image_tokens,
    )


def usage_from_proto(message: common_pb2.Usage) -> Usage:
    return Usage(
        message.num_prompt_tokens,
        message.num_completion_tokens,
        message.num_cached_image_tokens,
        message.num_prefix_cached_tokens,
        message.num_prefix_cached_image_tokens,
    )


def stream_error_to_proto(error: StageServeError) -> decode_pb2.StreamError:
    record = ErrorRecord.of(error)
    return decode_pb2.StreamError(
        code=error.grpc_code,
        error_type=record.error_type,
        message=record.message,
        param=record.param or "",
    )


def stream_error_from_proto(message: decode_pb2.StreamError) -> StageServeError:
    """The error a Stream request ended with: its own class when it matches the code."""
    record = ErrorRecord(message.error_type, message.message or message.code, message.param or None)
    fallback = UnavailableError if message.code == "UNAVAILABLE" else StageServeError
    return record.to_error(fallback, grpc_code=message.code)
