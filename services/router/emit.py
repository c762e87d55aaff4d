"""The producer's end of a request's delta queue (``GenerationPipeline``).

``TerminalEmit`` lets exactly one terminal item through (an error or the finished delta);
``TimedEmit`` records, before each delta goes out, when its tokens arrived.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from services.common.errors import StageServeError
from services.router.metrics import RequestStats
from services.router.types import GenerationDelta

Emit = Callable[["GenerationDelta | StageServeError"], None]


class TerminalEmit:
    """Forwards items until the first terminal one (an error or a finished delta)."""

    def __init__(self, emit: Emit) -> None:
        self._emit = emit
        self.is_done = False

    def emit(self, item: GenerationDelta | StageServeError) -> None:
        if self.is_done:
            return
        self.is_done = isinstance(item, StageServeError) or item.finish_reason is not None
        self._emit(item)


class TimedEmit:
    """Emits deltas and records when their tokens arrived (``RequestStats``)."""

    def __init__(self, emit: Emit, stats: RequestStats, max_tokens: int | None) -> None:
        self._emit = emit
        self.stats = stats
        self._max_tokens = max_tokens

    def __call__(self, delta: GenerationDelta) -> None:
        self.stats.tokens(len(delta.token_ids), time.perf_counter())
        if delta.finish_reason is not None:
            self.stats.finish(delta, self._max_tokens)
        self._emit(delta)
