"""A decode rank on a thread of the test process, behind the interface the leader drives.

``LocalRank`` runs the real ``DecodeRank`` (built on a shared model and an in-process KV
receiver) on one worker thread: commands and reports make the msgpack round trip they
make on the control channel. ``crash`` makes the rank die as a process would (its step
raises ``UnavailableError``, readiness drops); ``restart`` forms a fresh one.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import msgspec

from services.common.errors import UnavailableError
from services.decode.messages import RankCommands, RankReport
from services.decode.rank import DecodeRank

_encoder = msgspec.msgpack.Encoder()


class LocalRank:
    def __init__(
        self, build: Callable[[], DecodeRank], on_ready_change: Callable[[bool], None], name: str
    ) -> None:
        self._build = build
        self._on_ready_change = on_ready_change
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=name)
        self.rank: DecodeRank | None = None
        self.is_ready = False
        self.hold = threading.Event()  # while cleared, steps wait (a stuck rank)
        self.hold.set()
        self.before_step: Callable[[RankCommands], None] | None = None  # runs on the rank's thread
        self.commands: list[RankCommands] = []  # every step's payload, in order

    async def start(self) -> None:
        rank = await asyncio.wrap_future(self._executor.submit(self._form))
        self.rank, self.is_ready = rank, True
        self._on_ready_change(True)

    def _form(self) -> DecodeRank:
        rank = self._build()
        rank.warmup()
        return rank

    def submit(
        self, payload: msgspec.Struct, timeout_s: float | None = None
    ) -> Future[list[RankReport]]:
        return self._executor.submit(self._step, _encoder.encode(payload))

    def _step(self, encoded: bytes) -> list[RankReport]:
        payload = msgspec.msgpack.decode(encoded, type=RankCommands)
        self.commands.append(payload)
        self.hold.wait()
        if self.before_step is not None:
            self.before_step(payload)
        if not self.is_ready or self.rank is None:
            raise UnavailableError("decode rank: the rank group is re-forming after: it was killed")
        report = self.rank.execute(payload)
        return [msgspec.msgpack.decode(_encoder.encode(report), type=RankReport)]

    def crash(self) -> None:
        """The rank process is gone: its pool with it, steps fail until ``restart``."""
        rank, self.rank, self.is_ready = self.rank, None, False
        self._on_ready_change(False)
        if rank is not None:
            rank.receiver.close()

    async def restart(self) -> None:
        await self.start()

    async def aclose(self) -> None:
        self.hold.set()
        self._executor.shutdown(wait=True)
        if self.rank is not None:
            self.rank.receiver.close()
        self.is_ready = False
