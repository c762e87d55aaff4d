"""Prefill scheduler: CPU bookkeeping of requests from arrival to their KV handoff.

Request lifecycle (one table, FIFO order of arrival):

  QUEUED    -> added by the servicer after validation (``add``).
  ENCODING  -> ``admit``: the request's image tokens got one contiguous run of rows in the
               embedding buffer and the leader calls Encode for its spans. Text-only
               requests skip ENCODING and go straight to READY. An image request that
               finds no rows waits (and so do the image requests behind it).
  READY     -> ``finish_encoding`` after every span's rows are written.
  RUNNING   -> ``schedule``: picked into the one EXTEND batch (``PrefillPlan``) the ranks
               run (forward, first token, KV write). At most one plan is in flight.
  DONE / FAILED -> ``update_from_output`` (per-request outcome; rows freed), ``fail_plan``
               (the step failed), ``abort`` (deadline passed or caller gone), a failed
               Encode, or ``fail_row_holders`` (the ranks holding the rows re-formed).

Batch rule: a plan only holds requests whose kinds pairwise ``can_share_batch`` (image
placeholders and embedding overrides never mix). A plan holds the oldest READY request
and then every later compatible READY request that fits ``max_batch_tokens`` (tokens it
computes: those past its cached prefix) and the local KV pool (every page of its prompt:
the prefix cache gives up whatever the plan does not read). Rows of a request whose
Encode may still be writing (it timed out or its peer vanished) are quarantined for ``row_quarantine_s`` before they are reused.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from services.common.errors import (
    AbortedError,
    CapacityError,
    DeadlineExceededError,
    InvalidRequestError,
    StageServeError,
)
from services.prefill.prefix_cache import CacheAsk, PrefixIndex
from services.prefill.request import (
    BatchKind,
    PlannedRequest,
    PrefillInput,
    PrefillOutput,
    PrefillPlan,
    PrefillStatus,
    RequestOutcome,
    can_share_batch,
)
from services.transfer.embeddings import EmbeddingRowManager


@dataclass
class SchedEntry:
    input: PrefillInput
    images: dict[str, bytes]  # content_hash -> compressed bytes, for Encode
    status: PrefillStatus = PrefillStatus.QUEUED
    row_start: int = -1  # -1: no rows held
    num_cached_image_tokens: int = 0
    is_aborted: bool = False  # the caller is gone; the outcome is dropped
    # the shared KV store: its leading keys (as last asked), whether that answer is awaited
    # (the request waits for it before a plan), and whether a plan reading it failed
    in_store: int = 0
    is_store_pending: bool = False
    skips_store: bool = False
    failure: StageServeError | None = None  # fails when its Encode returns (its rows are gone)

    @property
    def request_id(self) -> str:
        return self.input.request_id


@dataclass
class _Quarantined:
    start: int
    num_rows: int
    release_at: float


@dataclass
class PrefillScheduler:
    rows: EmbeddingRowManager
    num_pages: int  # pages of the local KV pool
    page_size: int
    max_batch_tokens: int
    max_queued: int = 256  # live requests (any non-terminal state) before add() refuses
    row_quarantine_s: float = 30.0
    prefix: PrefixIndex | None = None  # the ranks' prefix cache (None: off)
    clock: Callable[[], float] = time.monotonic
    _entries: dict[str, SchedEntry] = field(default_factory=dict)  # insertion order = FIFO
    _quarantine: list[_Quarantined] = field(default_factory=list)
    _in_flight: PrefillPlan | None = None
    _plan_ids: itertools.count = field(default_factory=itertools.count)

    # --- queries -----------------------------------------------------------------------
    @property
    def num_live(self) -> int:
        return len(self._entries)

    def num_in(self, status: PrefillStatus) -> int:
        return sum(e.status is status for e in self._entries.values())

    @property
    def saturation(self) -> float:
        """How full this prefill is, 0..1: the larger of its queue's use (live requests over
        ``max_queued``; at 1 ``add`` refuses) and the prompt tokens waiting for a batch over
        ``max_batch_tokens`` (at 1 a whole batch waits behind the one running)."""
        num_waiting_tokens = sum(
            e.input.num_tokens
            for e in self._entries.values()
            if e.status in (PrefillStatus.QUEUED, PrefillStatus.ENCODING, PrefillStatus.READY)
        )
        return min(
            1.0, max(self.num_live / self.max_queued, num_waiting_tokens / self.max_batch_tokens)
        )

    @property
    def has_worker_work(self) -> bool:
        """A plan is in flight or READY requests wait for one: the rank worker should be progressing.

        Requests still QUEUED or ENCODING wait on the vision encoder (or its rows), not on this worker.
        """
        return self._in_flight is not None or any(
            e.status is PrefillStatus.READY for e in self._entries.values()
        )

    def next_wake(self) -> float | None:
        """The earliest time (``clock``) a pump has work: a queued request's deadline or a
        quarantine release; None when nothing waits on time."""
        times = [q.release_at for q in self._quarantine]
        times.extend(
            e.input.deadline_mono
            for e in self._entries.values()
            if e.status in (PrefillStatus.QUEUED, PrefillStatus.READY)
        )
        return min(times, default=None)

    def get(self, request_id: str) -> SchedEntry | None:
        return self._entries.get(request_id)

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # --- transitions -------------------------------------------------------------------
    def add(self, request: PrefillInput, images: dict[str, bytes]) -> SchedEntry:
        """QUEUED. ``InvalidRequestError`` when it can never run here, ``CapacityError`` when full."""
        if request.request_id in self._entries:
            raise InvalidRequestError(
                f"request {request.request_id} is already being prefilled", param="request_id"
            )
        if self.pages_needed(request.num_tokens) > self.num_pages:
            raise InvalidRequestError(
                f"the prompt has {request.num_tokens} tokens; this prefill worker holds at most "
                f"{self.num_pages * self.page_size}",
                param="token_ids",
            )
        if request.num_image_tokens > self.rows.num_rows:
            raise InvalidRequestError(
                f"the prompt has {request.num_image_tokens} image tokens; the embedding buffer holds "
                f"{self.rows.num_rows}",
                param="image_spans",
            )
        if len(self._entries) >= self.max_queued:
            raise CapacityError(f"prefill queue is full ({self.max_queued} requests)")
        entry = SchedEntry(request, images)
        self._entries[request.request_id] = entry
        return entry

    def admit(self) -> list[SchedEntry]:
        """QUEUED -> READY (text) or ENCODING (rows allocated); returns the requests to Encode."""
        self._release_quarantine()
        to_encode: list[SchedEntry] = []
        is_image_blocked = False
        for entry in self._entries.values():
            if entry.status is not PrefillStatus.QUEUED:
                continue
            num_rows = entry.input.num_image_tokens
            if num_rows == 0:
                entry.status = PrefillStatus.READY
            elif not is_image_blocked and self.rows.can_allocate(num_rows):
                entry.row_start = self.rows.allocate(num_rows)
                entry.status = PrefillStatus.ENCODING
                to_encode.append(entry)
            else:
                is_image_blocked = True  # FIFO among image requests: no overtaking the blocked one
        return to_encode

    def finish_encoding(
        self,
        request_id: str,
        error: StageServeError | None = None,
        num_cached_image_tokens: int = 0,
        may_still_write: bool = False,
    ) -> RequestOutcome | None:
        """ENCODING -> READY, or FAILED (returned) on ``error`` or an abort during the Encode.

        ``may_still_write``: the encoder may still be writing the rows (timeout, peer gone),
        so they are quarantined instead of freed.
        """
        entry = self._entries[request_id]
        assert entry.status is PrefillStatus.ENCODING, f"{request_id} is {entry.status}"
        error = error or entry.failure
        if error is None and not entry.is_aborted:
            entry.status = PrefillStatus.READY
            entry.num_cached_image_tokens = num_cached_image_tokens
            return None
        error = error or AbortedError(f"{request_id} was aborted while its images were encoding")
        return self._finish(
            entry, RequestOutcome(request_id, error=error), quarantine_rows=may_still_write
        )

    def schedule(self) -> PrefillPlan | None:
        """READY -> RUNNING for one batch; None when a plan is in flight or nothing is READY."""
        if self._in_flight is not None:
            return None
        chosen: list[SchedEntry] = []
        num_tokens = num_pages = 0
        for entry in self._entries.values():
            if entry.status is not PrefillStatus.READY or entry.is_store_pending:
                continue
            tokens, pages = self._new_tokens(entry), self.pages_needed(entry.input.num_tokens)
            if chosen and (
                num_tokens + tokens > self.max_batch_tokens or num_pages + pages > self.num_pages
            ):
                continue
            if not all(can_share_batch(entry.input.kind, c.input.kind) for c in chosen):
                continue
            chosen.append(entry)
            num_tokens, num_pages = num_tokens + tokens, num_pages + pages
        if not chosen:
            return None
        for entry in chosen:
            entry.status = PrefillStatus.RUNNING
        planned = tuple(PlannedRequest(e.input, e.row_start, e.in_store) for e in chosen)
        self._in_flight = PrefillPlan(next(self._plan_ids), planned)
        return self._in_flight

    def update_from_output(self, plan: PrefillPlan, output: PrefillOutput) -> list[RequestOutcome]:
        """Every request of ``plan`` -> DONE or FAILED; returns the outcomes of those not aborted."""
        assert self._in_flight is plan and output.plan_id == plan.plan_id
        self._in_flight = None
        finished = [self._finish(self._entries[o.request_id], o) for o in output.outcomes]
        return [o for o in finished if o is not None]

    def fail_plan(self, plan: PrefillPlan, error: StageServeError) -> list[RequestOutcome]:
        """The worker raised: every request of ``plan`` FAILED with ``error``."""
        assert self._in_flight is plan
        self._in_flight = None
        finished = [
            self._finish(self._entries[i], RequestOutcome(i, error=error)) for i in plan.request_ids
        ]
        return [o for o in finished if o is not None]

    def retry_without_store(self, plan: PrefillPlan) -> None:
        """The plan that read the shared KV store failed: its requests go back to READY (their
        rows kept), to be computed without the store."""
        assert self._in_flight is plan
        self._in_flight = None
        for request_id in plan.request_ids:
            entry = self._entries[request_id]
            entry.status, entry.in_store, entry.skips_store = PrefillStatus.READY, 0, True
            if entry.is_aborted:
                self._finish(entry, RequestOutcome(request_id, error=AbortedError("aborted")))

    def fail_row_holders(self, error: StageServeError) -> list[RequestOutcome]:
        """Every request waiting with image rows -> FAILED with ``error`` (the rows are gone).

        One still encoding fails when its Encode returns; a running one with its plan.
        """
        outcomes = []
        for entry in list(self._entries.values()):
            if not entry.input.num_image_tokens:
                continue
            if entry.status is PrefillStatus.ENCODING:
                entry.failure = error
            elif entry.status is PrefillStatus.READY:
                outcome = self._finish(entry, RequestOutcome(entry.request_id, error=error))
                if outcome is not None:
                    outcomes.append(outcome)
        return outcomes

    def abort(self, request_id: str, error: StageServeError) -> None:
        """Drop a request in any state: now if it holds no one's attention, else when its step returns."""
        entry = self._entries.get(request_id)
        if entry is None:
            return
        entry.is_aborted = True
        if entry.status in (PrefillStatus.QUEUED, PrefillStatus.READY):
            self._finish(entry, RequestOutcome(request_id, error=error))

    def expire(self) -> list[RequestOutcome]:
        """QUEUED / READY requests past their deadline -> FAILED (DEADLINE_EXCEEDED); quarantined
        rows past their release time -> free."""
        self._release_quarantine()
        now = self.clock()
        expired = [
            e
            for e in self._entries.values()
            if e.status in (PrefillStatus.QUEUED, PrefillStatus.READY)
            and e.input.deadline_mono <= now
        ]
        outcomes = []
        for entry in expired:
            error = DeadlineExceededError(
                f"{entry.request_id} passed its deadline before prefill ran"
            )
            outcome = self._finish(entry, RequestOutcome(entry.request_id, error=error))
            if outcome is not None:
                outcomes.append(outcome)
        return outcomes

    # --- resources ---------------------------------------------------------------------
    def _new_tokens(self, entry: SchedEntry) -> int:
        """Tokens of ``entry`` a plan computes: those past the prefix every rank has cached (a
        plan on fewer ranks reads at least that much)."""
        if self.prefix is None:
            return entry.input.num_tokens
        every = range(self.prefix.num_ranks)
        hit = self.prefix.reusable(CacheAsk.of(entry.input, entry.in_store), every)
        return entry.input.num_tokens - hit * self.page_size

    @property
    def num_rows_used(self) -> int:
        return self.rows.num_rows - self.rows.num_free_rows

    def _finish(
        self, entry: SchedEntry, outcome: RequestOutcome, quarantine_rows: bool = False
    ) -> RequestOutcome | None:
        entry.status = PrefillStatus.DONE if outcome.is_ok else PrefillStatus.FAILED
        self._free_rows(entry, quarantine=quarantine_rows)
        del self._entries[entry.request_id]
        if entry.is_aborted:
            return None
        return dataclasses.replace(outcome, num_cached_image_tokens=entry.num_cached_image_tokens)

    def _free_rows(self, entry: SchedEntry, quarantine: bool) -> None:
        if entry.row_start < 0:
            return
        start, num_rows = entry.row_start, entry.input.num_image_tokens
        entry.row_start = -1
        if quarantine and self.row_quarantine_s > 0:
            self._quarantine.append(
                _Quarantined(start, num_rows, self.clock() + self.row_quarantine_s)
            )
        else:
            self.rows.free(start, num_rows)

    def _release_quarantine(self) -> None:
        now = self.clock()
        for item in [q for q in self._quarantine if q.release_at <= now]:
            self._quarantine.remove(item)
            self.rows.free(item.start, item.num_rows)

    @staticmethod
    def kind_of(num_image_tokens: int, has_embeds: bool = False) -> BatchKind:
        if has_embeds:
            return BatchKind.EMBEDDING_OVERRIDE
        return BatchKind.IMAGE if num_image_tokens else BatchKind.TEXT
