"""The prefill service's internal request types: states, batch kinds, plan and result."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import msgspec

from services.common.destinations import KvDestination
from services.common.errors import StageServeError
from services.common.types import FinishReason, ImageSpanRef, SamplingParams, TokenLogprob


class PrefillStatus(enum.Enum):
    QUEUED = "queued"
    ENCODING = "encoding"
    READY = "ready"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"

    @property
    def is_terminal(self) -> bool:
        return self in (PrefillStatus.DONE, PrefillStatus.FAILED)


class BatchKind(enum.Enum):
    """What a request feeds the model besides token ids; decides which requests may share a batch."""

    TEXT = "text"  # token ids only
    IMAGE = "image"  # image placeholder tokens, their rows merged from the embedding buffer
    EMBEDDING_OVERRIDE = "embedding_override"  # prompt embeddings given in place of the tokens' own


_INCOMPATIBLE_KINDS = frozenset({frozenset({BatchKind.IMAGE, BatchKind.EMBEDDING_OVERRIDE})})


def can_share_batch(a: BatchKind, b: BatchKind) -> bool:
    """True when requests of kinds ``a`` and ``b`` may run in one prefill batch.

    Requests with image placeholders and requests with embedding overrides never share a
    prefill batch. Every other pair may.
    """
    return frozenset({a, b}) not in _INCOMPATIBLE_KINDS


class PrefillInput(msgspec.Struct, frozen=True):
    """One validated prompt to prefill: everything a rank needs (no image bytes)."""

    request_id: str
    token_ids: tuple[int, ...]
    spans: tuple[ImageSpanRef, ...]  # prompt order, request-global offsets
    params: SamplingParams
    kv_dst: KvDestination  # decode's pages for this prompt
    deadline_mono: float  # time.monotonic() seconds
    kind: BatchKind = BatchKind.TEXT
    trace_carrier: dict[str, str] = {}  # W3C trace context of the caller (traceparent)
    # [num_tokens, hidden] little-endian rows of ``embeds_dtype`` replacing the token embeddings
    prompt_embeds: bytes = b""
    embeds_dtype: str = ""  # torch dtype name ("float32", "bfloat16") when prompt_embeds is set
    page_keys: tuple[bytes, ...] = ()  # prefix-cache keys of its full pages (prefix_keys.py)
    # a tensor-parallel decode rank's other pools (TP ranks 1 .. T-1; kv_dst: TP rank 0's)
    kv_tp_dsts: tuple[KvDestination, ...] = ()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_image_tokens(self) -> int:
        return sum(span.length for span in self.spans)


class PlannedRequest(msgspec.Struct, frozen=True):
    request: PrefillInput
    row_start: int  # first embedding-buffer row of the request's image tokens; -1 when it has none
    in_store: int = 0  # leading page keys the shared KV store held when the leader asked


class PrefillPlan(msgspec.Struct, frozen=True):
    """One EXTEND batch the scheduler picked (the leader turns it into the ranks' ``RankPlan``)."""

    plan_id: int
    requests: tuple[PlannedRequest, ...]

    @property
    def num_tokens(self) -> int:
        return sum(r.request.num_tokens for r in self.requests)

    @property
    def request_ids(self) -> list[str]:
        return [r.request.request_id for r in self.requests]


@dataclass(frozen=True)
class RequestOutcome:
    """What happened to one request of a plan: the first token and its KV handoff, or an error."""

    request_id: str
    first_token_id: int = -1
    finish_reason: FinishReason | None = None
    num_kv_bytes: int = 0
    kv_transfer_s: float = 0.0
    num_cached_image_tokens: int = 0  # image tokens whose rows came from the encoder's cache
    num_prefix_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    num_prefix_cached_image_tokens: int = 0  # the image tokens among them
    error: StageServeError | None = None
    first_logprob: TokenLogprob | None = None  # set when the request asked (return_logprobs)
    # prompt tokens 1..n-1's logprobs, prompt order, when asked (num_prompt_logprobs >= 0)
    prompt_logprobs: tuple[TokenLogprob, ...] = ()

    @property
    def is_ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class PrefillOutput:
    """The rank worker's result of one plan: one outcome per planned request, same order."""

    plan_id: int
    outcomes: tuple[RequestOutcome, ...]
    forward_s: float
