"""The encoder rank step the tests' rank processes import by path: the real step plus hooks.

A test sends a hook straight to a rank's group (``ServedEncoder.hook``: the group of the
hook's ``rank``, else every rank's), past the leader, so the leader's ledger knows nothing
of it: ``ClearCache`` empties one rank's cache behind the leader's back; ``Delay`` makes
one rank's next encode step sleep first (its peers run theirs meanwhile: a batch held
mid-way); ``Fail`` makes one rank's next encode step raise after its peers' work;
``Announce`` has every rank mark a file once its next encode step has run (its rows
sent), which ``ranks_done`` reads. A hook step answers the rank's empty result.
"""

from __future__ import annotations

import time
from pathlib import Path

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


class Announce(msgspec.Struct, frozen=True, tag="announce"):
    directory: str


def ranks_done(directory: Path) -> set[int]:
    """The ranks that ran their encode step after an ``Announce`` of ``directory``."""
    return {int(path.name.removeprefix("rank-")) for path in directory.glob("rank-*")}


class HookedEncoderStep(EncoderRankStep):
    payload_type = (  # type: ignore[assignment]
        EncodeStepPayload | ClearCache | Delay | Fail | Announce
    )

    def __init__(self, ctx: RankContext, init: EncoderRankInit) -> None:
        super().__init__(ctx, init)
        self.rank = init.rank
        self._delay_s = 0.0
        self._fail = False
        self._announce_in: str | None = None

    def execute(self, step: int, payload) -> EncodeStepResult:
        if isinstance(payload, ClearCache):
            if payload.rank == self.rank and self.worker.cache is not None:  # not a TP follower
                self.worker.cache.clear()
            return EncodeStepResult(rank=self.rank)
        if isinstance(payload, Delay):
            if payload.rank == self.rank:
                self._delay_s = payload.seconds
            return EncodeStepResult(rank=self.rank)
        if isinstance(payload, Fail):
            self._fail = payload.rank == self.rank
            return EncodeStepResult(rank=self.rank)
        if isinstance(payload, Announce):
            self._announce_in = payload.directory
            return EncodeStepResult(rank=self.rank)
        delay_s, self._delay_s = self._delay_s, 0.0
        time.sleep(delay_s)
        result = super().execute(step, payload)
        if self._announce_in is not None:
            (Path(self._announce_in) / f"rank-{self.rank}").touch()
            self._announce_in = None
        if self._fail:
            self._fail = False
            raise RuntimeError(f"injected failure of rank {self.rank}")
        return result
