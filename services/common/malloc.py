"""glibc malloc settings for a service process: large buffers reuse freed memory.

A request's image is a few megabytes that several buffers hold in turn (the base64 text,
the decoded bytes, the protobuf message, its serialization). glibc serves such sizes with
fresh ``mmap`` pages and gives them back at ``free``, or trims them off the heap's top, so
every request pays the page faults again; keeping freed memory in the process removes them
(measurements: ``docs/benchmarks.md``, "Measurements cited by the code").

``tune_malloc`` therefore raises the mmap threshold to glibc's maximum (32 MiB: smaller
blocks come from the heap) and the trim threshold to 256 MiB (free memory up to that stays
mapped). An operator who sets either through ``GLIBC_TUNABLES`` keeps theirs: then this
changes nothing. Off glibc (no ``mallopt``) it does nothing either.

The trim threshold also keeps what one large request freed: a body near the router's 32 MB
limit passes through several copies (body, parsed text, protobuf message, worker job) in the
router and the tokenizer, spread over malloc's per-thread arenas, and none of it went back.
``MemoryReleaser`` therefore, ``RELEASE_DELAY_S`` after the last request of at least
``LARGE_REQUEST_BYTES`` finished, collects garbage on a worker thread (a refused request's
frames, and the buffers they hold, sit in a reference cycle with its exception) and runs
``malloc_trim(0)`` (every arena, free pages inside a heap too): image-sized requests keep their
reused memory, large ones hand theirs back, and concurrent large requests share one trim.

``malloc_trim`` shrinks the main arena's top but never the top of a per-thread arena, and a
per-thread arena shrinks its own top at ``free`` only past the trim threshold, which at 256 MiB
is beyond a thread heap's 64 MiB: a process whose gRPC and executor threads each took an arena
kept up to 64 MiB per arena after every trim. The processes that release memory (the router
and the tokenizer) therefore pass ``single_arena=True``: every thread allocates from the main
arena, and one ``malloc_trim`` reaches all of it.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import gc
import logging
import threading

from services.common.envs import Envs

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8  # mallopt parameters (malloc.h)
MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's HEAP_MAX_SIZE / 2 on 64-bit, the largest it accepts
TRIM_THRESHOLD = 256 * 1024 * 1024
TUNABLE_KEYS = ("glibc.malloc.mmap_threshold", "glibc.malloc.trim_threshold")
ARENA_TUNABLE_KEY = "glibc.malloc.arena_max"
LARGE_REQUEST_BYTES = 8 * 1024 * 1024
RELEASE_DELAY_S = 0.2


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def tune_malloc(envs: Envs, *, single_arena: bool = False) -> bool:
    """Apply the thresholds above, and with ``single_arena`` one arena for every thread (call it
    before the process starts threads); True when they were set, False when left as they are."""
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:  # not glibc
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    if single_arena and ARENA_TUNABLE_KEY not in envs.glibc_tunables:
        if mallopt(M_ARENA_MAX, 1) != 1:
            logger.warning("mallopt refused one malloc arena; threads keep their own")
    if any(key in envs.glibc_tunables for key in TUNABLE_KEYS):
        logger.debug("GLIBC_TUNABLES sets malloc thresholds: left as they are")
        return False
    applied = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    applied = mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and applied
    if not applied:
        logger.warning("mallopt refused the malloc thresholds; large buffers fault in per request")
    return applied


def release_free_memory() -> bool:
    """Give the process's free heap memory back to the OS (glibc ``malloc_trim(0)``); True when
    some was released. Blocks while it walks the heap: call it off the event loop."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is None:
        return False
    trim.argtypes, trim.restype = (ctypes.c_size_t,), ctypes.c_int
    return trim(0) == 1


class MemoryReleaser:
    """Calls ``release_free_memory`` on a worker thread once no large request has finished for
    ``delay_s``. ``request_done`` is called on the event loop with each request's input size."""

    def __init__(
        self, min_request_bytes: int = LARGE_REQUEST_BYTES, delay_s: float = RELEASE_DELAY_S
    ) -> None:
        self.min_request_bytes = min_request_bytes
        self.delay_s = delay_s
        self.num_releases = 0
        self._timer: asyncio.TimerHandle | None = None
        self._lock = threading.Lock()

    def request_done(self, num_bytes: int) -> None:
        if num_bytes < self.min_request_bytes:
            return
        loop = asyncio.get_running_loop()
        if self._timer is not None:
            self._timer.cancel()
        self._timer = loop.call_later(self.delay_s, self._release_soon, loop)

    def _release_soon(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        loop.run_in_executor(None, self._release)

    def _release(self) -> None:
        with self._lock:  # one trim at a time; a second one right after finds little
            gc.collect()  # a refused request's frames sit in a cycle with its exception
            release_free_memory()
            self.num_releases += 1
