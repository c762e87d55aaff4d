"""The prefill leader's Encode call: one request's image spans into its rows on every rank.

Each rank receives image rows in one buffer (its ``RankDescription.embeddings``); a request
holds the same window of rows on every rank (``SchedEntry.row_start``), and the encoder
writes each span's rows into every rank's window. ``encode_entry`` runs the call and reports
its result on every path, including whether the encoder may still be writing the rows
(timeout, cancellation, an unexpected failure), which the scheduler then quarantines.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Protocol

import msgspec
from opentelemetry import context as otel_context

from services.common import telemetry
from services.common.clients.vision_encoder import EncodeSpanInput, SpanResult, SpanStatus
from services.common.destinations import EmbeddingDestination
from services.common.errors import (
    DeadlineExceededError,
    InvalidRequestError,
    StageServeError,
    UnavailableError,
)
from services.prefill.messages import RankDescription
from services.prefill.request import PrefillInput
from services.prefill.scheduler import SchedEntry

logger = logging.getLogger(__name__)

# (request_id, error or None, num_cached_tokens, may_still_write)
Finish = Callable[[str, StageServeError | None, int, bool], None]


class Encoder(Protocol):
    """What the leader needs of the vision encoder (``VisionEncoderClient`` is one)."""

    async def encode(
        self,
        request_id: str,
        spans: Sequence[EncodeSpanInput],
        destination: Sequence[EmbeddingDestination],
        timeout_s: float,
    ) -> list[SpanResult]: ...


def spans_error(request: PrefillInput, results: Sequence[SpanResult]) -> StageServeError | None:
    """The error a request fails with given its per-span Encode results; None when all written."""
    if len(results) != len(request.spans):
        return UnavailableError(
            f"the encoder answered {len(results)} results for {len(request.spans)} spans"
        )
    for i, result in enumerate(results):
        if result.status is SpanStatus.INVALID_IMAGE:
            return InvalidRequestError(
                f"image_spans[{i}]: invalid image: {result.error_message}", param="images"
            )
        if result.status is not SpanStatus.WRITTEN:
            return UnavailableError(
                f"encoding image_spans[{i}] failed: {result.error_message or result.status}"
            )
    return None


def window(whole: EmbeddingDestination, start_row: int, num_rows: int) -> EmbeddingDestination:
    """Rows ``[start_row, start_row + num_rows)`` of a rank's buffer (``whole`` is all of it)."""
    assert 0 <= start_row and start_row + num_rows <= whole.num_rows
    return msgspec.structs.replace(
        whole,
        base_address=whole.base_address + start_row * whole.row_stride_bytes,
        num_rows=num_rows,
    )


async def encode_entry(
    encoder: Encoder | None,
    entry: SchedEntry,
    descriptions: Sequence[RankDescription],
    clock: Callable[[], float],
    finish: Finish,
) -> None:
    """Encode ``entry``'s spans into its rows; ``finish`` runs on every path.

    Until the encoder answered it may still be writing the rows (timeout, cancellation,
    an unexpected failure), so they are quarantined then, freed otherwise.
    """
    request = entry.input
    error: StageServeError | None = None
    num_cached, may_still_write = 0, True
    token = otel_context.attach(telemetry.extract_context(request.trace_carrier.items()))
    try:
        results = await _call_encoder(encoder, entry, descriptions, clock)
        error, may_still_write = spans_error(request, results), False
        num_cached = sum(
            s.length for s, r in zip(request.spans, results, strict=False) if r.is_cache_hit
        )
    except DeadlineExceededError as exc:  # the encoder may still be writing the rows
        error = exc
    except StageServeError as exc:
        error, may_still_write = exc, False
    except asyncio.CancelledError:  # the leader is stopping
        error = UnavailableError(f"prefill shut down while encoding {request.request_id}'s images")
        raise
    except Exception as exc:  # a bug here or in the encoder client: fail the request, keep serving
        logger.exception("encoding the images of %s failed", request.request_id)
        error = StageServeError(
            f"prefill failed to encode the images of {request.request_id}: internal error "
            f"({type(exc).__name__}; see prefill's log)"
        )
    finally:
        otel_context.detach(token)
        finish(request.request_id, error, num_cached, may_still_write)


async def _call_encoder(
    encoder: Encoder | None,
    entry: SchedEntry,
    descriptions: Sequence[RankDescription],
    clock: Callable[[], float],
) -> list[SpanResult]:
    assert encoder is not None
    request = entry.input
    spans, dest_row = [], 0
    for span in request.spans:
        spans.append(EncodeSpanInput(span, entry.images[span.content_hash], dest_row))
        dest_row += span.length
    if not descriptions:
        raise UnavailableError("the prefill rank group is re-forming")
    destinations = [window(d.embeddings, entry.row_start, dest_row) for d in descriptions]
    return await encoder.encode(
        request.request_id, spans, destinations, timeout_s=request.deadline_mono - clock()
    )
