"""CPU work on a large buffer, off the event loop.

Decoding, copying, serializing or hashing tens of megabytes holds an event loop for tens of
milliseconds; a burst of such requests holds it for seconds, in which the process answers no
health check (and its supervisor restarts it for that). ``sized`` runs such work on a thread
once its input is over ``INLINE_MAX_BYTES``, so the loop keeps running between the thread's
steps: a C call that keeps the GIL (msgspec's decode, protobuf's serialization) holds the loop
for that one call only, and one that releases it (``bytes.join`` of a large buffer, hashing)
not at all.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

INLINE_MAX_BYTES = 1024 * 1024  # up to this, a thread hop costs more than the work it moves
# One thread: most of this work keeps the GIL, so a second thread would add no throughput, only
# another thread for the loop to wait behind.
_executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="offload")

P = ParamSpec("P")
T = TypeVar("T")


async def sized(num_bytes: int, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """``fn(*args, **kwargs)``: on a thread when ``num_bytes`` (its input) is over
    ``INLINE_MAX_BYTES``, on the loop otherwise."""
    if num_bytes > INLINE_MAX_BYTES:
        call = functools.partial(fn, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(_executor, call)
    return fn(*args, **kwargs)
