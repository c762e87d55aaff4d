"""The per-hop progress bound: each call on a request's path answers within the stall limit.

A frozen worker (SIGSTOP, a stuck loop) keeps its gRPC connection open and answers
nothing, so only a bound on each hop ends the requests already on it before their
deadline. ``StallBound.call`` cancels the call (which cancels the RPC on the worker) and
raises ``UnavailableError`` naming the hop and the bound; the registry counts the stall.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from services.common.errors import UnavailableError
from services.router.registry import WorkerRegistry
from services.router.workers import Hop, Worker

T = TypeVar("T")

_SILENCE = {
    Hop.TOKENIZE: "the tokenizer worker answered nothing",
    Hop.RESERVE: "the decode worker answered no Reserve",
    Hop.PREFILL: "the prefill worker sent no first token",
    Hop.GENERATE: "the decode worker sent nothing",
}


_COMPLETES = (Hop.TOKENIZE, Hop.PREFILL)  # decode completes with its stream's finish (generation.py)


class StallBound:
    def __init__(self, registry: WorkerRegistry, stall_timeout_s: float) -> None:
        assert stall_timeout_s > 0
        self._registry = registry
        self.stall_timeout_s = stall_timeout_s

    async def call(self, hop: Hop, worker: Worker, request_id: str, awaitable: Awaitable[T]) -> T:
        """``await awaitable`` (one call on ``worker``), cancelled after the stall limit.

        Raises ``UnavailableError`` when the limit passes; anything the call raises
        passes through, and so does a cancellation from outside (the request's deadline).
        """
        try:
            async with asyncio.timeout(self.stall_timeout_s) as bound:
                result = await awaitable
        except BaseException as exc:  # the call failed, stalled or was cancelled while in flight
            self._registry.record_failure(worker)
            if not isinstance(exc, TimeoutError) or not bound.expired():
                raise
            self._registry.record_stall(worker, hop)
            silence = f"{_SILENCE[hop]} for {self.stall_timeout_s:g} s (--stall-timeout-s)"
            raise UnavailableError(f"request {request_id}: {silence}") from None
        if hop in _COMPLETES:  # the worker's whole part of the request (health-check piggyback)
            self._registry.record_completed(worker)
        return result
