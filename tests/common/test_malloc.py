"""services.common.malloc: the thresholds are set in a fresh process (so that a large buffer
built and freed per request stops faulting its pages in again), and left alone when the
operator's GLIBC_TUNABLES sets them."""

from __future__ import annotations

import subprocess
import sys

from services.common.envs import Envs
from services.common.malloc import MemoryReleaser, tune_malloc

# Builds and frees a 2 MB buffer 20 times (base64 text -> bytes, as the router does with an
# image); prints whether the thresholds were set and the page faults per round after the first.
PROBE = """
import base64, os, resource, sys
from services.common.envs import Envs
from services.common.malloc import MemoryReleaser, tune_malloc
applied = tune_malloc(Envs.from_environ())
text = base64.b64encode(os.urandom(2_000_000))
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
data = bytearray(base64.b64decode(text)); del data
before = faults()
for _ in range(20):
    data = bytearray(base64.b64decode(text)); data[::4096] = b"x" * len(data[::4096]); del data
print(applied, (faults() - before) / 20)
"""


def _probe(env: dict[str, str]) -> tuple[bool, float]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, env=env
    ).stdout.split()
    return out[0] == "True", float(out[1])


def test_freed_large_buffers_are_reused_without_page_faults() -> None:
    import os

    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    applied, faults = _probe(env)
    assert applied and faults < 50  # 2 MB is ~490 pages: reused memory faults none of them
    # glibc's own thresholds set by the operator: nothing changes
    kept, faults = _probe({**env, "GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"})
    assert not kept and faults > 400


def test_an_operator_setting_is_kept() -> None:
    assert not tune_malloc(Envs(glibc_tunables="glibc.malloc.mmap_threshold=131072"))


# Frees 160 MB of 4 MB buffers (kept by the 256 MiB trim threshold), then releases it.
RELEASE_PROBE = """
from services.common.envs import Envs
from services.common.malloc import release_free_memory, tune_malloc
assert tune_malloc(Envs())
def rss_mb():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
buffers = [bytearray(4 * 2**20) for _ in range(40)]
del buffers
kept = rss_mb()
released = release_free_memory()
print(released, kept - rss_mb())
"""


def test_release_gives_freed_heap_memory_back() -> None:
    import os

    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    out = subprocess.run(
        [sys.executable, "-c", RELEASE_PROBE], capture_output=True, text=True, check=True, env=env
    ).stdout.split()
    assert out[0] == "True" and float(out[1]) > 100, out


async def test_the_releaser_trims_once_after_a_burst_of_large_requests() -> None:
    import asyncio

    releaser = MemoryReleaser(min_request_bytes=1000, delay_s=0.05)
    releaser.request_done(999)  # small: nothing scheduled
    for _ in range(5):
        releaser.request_done(1000)
    for _ in range(200):
        if releaser.num_releases:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.1)
    assert releaser.num_releases == 1


# Four threads each build and free 48 MB of 1 MB buffers, then the main thread releases.
THREADS_PROBE = """
import sys, threading
from services.common.envs import Envs
from services.common.malloc import release_free_memory, tune_malloc
assert tune_malloc(Envs(), single_arena=sys.argv[1] == "single")
def rss_mb():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
before = rss_mb()
def churn():
    buffers = [bytearray(2**20) for _ in range(48)]
    del buffers
threads = [threading.Thread(target=churn) for _ in range(4)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
release_free_memory()
print(rss_mb() - before)
"""


def _held_after_threads(mode: str) -> float:
    import os

    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    return float(
        subprocess.run(
            [sys.executable, "-c", THREADS_PROBE, mode],
            capture_output=True,
            text=True,
            check=True,
            env=env,
        ).stdout
    )


def test_one_arena_lets_a_release_reach_memory_other_threads_freed() -> None:
    # per-thread arenas keep their tops (up to a 64 MiB heap each) past malloc_trim
    assert _held_after_threads("per-thread") > 100
    assert _held_after_threads("single") < 30
