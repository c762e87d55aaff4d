"""Decode scheduler: CPU bookkeeping of one rank's requests; decides every step's batch.

Request lifecycle (``ReqStatus``):

  RESERVED  add(): pages taken for min(prompt_len + max_new_tokens, max_model_len)
            positions; prefill writes the prompt's KV into the first of them.
              -> WAITING   start(): Generate arrived with prefill's proof that the KV is
                           written (check_kv_written); the first token, sampled by
                           prefill, becomes output token 1
              -> FINISHED  start(): that first token already ends the request
              -> ABORTED   abort(): the router aborted, or the transfer session expired.
                           When the session failed, prefill may still be writing the pages:
                           abort(quarantine=True) parks them in kv's quarantine, not free
  WAITING   KV ready, not stepped yet.
              -> RUNNING   schedule(): joins the next step's batch (FIFO, at most
                           max_running_requests run at once)
              -> ABORTED   abort()
  RUNNING   in every plan: its last token is fed at position seq_len, the next sampled.
              -> FINISHED  update_from_output(): EOS / stop token, max_new_tokens (the
                           first token counts), or the context limit
              -> ABORTED   abort()
  FINISHED / ABORTED: forgotten; pages freed (or quarantined) exactly once. A request in
            the step in flight keeps its pages until update_from_output: that step still
            writes its KV, so the pages must not go to another request before it ends.
            Quarantined pages go back to the free list at the engine's sweep once their
            time is up (``kv.release_quarantined``).

Requests join and leave the batch at every step. ``plan.released_request_ids`` tells the
worker which requests it ran are gone, so it drops their state (random generators).
"""

from __future__ import annotations

import enum
import hmac
from collections import deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import msgspec

from services.common.errors import InvalidRequestError, NotFoundError
from services.common.types import FinishReason, Usage
from services.decode.kv_manager import KVReservationManager
from services.engine.sampler import SamplingParams


class ReqStatus(enum.Enum):
    RESERVED = "reserved"
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass
class DecodeRequest:
    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    rope_delta: int  # M-RoPE position delta of the prompt
    # What prefill returns once the KV landed (signing.kv_written_proof); b"" accepts no proof
    kv_written_proof: bytes = b""
    status: ReqStatus = ReqStatus.RESERVED
    output_ids: list[int] = field(default_factory=list)  # the first token from prefill included

    @property
    def seq_len(self) -> int:  # KV positions written before the last output token is fed
        return len(self.prompt_ids) + len(self.output_ids) - 1

    @property
    def usage(self) -> Usage:
        return Usage(num_prompt_tokens=len(self.prompt_ids), num_completion_tokens=len(self.output_ids))


class DecodeItem(msgspec.Struct, frozen=True):
    """One request's part of a decode step."""

    request_id: str
    token_id: int  # the last sampled token, fed this step
    seq_len: int  # KV positions already written = the index of token_id's position
    position: int  # M-RoPE position of token_id on all three axes: seq_len + rope_delta
    params: SamplingParams
    prompt_ids: tuple[int, ...]  # for the repetition penalty; () when the params use no penalty
    output_ids: tuple[int, ...]  # for the penalties; () when the params use none
    is_new: bool  # the request's first step: the worker sets up its generator


class DecodePlan(msgspec.Struct, frozen=True):
    items: tuple[DecodeItem, ...]  # the running batch of this step, in order
    released_request_ids: tuple[str, ...] = ()  # requests run before and gone since the last plan


class TokenEvent(msgspec.Struct, frozen=True):
    """New tokens of one request; the last event of a request carries finish_reason and usage."""

    request_id: str
    token_ids: tuple[int, ...]  # empty when the first token already finished the request
    finish_reason: FinishReason | None = None
    usage: Usage | None = None


def _uses_history(params: SamplingParams) -> bool:
    """Whether sampling reads the request's tokens (penalties, and the min_tokens mask's count)."""
    is_penalized = params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0
    return is_penalized or params.presence_penalty != 0.0 or params.min_tokens > 0


