"""The workers a router knows about and their state."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


class WorkerKind(enum.Enum):
    TOKENIZER = "tokenizer"
    PREFILL = "prefill"
    DECODE = "decode"
    ENCODER = "vision_encoder"  # polled for health only; prefill calls it itself


class WorkerState(enum.Enum):
    UNKNOWN = "unknown"  # not polled yet
    READY = "ready"  # its last health check said SERVING
    NOT_READY = "not_ready"  # its last health check failed or said NOT_SERVING


@dataclass(eq=False)
class Worker:
    """One worker process. ``client`` is its typed client (None for kinds the router never calls)."""

    kind: WorkerKind
    address: str
    client: Any = None
    state: WorkerState = WorkerState.UNKNOWN
    num_in_flight: int = 0  # requests this router routed here and not finished
    last_error: str = ""  # why the last health check failed

    @property
    def is_ready(self) -> bool:
        return self.state is WorkerState.READY
