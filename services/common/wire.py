"""Proto <-> domain conversions of every ``common.proto`` message (sampling parameters, KV
refs, finish reasons, image spans, usage) and of Stream errors. Clients and servicers call
these and convert only their own RPC's messages themselves.

KV refs have their own module (``kv_ref.py``). Importing this module does not import torch.
"""

from __future__ import annotations

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
