"""``KvStore``'s bounded calls when the store fails under traffic: the master SIGKILLed or
stopped mid-traffic, the worker holding the pages SIGKILLed. Every call ends within its
bound, and the client works again once the store does.
"""

from __future__ import annotations

import hashlib
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from services.prefill.kv_store import KvStore
from services.prefill.kv_store_calls import (
    KvPagesMissingError,
    KvStoreTimeoutError,
    KvStoreUnavailableError,
)
from services.prefill.kv_store_master import start_master
from tests.prefill.kv_store_peers import (
    NAMESPACE,
    SEGMENT,
    Peer,
    children,
    layout,
    master,
    pages,
    same_bits,
    timed,
)

pytestmark = pytest.mark.slow

SLACK_S = 0.6  # a bounded call may overrun its timeout by thread hand-off, not by a native wait


def traffic(kv: KvStore, keys: list[bytes], k: torch.Tensor, v: torch.Tensor, timeout_s: float):
    """Rounds of exists, get and put on a thread until ``stop``; each call's (op, start,
    seconds, outcome). The thread ends within one call's bound of ``stop``."""
    log: list[tuple[str, float, float, Any]] = []
    stop = threading.Event()
    fresh = iter(range(10**6))

    def run() -> None:
        while not stop.is_set():
            extra = hashlib.sha256(f"fresh/{next(fresh)}".encode()).digest()[:16]
            for op, call in (
                ("exists", lambda: kv.exists(keys, timeout_s)),
                ("get", lambda: kv.get(keys, timeout_s)),
                ("put", lambda extra=extra: kv.put([extra], k[:, :1], v[:, :1], timeout_s)),
            ):
                if stop.is_set():
                    return
                start = time.monotonic()
                elapsed, outcome = timed(call)
                log.append((op, start, elapsed, outcome))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return log, stop, thread