class DecodeScheduler:
    """Owns one rank's decode requests and their KV pages (through ``kv``)."""

    def __init__(
        self,
        kv: KVReservationManager,
        eos_token_ids: Collection[int],
        max_model_len: int,
        max_running_requests: int,
    ) -> None:
        assert max_model_len > 1 and max_running_requests > 0
        self.kv = kv
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.max_running_requests = max_running_requests
        self._requests: dict[str, DecodeRequest] = {}
        self._waiting: deque[str] = deque()
        self._running: list[str] = []
        self._in_flight: set[str] = set()  # request ids of the plan being executed
        self._free_after_step: list[str] = []  # left while in flight: pages freed when the step ends
        self._released: list[str] = []

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    def status(self, request_id: str) -> ReqStatus | None:
        request = self._requests.get(request_id)
        return None if request is None else request.status

    @property
    def num_reserved(self) -> int:
        return len(self._requests) - len(self._waiting) - len(self._running)

    @property
    def num_running(self) -> int:
        """Requests generating: running, or waiting to join the next step."""
        return len(self._waiting) + len(self._running)

    @property
    def has_work(self) -> bool:
        return bool(self._waiting or self._running or self._released)

    def num_positions(self, prompt_len: int, params: SamplingParams) -> int:
        return min(prompt_len + params.max_new_tokens, self.max_model_len)

    def add(self, request: DecodeRequest) -> list[int]:
        """RESERVED, with pages for every position it can write; returns them in position order.

        ``InvalidRequestError`` for a live request id, ``CapacityError`` when pages are short.
        """
        request_id = request.request_id
        if request_id in self._requests or request_id in self._free_after_step:
            raise InvalidRequestError(f"request {request_id} is already live on decode", param="request_id")
        assert request.status is ReqStatus.RESERVED and not request.output_ids
        pages = self.kv.allocate(request_id, self.num_positions(len(request.prompt_ids), request.params))
        self._requests[request_id] = request
        return pages

    def check_kv_written(self, request_id: str, kv_written_proof: bytes) -> None:
        """``InvalidRequestError`` unless ``kv_written_proof`` is the request's: prefill wrote its KV."""
        request = self._requests.get(request_id)
        if request is None:
            raise NotFoundError(
                f"no reserved request {request_id} on decode (unknown, expired or aborted)"
            )
        if not kv_written_proof:
            raise InvalidRequestError(
                f"Generate for {request_id} carries no kv_written_proof: decode starts a "
                "reservation only once prefill reported its KV written", param="kv_written_proof",
            )
        expected = request.kv_written_proof
        if not expected or not hmac.compare_digest(kv_written_proof, expected):
            raise InvalidRequestError(
                f"kv_written_proof is not the one prefill returned for {request_id}'s reservation",
                param="kv_written_proof",
            )

    def start(self, request_id: str, first_token_id: int) -> TokenEvent | None:
        """RESERVED -> WAITING with the first token; the finishing event if that token ends it."""
        request = self._requests.get(request_id)
        if request is None:
            raise NotFoundError(f"no reserved request {request_id} on decode (unknown, expired or aborted)")
        if request.status is not ReqStatus.RESERVED:
            raise InvalidRequestError(f"Generate already started for {request_id}", param="request_id")
        request.output_ids.append(first_token_id)
        reason = self._finish_reason(request, first_token_id)
        if reason is not None:
            self._remove(request, ReqStatus.FINISHED)
            return TokenEvent(request_id, (), reason, request.usage)
        request.status = ReqStatus.WAITING
        self._waiting.append(request_id)
        return None

    def abort(self, request_id: str, *, quarantine: bool = False) -> bool:
        """Drop ``request_id`` in any state and free its pages; False when it is not live.

        ``quarantine``: a RESERVED request's pages may still receive a late KV write, so
        they rest in ``kv``'s quarantine instead of going back to the free list.
        """
        request = self._requests.get(request_id)
        if request is None:
            return False
        assert not quarantine or request.status is ReqStatus.RESERVED, "only a reservation's KV can land late"
        self._remove(request, ReqStatus.ABORTED, quarantine)
        return True

    def abort_all(self) -> list[str]:
        """Drop every request and free its pages at once (the quarantine stays as it is).

        Only when no step is in flight and no request is admitted any more (shutdown, worker
        failure): a late KV write then harms nobody.
        """
        self._in_flight = set()
        for request_id in self._free_after_step:
            self.kv.free(request_id)
        self._free_after_step = []
        request_ids = list(self._requests)
        for request_id in request_ids:
            self.abort(request_id)
        return request_ids

    def schedule(self) -> DecodePlan:
        """The next step's batch: every running request, plus waiting ones while there is room."""
        joined: set[str] = set()
        while self._waiting and len(self._running) < self.max_running_requests:
            request_id = self._waiting.popleft()
            self._requests[request_id].status = ReqStatus.RUNNING
            self._running.append(request_id)
            joined.add(request_id)
        items = tuple(self._item(self._requests[r], r in joined) for r in self._running)
        released, self._released = tuple(self._released), []
        self._in_flight = set(self._running)
        return DecodePlan(items, released)

    def update_from_output(self, plan: DecodePlan, token_ids: Sequence[int]) -> list[TokenEvent]:
        """Append each sampled token, apply the stop rules; one event per request still live."""
        assert len(token_ids) == len(plan.items), "one sampled token per plan item"
        self._in_flight = set()
        for request_id in self._free_after_step:
            self.kv.free(request_id)
        self._free_after_step = []
        events = []
        for item, token_id in zip(plan.items, token_ids, strict=True):
            request = self._requests.get(item.request_id)
            if request is None or request.status is not ReqStatus.RUNNING:
                continue  # aborted while the step ran
            request.output_ids.append(token_id)
            reason = self._finish_reason(request, token_id)
            if reason is None:
                events.append(TokenEvent(item.request_id, (token_id,)))
            else:
                self._remove(request, ReqStatus.FINISHED)
                events.append(TokenEvent(item.request_id, (token_id,), reason, request.usage))
        return events

    def _item(self, request: DecodeRequest, is_new: bool) -> DecodeItem:
        seq_len = request.seq_len
        uses_history = _uses_history(request.params)
        return DecodeItem(
            request_id=request.request_id,
            token_id=request.output_ids[-1],
            seq_len=seq_len,
            position=seq_len + request.rope_delta,
            params=request.params,
            prompt_ids=request.prompt_ids if uses_history else (),
            output_ids=tuple(request.output_ids) if uses_history else (),
            is_new=is_new,
        )

    def _finish_reason(self, request: DecodeRequest, token_id: int) -> FinishReason | None:
        params = request.params
        if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in self.eos_token_ids):
            return FinishReason.STOP
        if len(request.output_ids) >= params.max_new_tokens:
            return FinishReason.LENGTH
        if len(request.prompt_ids) + len(request.output_ids) >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _remove(self, request: DecodeRequest, status: ReqStatus, quarantine: bool = False) -> None:
        request_id = request.request_id
        del self._requests[request_id]
        if request.status is ReqStatus.WAITING:
            self._waiting.remove(request_id)
        elif request.status is ReqStatus.RUNNING:
            self._running.remove(request_id)
            self._released.append(request_id)
        request.status = status
        if request_id in self._in_flight:
            self._free_after_step.append(request_id)
        elif quarantine:
            self.kv.quarantine(request_id)
        else:
            self.kv.free(request_id)
