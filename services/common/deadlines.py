"""A request's deadline as it travels and as a process waits on it.

On the wire a deadline is wall-clock (``*_unix_ms`` in protos, ``*_unix_s`` in messages between
processes): two hosts share no monotonic clock. Inside a process it is monotonic (``*_mono``),
so a clock step does not move it. Every servicer converts with ``deadline_mono``.
"""

from __future__ import annotations

import time
from collections.abc import Callable


def mono_of_unix_s(deadline_unix_s: float, clock: Callable[[], float] = time.monotonic) -> float:
    """``deadline_unix_s`` (seconds since the Unix epoch) on ``clock``'s monotonic time."""
    return clock() + deadline_unix_s - time.time()


def deadline_mono(
    deadline_unix_ms: int,
    grpc_remaining_s: float | None,
    default_s: float,
    cap_unix_ms: int | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> float:
    """A request's deadline on ``clock``: the earlier of its own wall-clock deadline
    (``deadline_unix_ms``, 0 = none) and its RPC's (``grpc_remaining_s``, None = none),
    ``default_s`` from now (``math.inf``: never) without either, and never past
    ``cap_unix_ms`` (None = no cap)."""
    now_unix = time.time()
    remaining = [] if grpc_remaining_s is None else [grpc_remaining_s]
    if deadline_unix_ms > 0:
        remaining.append(deadline_unix_ms / 1000 - now_unix)
    remaining_s = min(remaining) if remaining else default_s
    if cap_unix_ms is not None:
        remaining_s = min(remaining_s, cap_unix_ms / 1000 - now_unix)
    return clock() + remaining_s
