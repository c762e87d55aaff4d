"""Decode scheduler: CPU bookkeeping of one rank's requests, the one state machine of each.

Request lifecycle (``ReqStatus``):

  RESERVED  add(): pages taken for min(prompt_len + max_new_tokens, max_model_len)
            positions, and a deadline; prefill writes the prompt's KV into the first pages.
              -> WAITING   start(): generate arrived with prefill's proof that the KV is
                           written (check_kv_written); the first token, sampled by prefill,
                           becomes output token 1
              -> FINISHED  start(): that first token already ends the request
              -> ABORTED   abort(): pages quarantined (prefill may still be writing them)
                           unless is_kv_written, then freed
              -> EXPIRED   expire(): the deadline passed first; pages quarantined
  WAITING   KV ready, not stepped yet.
              -> RUNNING   schedule(): takes a batch slot and joins the next step (FIFO, at
                           most max_running_requests at once)
              -> ABORTED   abort()
  RUNNING   in every plan while it still needs tokens; each plan feeds its newest token.
              -> FINISHED  update_from_output(): EOS / stop token, max_new_tokens (the
                           first token counts), or the context limit
              -> ABORTED   abort()
  FINISHED / ABORTED / EXPIRED: forgotten; pages freed (or quarantined) exactly once.

One step late: the loop plans step N+1 before it reads step N's tokens, so a request
whose EOS is still unread runs one more step; that step's token is discarded (the
request is gone when it is read). The token counts are known ahead (``num_scheduled``),
so no step is planned past max_new_tokens or the context limit. A request leaves with its
pages and slot only once the last step it ran in has been read (its KV writes and its
slot's device state belong to that step until then). Quarantined pages go back to the
free list once their time is up (``kv.release_quarantined``).
"""

from __future__ import annotations

import enum
import hmac
import math
from collections import deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import numpy as np

from services.common.errors import InvalidRequestError, NotFoundError
from services.common.types import FinishReason, SamplingParams, Usage, finish_reason
from services.decode.kv_manager import KVReservationManager
from services.decode.messages import Finished


class ReqStatus(enum.Enum):
    RESERVED = "reserved"
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"
    EXPIRED = "expired"


@dataclass
class DecodeRequest:
    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    rope_delta: int  # M-RoPE position delta of the prompt
    deadline_mono: float = float("inf")  # a reservation not started by then expires
    # What prefill returns once the KV landed (signing.kv_written_proof); b"" accepts no proof
    kv_written_proof: bytes = b""
    status: ReqStatus = ReqStatus.RESERVED
    output_ids: list[int] = field(
        default_factory=list
    )  # read tokens, the first from prefill included
    num_scheduled: int = 0  # output tokens read or being computed by a launched step
    slot: int = -1  # its batch slot while RUNNING (and until its last step is read)
    last_step: int = -1  # the newest step it ran in

    @property
    def usage(self) -> Usage:
        return Usage(
            num_prompt_tokens=len(self.prompt_ids), num_completion_tokens=len(self.output_ids)
        )


@dataclass(frozen=True)
class JoinedRow:
    """A request's first step: what the batch runner keeps for its slot while it runs."""

    slot: int
    first_token_id: int
    params: SamplingParams
    prompt_ids: tuple[int, ...]  # for the repetition penalty; () when its params use no history
    pages: list[int]  # every page it holds, position order


@dataclass(frozen=True)
class DecodePlan:
    """One step of the running batch as whole-batch arrays; row r is ``request_ids[r]``."""

    step: int
    request_ids: tuple[str, ...]
    slots: np.ndarray  # [B] int64: each row's batch slot
    seq_lens: np.ndarray  # [B] int64: KV positions written before the row's fed token
    positions: np.ndarray  # [B] int64: M-RoPE position of the fed token (seq_len + rope delta)
    num_output_ids: (
        np.ndarray
    )  # [B] int64: output tokens before this step's (min_tokens counts them)
    joined: tuple[JoinedRow, ...]  # rows whose first step this is

    @property
    def num_rows(self) -> int:
        return len(self.request_ids)


class SlotManager:
    """The batch slots [0, num_slots): one per running request, the index of its device state."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = deque(range(num_slots))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        assert self._free, "no free batch slot"
        return self._free.popleft()

    def free(self, slot: int) -> None:
        assert 0 <= slot < self.num_slots and slot not in self._free, f"bad slot free {slot}"
        self._free.append(slot)


def check_prompt_len(prompt_len: int, max_model_len: int) -> None:
    """``InvalidRequestError`` for an empty prompt or one that leaves no room to generate."""
    if prompt_len == 0:
        raise InvalidRequestError("the prompt is empty", param="prompt_token_ids")
    if prompt_len >= max_model_len:
        raise InvalidRequestError(
            f"the prompt has {prompt_len} tokens; the context limit is {max_model_len}",
            param="prompt_token_ids",
        )


def uses_history(params: SamplingParams) -> bool:
    """Whether sampling reads the request's tokens (the penalties)."""
    is_penalized = params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0
    return is_penalized or params.presence_penalty != 0.0


