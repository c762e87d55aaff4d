"""A decode rank on a thread of the test process, behind the interface the leader drives.

``LocalRank`` runs the real ``DecodeRank`` (built on a shared model and an in-process KV
receiver) on its own thread, free-running as the rank process does: it drains its posts,
steps while it has work, when posts came or its timers are due, and reports each step
unasked; commands and reports make the msgpack round trip they make on the control
channel. ``crash`` makes the rank die as a process would (readiness drops, every post is
reported lost); ``restart`` forms a fresh one.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from collections.abc import Callable

import msgspec

from services.common.errors import UnavailableError
from services.common.ranks.errors import StepFailedError
from services.common.ranks.free_supervisor import Reported
from services.decode.messages import RankCommands, RankReport
from services.decode.rank import DecodeRank

_encoder = msgspec.msgpack.Encoder()
POLL_S = 0.05  # an idle rank's longest wait for a post (its timers are checked after it)


class LocalRank:
    def __init__(
        self,
        build: Callable[[], DecodeRank],
        on_ready_change: Callable[[bool], None],
        on_report: Callable[[Reported], None],
        name: str,
    ) -> None:
        self._build = build
        self._on_ready_change = on_ready_change
        self._on_report = on_report
        self._name = name
        self._inbox: queue.SimpleQueue[tuple[int, bytes]] = queue.SimpleQueue()
        self._seqs = itertools.count(1)
        self._last_seq = 0
        self._lock = threading.Lock()  # orders post against crash
        self._thread: threading.Thread | None = None
        self._is_closing = False
        self.rank: DecodeRank | None = None
        self.is_ready = False
        self.hold = threading.Event()  # while cleared, steps wait (a stuck rank)
        self.hold.set()
        self.before_step: Callable[[RankCommands], None] | None = None  # runs on the rank's thread
        self.commands: list[RankCommands] = []  # every step's commands, in order

    async def start(self) -> None:
        rank = await asyncio.to_thread(self._form)
        with self._lock:
            self.rank, self.is_ready = rank, True
        self._on_ready_change(True)
        self._thread = threading.Thread(target=self._run, args=(rank,), name=self._name)
        self._thread.start()

    def _form(self) -> DecodeRank:
        rank = self._build()
        rank.warmup()
        return rank

    def post(self, payload: msgspec.Struct) -> int:
        with self._lock:
            seq = self._last_seq = next(self._seqs)
            if self.is_ready:
                self._inbox.put((seq, _encoder.encode(payload)))
                return seq
        lost = UnavailableError("decode rank: the rank group is re-forming after: it was killed")
        self._on_report(Reported(seq, error=lost, is_down=True))
        return seq

    def _run(self, rank: DecodeRank) -> None:
        is_step_due = True  # the first report: the leader learns the rank's load
        while self.rank is rank and not self._is_closing:
            is_idle = not (is_step_due or rank.has_work or rank.seconds_until_due() <= 0)
            posts = self._drain(min(POLL_S, max(rank.seconds_until_due(), 0)) if is_idle else 0)
            if not (posts or is_step_due or rank.has_work or rank.seconds_until_due() <= 0):
                continue
            is_step_due = False
            payload = RankCommands(
                tuple(
                    c
                    for _, p in posts
                    for c in msgspec.msgpack.decode(p, type=RankCommands).commands
                )
            )
            self.commands.append(payload)
            self.hold.wait()
            if self.before_step is not None:
                self.before_step(payload)
            if self.rank is not rank:  # crashed: its posts are reported lost
                return
            through = posts[-1][0] if posts else 0
            try:
                report = rank.execute(payload)
            except Exception as exc:  # as the rank process: its requests end, it goes on
                rank.reset()
                is_step_due = True
                self._on_report(Reported(through, error=StepFailedError(repr(exc))))
                continue
            result = msgspec.msgpack.decode(_encoder.encode(report), type=RankReport)
            self._on_report(Reported(through, result=result))

    def _drain(self, wait_s: float) -> list[tuple[int, bytes]]:
        posts = []
        try:
            posts.append(
                self._inbox.get(timeout=wait_s) if wait_s > 0 else self._inbox.get_nowait()
            )
            while True:
                posts.append(self._inbox.get_nowait())
        except queue.Empty:
            return posts

    def crash(self) -> None:
        """The rank process is gone: its pool with it, posts fail until ``restart``."""
        with self._lock:
            rank, self.rank, self.is_ready = self.rank, None, False
            while not self._inbox.empty():
                self._inbox.get_nowait()
            through = self._last_seq
        self._on_ready_change(False)
        lost = UnavailableError("decode rank: the rank group is re-forming after: it was killed")
        self._on_report(Reported(through, error=lost, is_down=True))
        if rank is not None:
            rank.receiver.close()

    async def restart(self) -> None:
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        await self.start()

    async def aclose(self) -> None:
        self._is_closing = True
        self.hold.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        if self.rank is not None:
            self.rank.receiver.close()
        self.is_ready = False
