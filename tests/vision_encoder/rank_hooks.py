"""The encoder rank step the tests' rank processes import by path: the real step plus hooks.

A test sends a hook straight to the rank group (``app.group.step(hook)``), past the
leader, so the leader's ledger knows nothing of it: ``ClearCache`` empties one rank's
cache behind the leader's back; ``Delay`` makes one rank's next encode step sleep first
(its peers run theirs meanwhile: a batch held mid-way); ``Fail`` makes one rank's next
encode step raise after its peers' work. A hook step answers every rank's empty result.
"""

from __future__ import annotations

import time

import msgspec

from services.common.ranks.step import RankContext
from services.vision_encoder.rank_messages import (
    EncoderRankInit,
    EncodeStepPayload,
    EncodeStepResult,
)
from services.vision_encoder.rank_step import EncoderRankStep


class ClearCache(msgspec.Struct, frozen=True, tag="clear_cache"):
    rank: int


class Delay(msgspec.Struct, frozen=True, tag="delay"):
    rank: int
    seconds: float


class Fail(msgspec.Struct, frozen=True, tag="fail"):
    rank: int


class HookedEncoderStep(EncoderRankStep):
    payload_type = EncodeStepPayload | ClearCache | Delay | Fail  # type: ignore[assignment]

    def __init__(self, ctx: RankContext, init: EncoderRankInit) -> None:
        super().__init__(ctx, init)
        self.rank = ctx.rank
        self._delay_s = 0.0
        self._fail = False

    def execute(self, step: int, payload) -> EncodeStepResult:
        if isinstance(payload, ClearCache):
            if payload.rank == self.rank:
                self.worker.cache.clear()
            return EncodeStepResult(rank=self.rank)
        if isinstance(payload, Delay):
            if payload.rank == self.rank:
                self._delay_s = payload.seconds
            return EncodeStepResult(rank=self.rank)
        if isinstance(payload, Fail):
            self._fail = payload.rank == self.rank
            return EncodeStepResult(rank=self.rank)
        delay_s, self._delay_s = self._delay_s, 0.0
        time.sleep(delay_s)
        result = super().execute(step, payload)
        if self._fail:
            self._fail = False
            raise RuntimeError(f"injected failure of rank {self.rank}")
        return result