class DecodeScheduler:
    """Owns one rank's decode requests, their KV pages (through ``kv``) and batch slots."""

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
        self.slots = SlotManager(max_running_requests)
        self._requests: dict[str, DecodeRequest] = {}
        self._reserved: dict[str, DecodeRequest] = {}
        self._waiting: deque[str] = deque()
        self._running: list[DecodeRequest] = []
        self._leaving: dict[str, DecodeRequest] = {}  # gone, but in a step not read yet
        self._last_read_step = -1

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    def params(self, request_id: str) -> SamplingParams | None:
        request = self._requests.get(request_id)
        return None if request is None else request.params

    def status(self, request_id: str) -> ReqStatus | None:
        request = self._requests.get(request_id)
        return None if request is None else request.status

    @property
    def num_reserved(self) -> int:
        return len(self._reserved)

    @property
    def num_running(self) -> int:
        """Requests generating: running, or waiting to join the next step."""
        return len(self._waiting) + len(self._running)

    @property
    def has_work(self) -> bool:
        """Requests to step, or gone requests whose last step is still unread."""
        return bool(self._waiting or self._running or self._leaving)

    def num_positions(self, prompt_len: int, params: SamplingParams) -> int:
        return min(prompt_len + params.max_new_tokens, self.max_model_len)

    def add(self, request: DecodeRequest) -> list[int]:
        """RESERVED, with pages for every position it can write; returns them in position order.

        ``InvalidRequestError`` for a live request id, ``CapacityError`` when pages are short.
        """
        request_id = request.request_id
        if request_id in self._requests or request_id in self._leaving:
            raise InvalidRequestError(
                f"request {request_id} is already live on decode", param="request_id"
            )
        assert request.status is ReqStatus.RESERVED and not request.output_ids
        pages = self.kv.allocate(
            request_id, self.num_positions(len(request.prompt_ids), request.params)
        )
        self._requests[request_id] = self._reserved[request_id] = request
        return pages

    def check_kv_written(self, request_id: str, kv_written_proof: bytes) -> None:
        """``InvalidRequestError`` unless ``kv_written_proof`` is the request's: prefill wrote its
        KV."""
        request = self._reserved_request(request_id)
        if not kv_written_proof:
            raise InvalidRequestError(
                f"generate for {request_id} carries no kv_written_proof: decode starts a "
                "reservation only once prefill reported its KV written",
                param="kv_written_proof",
            )
        expected = request.kv_written_proof
        if not expected or not hmac.compare_digest(kv_written_proof, expected):
            raise InvalidRequestError(
                f"kv_written_proof is not the one prefill returned for {request_id}'s reservation",
                param="kv_written_proof",
            )

    def start(self, request_id: str, first_token_id: int) -> Finished | None:
        """RESERVED -> WAITING with the first token; its ``Finished`` if that token ends it."""
        request = self._reserved_request(request_id)
        request.output_ids.append(first_token_id)
        request.num_scheduled = 1
        reason = self._finish_reason(request, first_token_id)
        if reason is not None:
            self._remove(request, ReqStatus.FINISHED)
            return Finished(request_id, reason, request.usage)
        del self._reserved[request_id]
        request.status = ReqStatus.WAITING
        self._waiting.append(request_id)
        return None

    def abort(self, request_id: str, *, is_kv_written: bool = False) -> bool:
        """Abort wherever it is; False when it was not live. A reservation's pages are
        quarantined unless ``is_kv_written`` (no late write can land): then freed."""
        request = self._requests.get(request_id)
        if request is None:
            return False
        is_reserved = request.status is ReqStatus.RESERVED
        self._remove(request, ReqStatus.ABORTED, quarantine=is_reserved and not is_kv_written)
        return True

    def next_expiry_mono(self) -> float:
        """When the first reservation expires (inf: none)."""
        return min((r.deadline_mono for r in self._reserved.values()), default=math.inf)

    def expire(self, now_s: float) -> list[str]:
        """Reservations past their deadline: EXPIRED, pages quarantined; their ids."""
        expired = [r for r in self._reserved.values() if r.deadline_mono <= now_s]
        for request in expired:
            self._remove(request, ReqStatus.EXPIRED, quarantine=True)
        return [r.request_id for r in expired]

    def abort_all(self) -> list[str]:
        """Abort every live request (reservations quarantined); their ids."""
        request_ids = list(self._requests)
        for request_id in request_ids:
            self.abort(request_id)
        return request_ids

    def drop_unread(self, last_step: int) -> None:
        """Steps up to ``last_step`` will never be read (the loop was reset, the device idle):
        release the requests that wait on them."""
        self._last_read_step = max(self._last_read_step, last_step)
        for request in list(self._leaving.values()):
            self._release(request)

    def schedule(self, step: int) -> DecodePlan | None:
        """The running batch of ``step`` (waiting requests join while slots last); None when
        empty."""
        assert step > self._last_read_step
        joined: list[DecodeRequest] = []
        while (
            self._waiting and len(self._running) < self.max_running_requests and self.slots.num_free
        ):
            request = self._requests[self._waiting.popleft()]
            request.status, request.slot = ReqStatus.RUNNING, self.slots.allocate()
            self._running.append(request)
            joined.append(request)
        rows = [r for r in self._running if r.num_scheduled < self._num_tokens_allowed(r)]
        if not rows:
            return None
        seq_lens = [len(r.prompt_ids) + r.num_scheduled - 1 for r in rows]
        plan = DecodePlan(
            step=step,
            request_ids=tuple(r.request_id for r in rows),
            slots=np.array([r.slot for r in rows], dtype=np.int64),
            seq_lens=np.array(seq_lens, dtype=np.int64),
            positions=np.array(
                [s + r.rope_delta for s, r in zip(seq_lens, rows, strict=True)], dtype=np.int64
            ),
            num_output_ids=np.array([r.num_scheduled for r in rows], dtype=np.int64),
            joined=tuple(self._joined_row(r) for r in joined),
        )
        for request in rows:
            request.num_scheduled += 1
            request.last_step = step
        return plan

    def update_from_output(
        self, plan: DecodePlan, token_ids: Sequence[int]
    ) -> tuple[list[tuple[str, int]], list[Finished]]:
        """Read ``plan``'s tokens: append each to its request, apply the stop rules.

        Returns the tokens to stream as ``(request_id, token_id)`` and the requests that
        finished; tokens of requests already gone (a stop read earlier, an abort) are dropped.
        """
        assert len(token_ids) == plan.num_rows, "one sampled token per plan row"
        assert plan.step > self._last_read_step, "steps are read in order"
        self._last_read_step = plan.step
        tokens, finished = [], []
        for request_id, token_id in zip(plan.request_ids, token_ids, strict=True):
            request = self._requests.get(request_id)
            if request is None or request.status is not ReqStatus.RUNNING:
                continue
            request.output_ids.append(token_id)
            tokens.append((request_id, token_id))
            reason = self._finish_reason(request, token_id)
            if reason is not None:
                self._remove(request, ReqStatus.FINISHED)
                finished.append(Finished(request_id, reason, request.usage))
        for request in [r for r in self._leaving.values() if r.last_step <= plan.step]:
            self._release(request)
        return tokens, finished

    def _reserved_request(self, request_id: str) -> DecodeRequest:
        request = self._requests.get(request_id)
        if request is None:
            raise NotFoundError(
                f"no reserved request {request_id} on decode (unknown, expired or aborted)"
            )
        if request.status is not ReqStatus.RESERVED:
            raise InvalidRequestError(
                f"generate already started for {request_id}", param="request_id"
            )
        return request

    def _num_tokens_allowed(self, request: DecodeRequest) -> int:
        return min(request.params.max_new_tokens, self.max_model_len - len(request.prompt_ids))

    def _joined_row(self, request: DecodeRequest) -> JoinedRow:
        prompt_ids = request.prompt_ids if uses_history(request.params) else ()
        return JoinedRow(
            request.slot,
            request.output_ids[0],
            request.params,
            prompt_ids,
            self.kv.pages(request.request_id),
        )

    def _finish_reason(self, request: DecodeRequest, token_id: int) -> FinishReason | None:
        return finish_reason(
            request.params,
            token_id,
            len(request.prompt_ids),
            len(request.output_ids),
            self.eos_token_ids,
            self.max_model_len,
        )

    def _remove(self, request: DecodeRequest, status: ReqStatus, quarantine: bool = False) -> None:
        request_id = request.request_id
        del self._requests[request_id]
        if request.status is ReqStatus.RESERVED:
            del self._reserved[request_id]
        elif request.status is ReqStatus.WAITING:
            self._waiting.remove(request_id)
        elif request.status is ReqStatus.RUNNING:
            self._running.remove(request)
        request.status = status
        if request.last_step > self._last_read_step:
            assert not quarantine, "only reservations are quarantined, and they run in no step"
            self._leaving[request_id] = request  # its last step still writes its pages and slot
        elif quarantine:
            self.kv.quarantine(request_id)
        else:
            self._release(request)

    def _release(self, request: DecodeRequest) -> None:
        self._leaving.pop(request.request_id, None)
        self.kv.free(request.request_id)
        if request.slot >= 0:
            self.slots.free(request.slot)
            request.slot = -1
