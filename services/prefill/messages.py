"""What the prefill leader and its rank processes exchange: one step = one ``RankPlan``.

The leader makes every decision (which requests run, how they are chunked into passes,
whether the plan is sharded over every rank or run by one) and sends it in the plan; a
rank only executes it. Every rank answers with a ``RankResult`` (rank order at the
leader); the plan's digest, all-gathered, proves every rank ran the same plan.
"""

from __future__ import annotations

import hashlib

import msgspec

from services.common.destinations import EmbeddingDestination, KvDestination, KvPoolLayout
from services.common.types import ImageSpanRef, SamplingParams, TokenLogprob

SHARDED = -1  # RankPlan.solo_rank: every rank runs its shard of the plan


class RankRequest(msgspec.Struct, frozen=True):
    """One planned request as a rank needs it (no image bytes, no caller state)."""

    request_id: str
    token_ids: tuple[int, ...]
    spans: tuple[ImageSpanRef, ...]  # prompt order, request-global offsets
    params: SamplingParams
    kv_dst: KvDestination  # decode's pages for the prompt, position order
    deadline_unix_s: float  # wall clock (the KvRef's expiry is too): no KV write starts after it
    row_start: int  # first embedding-buffer row of its image tokens (every rank's buffer); -1: none
    trace_carrier: dict[str, str] = {}
    # [num_tokens, hidden] little-endian rows of ``embeds_dtype`` overriding the token embeddings
    prompt_embeds: bytes = b""
    embeds_dtype: str = ""
    # the prefix cache (prefix_cache.py): the pages of positions [0, len * page_size) it reads
    # from this rank's cache, and the keys of the computed pages after them that it keeps
    prefix_keys: tuple[bytes, ...] = ()
    store_keys: tuple[bytes, ...] = ()
    # a tensor-parallel decode rank's other pools (TP ranks 1 .. T-1; kv_dst: TP rank 0's)
    kv_tp_dsts: tuple[KvDestination, ...] = ()

    @property
    def kv_dsts(self) -> tuple[KvDestination, ...]:
        """Every pool of decode's rank that gets the prompt's KV, TP rank order."""
        return (self.kv_dst, *self.kv_tp_dsts)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_image_tokens(self) -> int:
        return sum(span.length for span in self.spans)


class PassSegment(msgspec.Struct, frozen=True, array_like=True):
    """Tokens ``[start, end)`` of ``plan.requests[request]`` in one forward pass."""

    request: int
    start: int
    end: int


class CacheMoves(msgspec.Struct, frozen=True, array_like=True):
    """One rank's prefix-cache moves before a plan (``prefix_cache.py``), in field order."""

    drop: tuple[bytes, ...] = ()  # cached pages it frees, in device memory or the host tier
    spill: tuple[bytes, ...] = ()  # device pages copied into the host tier, then freed
    load: tuple[bytes, ...] = ()  # host-tier pages copied back into device pages
    fetch: tuple[bytes, ...] = ()  # pages read from the shared KV store into device pages
    put: tuple[bytes, ...] = ()  # after the plan: computed pages it writes to the KV store


class RankPlan(msgspec.Struct, frozen=True, tag="plan"):
    """One prefill batch: its passes run in order (a long prompt's chunks are passes)."""

    plan_id: int
    requests: tuple[RankRequest, ...]
    passes: tuple[tuple[PassSegment, ...], ...]
    solo_rank: int  # SHARDED, or the one rank that runs the whole plan (the others idle)
    block_tokens: int  # sharded: block b of a pass's packed tokens goes to rank b % C
    # per rank: its prefix-cache moves before the plan, whether it runs the plan or not
    moves: tuple[CacheMoves, ...] = ()

    def digest(self) -> bytes:
        return hashlib.sha256(msgspec.msgpack.encode(self)).digest()[:16]

    def ranks(self, num_ranks: int) -> range:
        """The ranks that run it."""
        if self.solo_rank == SHARDED:
            return range(num_ranks)
        return range(self.solo_rank, self.solo_rank + 1)


class Describe(msgspec.Struct, frozen=True, tag="describe"):
    """Asks each rank for the endpoints the leader hands out (once, after the group formed)."""


RankPayload = RankPlan | Describe


class RankDescription(msgspec.Struct, frozen=True):
    """Where a rank receives image rows and what its KV pool looks like."""

    embeddings: EmbeddingDestination  # the whole buffer as one window
    kv_layout: KvPoolLayout
    kv_backend: str
    num_host_pages: int = 0  # the prefix cache's host tier, in pages
    has_store: bool = False  # connected to the shared KV store


class RankOutcome(msgspec.Struct, frozen=True, array_like=True):
    """This rank's part of one request: its first token (if it sampled it) and its KV write."""

    request_id: str
    first_token_id: int = -1  # -1: another rank holds the last token
    num_kv_bytes: int = 0
    kv_transfer_s: float = 0.0
    error: str = ""  # this rank's KV write failed: the error text
    error_type: str = ""  # its StageServeError class name
    first_logprob: TokenLogprob | None = None  # with first_token_id, when the request asked
    # (prompt position, logprob of the token there) of this rank's prompt tokens, when asked
    prompt_logprobs: tuple[tuple[int, TokenLogprob], ...] = ()


class RankResult(msgspec.Struct, frozen=True):
    rank: int
    digests: tuple[bytes, ...] = ()  # every rank's digest of the payload, all-gathered (rank order)
    outcomes: tuple[RankOutcome, ...] = ()  # plan order; () when this rank did not run the plan
    forward_s: float = 0.0
    description: RankDescription | None = None
    peer_failed: bool = False  # another rank failed mid-pass: this rank stopped, its result is void