def await_failures(log, since: float, error: type[Exception], limit_s: float = 15) -> None:
    """Until exists, get and put have each failed with ``error`` in a call started after
    ``since`` (at most ``limit_s``)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        ops = {op for op, start, _, out in list(log) if start >= since and isinstance(out, error)}
        if ops == {"exists", "get", "put"}:
            return
        time.sleep(0.1)


def check_after(
    log, since: float, timeout_s: float, error: type[Exception], k: torch.Tensor, v: torch.Tensor
) -> None:
    """Every call that started after ``since`` ended within its bound, with ``error`` (a get
    may instead return the right pages: the client keeps the replica locations of pages it
    just read and reads them without the master), and each of exists, get and put failed
    so at least once."""
    after = [entry for entry in log if entry[1] >= since]
    failed = {op for op, *_, outcome in after if isinstance(outcome, error)}
    assert failed == {"exists", "get", "put"}, after
    for op, _, elapsed, outcome in after:
        assert elapsed <= timeout_s + SLACK_S, (op, elapsed, outcome)
        if op == "get" and not isinstance(outcome, Exception):
            assert same_bits(outcome[0], k) and same_bits(outcome[1], v)
        else:
            assert isinstance(outcome, error), (op, outcome)


def until_ok(call: Callable[[], Any], deadline: float) -> Any:
    """What ``call`` returns once it stops raising, tried every 0.2 s until ``deadline``
    (monotonic); past it, what its last try raised."""
    while True:
        _, outcome = timed(call)
        if not isinstance(outcome, Exception) or time.monotonic() > deadline:
            return outcome
        time.sleep(0.2)


def test_the_master_killed_mid_traffic_ends_every_call_in_bound(tmp_path: Path) -> None:
    lay = layout(torch.float32)
    running = children("mooncake_master")  # another test's master, when it is up
    with master(tmp_path, graceful=False) as (addr, proc):
        port = int(addr.rsplit(":", 1)[1])
        kv = KvStore(addr, NAMESPACE, lay, segment_bytes=SEGMENT)
        keys, k, v = pages(lay, 9, 4)
        assert kv.put(keys, k, v) == [True] * 4
        log, stop, thread = traffic(kv, keys, k, v, timeout_s=1.0)
        time.sleep(0.5)
        before = list(log)
        assert before and all(not isinstance(out, Exception) for *_, out in before)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        killed_at = time.monotonic()
        await_failures(log, killed_at, KvStoreUnavailableError)
        stop.set()
        thread.join(1.0 + SLACK_S + 1.0)
        assert not thread.is_alive()
        check_after(log, killed_at, 1.0, KvStoreUnavailableError, k, v)
        # a master restarted on the same port: the client reconnects by itself, store empty
        restarted = start_master(port, log_path=tmp_path / "restarted.log")
        try:
            deadline = time.monotonic() + 20
            assert until_ok(lambda: kv.exists(keys, 1.0), deadline) == [False] * 4
            # the store has room again once the client has remounted its segment (its ping)
            while kv.put(keys, k, v) != [True] * 4 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert kv.exists(keys) == [True] * 4
            got_k, got_v = kv.get(keys)
            assert same_bits(got_k, k) and same_bits(got_v, v)
            assert kv.close(timeout_s=10)
        finally:
            restarted.kill()
            restarted.wait()
    with pytest.raises(KvStoreUnavailableError, match="closed"):
        kv.exists(keys)
    assert kv.close(timeout_s=1)  # closing twice is fine
    assert children("mooncake_master") == running


def test_a_stopped_master_times_calls_out_and_the_client_recovers(tmp_path: Path) -> None:
    lay = layout(torch.float32)
    with master(tmp_path, graceful=False) as (addr, proc):
        kv = KvStore(addr, NAMESPACE, lay, segment_bytes=SEGMENT)
        keys, k, v = pages(lay, 10, 2)
        assert kv.put(keys, k, v) == [True] * 2
        log, stop, thread = traffic(kv, keys, k, v, timeout_s=0.5)
        time.sleep(0.3)
        proc.send_signal(signal.SIGSTOP)  # accepts TCP, answers nothing: a partition
        stopped_at = time.monotonic()
        try:
            await_failures(log, stopped_at, KvStoreTimeoutError)
            stop.set()
            thread.join(0.5 + SLACK_S + 1.0)
            assert not thread.is_alive()
            check_after(log, stopped_at, 0.5, KvStoreTimeoutError, k, v)
        finally:
            # before close: Mooncake's close holds the GIL ~6 s while the master does not answer
            proc.send_signal(signal.SIGCONT)
        # the abandoned calls return (their RPC timeout) and free their buffers; calls work again
        outcome = until_ok(lambda: kv.get(keys, 1.0), time.monotonic() + 10)
        assert not isinstance(outcome, Exception), outcome
        assert same_bits(outcome[0], k) and same_bits(outcome[1], v)
        assert kv.close(timeout_s=10)


def test_the_worker_holding_pages_killed_fails_gets_not_the_client(tmp_path: Path) -> None:
    lay = layout(torch.float32)
    with master(tmp_path, graceful=False, client_ttl_s=1) as (addr, _):
        holder = Peer(addr, SEGMENT, tmp_path / "holder.log")
        with KvStore(addr, NAMESPACE, lay, segment_bytes=0) as kv:  # every page is the peer's
            assert holder.ask(op="put", dtype="float32", seed=11, n=3) == {"stored": [True] * 3}
            keys, k, v = pages(lay, 11, 3)
            got_k, _ = kv.get(keys)
            assert same_bits(got_k, k)
            holder.proc.kill()
            holder.proc.wait()
            elapsed, outcome = timed(lambda: kv.get(keys, 2.0))
            assert isinstance(outcome, KvStoreUnavailableError) and elapsed < 2.0 + SLACK_S
            assert "TRANSFER_FAIL" in outcome.message
            # the master drops the dead client after client_ttl: its pages are gone
            deadline = time.monotonic() + 15
            while kv.exists(keys) != [False] * 3 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert kv.exists(keys) == [False] * 3
            with pytest.raises(KvPagesMissingError):
                kv.get(keys)
            assert kv.put(keys, k, v) == [False] * 3  # no segment left anywhere: no room
