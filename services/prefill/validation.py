"""Checks of one prefill request against the model and the local KV pool; each failure names its field."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from services.common.destinations import KvDestination, KvPoolLayout
from services.common.errors import InvalidRequestError
from services.common.types import ImageSpanRef, SamplingParams
from services.engine.config import ModelConfig
from services.transfer.base import check_compatible, shares_heads

EMBEDS_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # prompt_embeds dtypes


@dataclass(frozen=True)
class PromptLimits:
    vocab_size: int
    image_token_id: int
    spatial_merge_size: int
    max_context_len: int
    hidden_size: int = 0

    @classmethod
    def from_config(cls, config: ModelConfig) -> PromptLimits:
        return cls(
            config.text.vocab_size,
            config.image_token_id,
            config.vision.spatial_merge_size,
            config.text.max_position_embeddings,
            config.text.hidden_size,
        )


def validate_prompt_embeds(
    embeds: bytes, dtype: str, num_tokens: int, num_spans: int, limits: PromptLimits
) -> None:
    """``InvalidRequestError`` (param ``prompt_embeds``) unless ``embeds`` is [num_tokens, hidden]
    rows of an accepted dtype, for a prompt without images."""
    if not embeds:
        if dtype:
            raise InvalidRequestError(
                "prompt_embeds_dtype is set without prompt_embeds", param="prompt_embeds"
            )
        return
    if dtype not in EMBEDS_DTYPE_BYTES:
        raise InvalidRequestError(
            f"prompt_embeds dtype {dtype!r} is not one of {', '.join(EMBEDS_DTYPE_BYTES)}",
            param="prompt_embeds",
        )
    if num_spans:
        raise InvalidRequestError(
            "a prompt has either prompt_embeds or images, not both", param="prompt_embeds"
        )
    row_bytes = limits.hidden_size * EMBEDS_DTYPE_BYTES[dtype]
    if len(embeds) != num_tokens * row_bytes:
        rows, rest = divmod(len(embeds), num_tokens * EMBEDS_DTYPE_BYTES[dtype])
        got = f"hidden size {rows}" if not rest else f"{len(embeds)} bytes"
        raise InvalidRequestError(
            f"prompt_embeds must be [{num_tokens}, {limits.hidden_size}] {dtype} (this model's "
            f"hidden size is {limits.hidden_size}); got {got}",
            param="prompt_embeds",
        )


def validate_prompt(
    token_ids: Sequence[int],
    spans: Sequence[ImageSpanRef],
    images: dict[str, bytes],
    params: SamplingParams,
    limits: PromptLimits,
) -> None:
    """``InvalidRequestError`` (with ``param``) for the first problem of the prompt or its parameters."""
    params.validate()
    params.check_vocab(limits.vocab_size)
    if not token_ids:
        raise InvalidRequestError("the prompt is empty", param="token_ids")
    if len(token_ids) >= limits.max_context_len:
        raise InvalidRequestError(
            f"the prompt has {len(token_ids)} tokens; the context limit is {limits.max_context_len}",
            param="token_ids",
        )
    if min(token_ids) < 0 or max(token_ids) >= limits.vocab_size:
        raise InvalidRequestError(
            f"token ids must be in [0, {limits.vocab_size})", param="token_ids"
        )
    cursor = 0
    for i, span in enumerate(spans):
        _check_span(i, span, cursor, token_ids, limits)
        if span.content_hash not in images or not images[span.content_hash]:
            raise InvalidRequestError(
                f"image_spans[{i}]: no image bytes for hash {span.content_hash!r}", param="images"
            )
        cursor = span.offset + span.length
    num_placeholders = token_ids.count(limits.image_token_id)
    if num_placeholders != sum(span.length for span in spans):
        raise InvalidRequestError(
            f"the prompt has {num_placeholders} image placeholder tokens but its spans cover "
            f"{sum(span.length for span in spans)}",
            param="image_spans",
        )


def _check_span(
    i: int, span: ImageSpanRef, cursor: int, token_ids: Sequence[int], limits: PromptLimits
) -> None:
    t, h, w = span.grid_thw
    merge = limits.spatial_merge_size
    if span.offset < cursor:
        raise InvalidRequestError(
            f"image_spans[{i}] overlaps or precedes the previous span", param="image_spans"
        )
    if span.length <= 0 or span.offset + span.length > len(token_ids):
        raise InvalidRequestError(
            f"image_spans[{i}] [{span.offset}, {span.offset + span.length}) is empty or outside the "
            f"{len(token_ids)}-token prompt",
            param="image_spans",
        )
    if min(t, h, w) <= 0 or h % merge or w % merge or t * h * w != span.length * merge * merge:
        raise InvalidRequestError(
            f"image_spans[{i}]: grid {span.grid_thw} does not give {span.length} tokens "
            f"(merge size {merge})",
            param="image_spans",
        )
    placeholders = token_ids[span.offset : span.offset + span.length]
    if placeholders.count(limits.image_token_id) != span.length:
        raise InvalidRequestError(
            f"image_spans[{i}] covers non-placeholder tokens", param="image_spans"
        )


def prompt_destinations(
    dsts: Sequence[KvDestination], locals_: Sequence[KvPoolLayout], num_tokens: int, backend: str
) -> tuple[KvDestination, ...]:
    """``dsts`` (decode's pools, one per decode TP rank) cut to the prompt's pages, after
    checking that the pools of prefill's TP ranks (``locals_``, one group's) can write every
    head of each: each pair that shares KV heads is compatible, and the heads of ``locals_``
    cover each destination's."""
    out = []
    for dst in dsts:
        cut = prompt_destination(dst, locals_[0], num_tokens, backend)
        writers = [local for local in locals_ if shares_heads(local, dst.layout)]
        for local in writers:
            prompt_destination(dst, local, num_tokens, backend)
        held = {h for w in writers for h in range(w.head_start, w.head_start + w.num_kv_heads)}
        wanted = range(dst.layout.head_start, dst.layout.head_start + dst.layout.num_kv_heads)
        if not held.issuperset(wanted):
            raise InvalidRequestError(
                f"kv_ref's pool {len(out)} holds KV heads {wanted.start}..{wanted.stop - 1}, "
                "which this prefill worker's ranks do not all hold",
                param="kv_ref",
            )
        out.append(cut)
    return tuple(out)


def prompt_destination(
    dst: KvDestination, local: KvPoolLayout, num_tokens: int, backend: str
) -> KvDestination:
    """``dst`` cut to the prompt's pages, after checking it can receive this pool's pages
    (the KV heads both hold, ``check_compatible``)."""
    num_pages = -(-num_tokens // local.page_size)
    if dst.backend != backend:
        raise InvalidRequestError(
            f"kv_ref is for transfer backend {dst.backend!r}; this prefill worker sends with {backend!r}",
            param="kv_ref",
        )
    if num_pages > local.num_pages:
        raise InvalidRequestError(
            f"the prompt has {num_tokens} tokens; this prefill worker holds at most "
            f"{local.num_pages * local.page_size}",
            param="token_ids",
        )
    if len(dst.page_ids) < num_pages:
        raise InvalidRequestError(
            f"kv_ref has {len(dst.page_ids)} pages; the {num_tokens}-token prompt needs {num_pages}",
            param="kv_ref",
        )
    dst = msgspec.structs.replace(dst, page_ids=dst.page_ids[:num_pages])
    if not shares_heads(local, dst.layout):
        return dst  # another rank of the group writes these heads
    try:
        check_compatible(local, range(num_pages), dst)
    except InvalidRequestError as exc:
        raise InvalidRequestError(exc.message, param="kv_ref") from exc
    return dst
