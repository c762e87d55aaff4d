"""One Encode call inside the service (``EncodeJob``), and the checks it passes before queueing."""

from __future__ import annotations

import hashlib

import msgspec

from services.common.clients.vision_encoder import EncodeSpanInput
from services.common.destinations import EmbeddingDestination
from services.common.errors import InvalidRequestError

_DTYPES = ("float32", "bfloat16", "float16")


class EncodeJob(msgspec.Struct, frozen=True):
    job_id: int
    request_id: str
    spans: tuple[EncodeSpanInput, ...]  # prompt order
    destinations: tuple[EmbeddingDestination, ...]  # one per prefill rank; each gets every row
    deadline_mono: float  # time.monotonic() seconds
    cache_only: bool = False  # encode into the owners' caches, write nowhere (no destinations)
    num_replans: int = 0  # times planned again after a rank's cache disagreed with the ledger


class JobLimits(msgspec.Struct, frozen=True):
    merge_size: int  # spatial merge of the ViT: placeholder tokens = t * h * w / merge^2
    hidden_size: int  # elements per embedding row: ModelConfig.embedding_row_width
    backend: str  # the transfer backend this encoder sends through


def validate_job(job: EncodeJob, limits: JobLimits) -> None:
    """``InvalidRequestError`` naming the offending field unless ``job`` is well formed.

    Checks every destination, and every span's hash (SHA-256 of its bytes, when sent), grid,
    length and destination rows; the image bytes themselves are decoded by the owner rank.
    """
    if job.cache_only and job.destinations:
        raise InvalidRequestError(
            "a cache_only call writes nowhere: embedding_refs must be empty",
            param="embedding_refs",
        )
    if job.spans and not job.destinations and not job.cache_only:
        raise InvalidRequestError(
            "embedding_refs is empty: nowhere to write the rows", param="embedding_refs"
        )
    for k, dst in enumerate(job.destinations):
        _check_destination(dst, k, limits)
    for i, span in enumerate(job.spans):
        _check_span(span, i, limits.merge_size)
        end = span.dest_row + span.span.length
        for dst in job.destinations:
            if end > dst.num_rows:
                raise InvalidRequestError(
                    f"spans[{i}] rows [{span.dest_row}, {end}) do not fit the "
                    f"{dst.num_rows} destination rows",
                    param=f"spans[{i}].dest_row",
                )
    _check_no_overlap(job.spans)


def _check_destination(dst: EmbeddingDestination, k: int, limits: JobLimits) -> None:
    if dst.backend != limits.backend:
        raise InvalidRequestError(
            f"embedding_refs[{k}] uses transfer backend {dst.backend!r}; this encoder sends "
            f"through {limits.backend!r}",
            param=f"embedding_refs[{k}].backend",
        )
    if dst.hidden_size != limits.hidden_size:
        raise InvalidRequestError(
            f"embedding_refs[{k}] rows hold {dst.hidden_size} elements; the model's embeddings "
            f"have {limits.hidden_size}",
            param=f"embedding_refs[{k}].hidden_size",
        )
    if dst.dtype not in _DTYPES:
        raise InvalidRequestError(
            f"embedding_refs[{k}].dtype {dst.dtype!r} is not one of {', '.join(_DTYPES)}",
            param=f"embedding_refs[{k}].dtype",
        )


def _check_span(span: EncodeSpanInput, i: int, merge: int) -> None:
    # No bytes: served from the cache if held (rows encoded from bytes that matched the hash).
    if span.image_data and hashlib.sha256(span.image_data).hexdigest() != span.span.content_hash:
        raise InvalidRequestError(
            f"spans[{i}].span.content_hash is not the SHA-256 of its image_data",
            param=f"spans[{i}].span.content_hash",
        )
    t, h, w = span.span.grid_thw
    if min(t, h, w) <= 0 or h % merge or w % merge:
        raise InvalidRequestError(
            f"spans[{i}] grid {t}x{h}x{w} must be positive with height and width multiples "
            f"of {merge}",
            param=f"spans[{i}].span",
        )
    num_tokens = t * h * w // merge**2
    if span.span.length != num_tokens:
        raise InvalidRequestError(
            f"spans[{i}].span.length is {span.span.length}; grid {t}x{h}x{w} gives "
            f"{num_tokens} tokens",
            param=f"spans[{i}].span.length",
        )


def _check_no_overlap(spans: tuple[EncodeSpanInput, ...]) -> None:
    ranges = sorted((s.dest_row, s.dest_row + s.span.length, i) for i, s in enumerate(spans))
    for (_, end, _), (start, _, i) in zip(ranges, ranges[1:], strict=False):
        if start < end:
            raise InvalidRequestError(
                f"spans[{i}] destination rows overlap another span's", param=f"spans[{i}].dest_row"
            )
