"""The store tier's two halves around any store: the leader's bounded lookup (leading keys,
0 when the store fails or is slow) and a rank's background writer (never blocks the caller;
waits for a GPU copy's event before reading its pages; failures counted); and the scheduler holding a request until its lookup answered, and
running a batch that read the store again without it."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from services.common.errors import StageServeError
from services.common.types import SamplingParams
from services.prefill.request import PrefillInput, PrefillStatus
from services.prefill.scheduler import PrefillScheduler
from services.prefill.store_tier import MAX_PENDING_WRITES, StoreLookup, StoreWriter
from services.transfer.embeddings import EmbeddingRowManager


class Store:
    def __init__(self, held=(), fail: bool = False, delay_s: float = 0.0) -> None:
        self.held, self.fail, self.delay_s = set(held), fail, delay_s
        self.puts: list[list[bytes]] = []
        self.release = threading.Event()
        self.release.set()

    def exists(self, keys):
        time.sleep(self.delay_s)
        if self.fail:
            raise RuntimeError("master unreachable")
        return [k in self.held for k in keys]

    def get(self, keys):
        raise AssertionError("not used here")

    def put(self, keys, k, v) -> None:
        self.release.wait()
        if self.fail:
            raise RuntimeError("master unreachable")
        self.puts.append(list(keys))

    def close(self) -> None:
        self.closed = True


async def test_the_lookup_counts_leading_keys_and_is_zero_when_the_store_fails() -> None:
    failures: list[str] = []
    keys = [b"a", b"b", b"c", b"d"]
    held = Store({b"a", b"b", b"d"})
    assert await StoreLookup(lambda: held, 1.0, failures.append).leading(keys) == 2
    assert await StoreLookup(lambda: Store(fail=True), 1.0, failures.append).leading(keys) == 0
    slow = StoreLookup(lambda: Store({b"a"}, delay_s=0.5), 0.05, failures.append)
    assert await slow.leading(keys) == 0  # not within its bound: skipped
    assert failures == ["lookup", "lookup"]


async def test_after_a_failed_lookup_the_store_is_skipped_for_a_while() -> None:
    failures: list[str] = []
    store = Store({b"a"}, delay_s=0.3)
    lookup = StoreLookup(lambda: store, 0.05, failures.append, retry_s=0.5)
    assert await lookup.leading([b"a"]) == 0 and failures == ["lookup"]
    store.delay_s = 0.0
    started = time.monotonic()
    for _ in range(5):  # answered at once, without asking: the store just failed
        assert await lookup.leading([b"a"]) == 0
    assert failures == ["lookup"]
    time.sleep(max(0.0, 0.55 - (time.monotonic() - started)))
    assert await lookup.leading([b"a"]) == 1  # asked again after the pause


async def test_the_lookup_connects_at_first_and_again_after_a_pause() -> None:
    tries: list[int] = []

    def connect() -> Store:
        tries.append(1)
        if len(tries) == 1:
            raise ConnectionError("master not up yet")
        return Store({b"a"})

    lookup = StoreLookup(connect, 1.0, retry_s=0.2)
    assert await lookup.leading([b"a"]) == 0 and len(tries) == 1
    assert await lookup.leading([b"a"]) == 0 and len(tries) == 1  # not before retry_s
    time.sleep(0.25)
    assert await lookup.leading([b"a", b"b"]) == 1 and len(tries) == 2
    assert await lookup.leading([b"a"]) == 1 and len(tries) == 2  # connected once


def test_writes_go_in_the_background_and_failures_are_counted() -> None:
    failures: list[str] = []
    store = Store()
    store.release.clear()  # the store hangs on every put
    writer = StoreWriter(store, failures.append)
    page = torch.zeros(1, 1, 4, 1, 2)
    for i in range(MAX_PENDING_WRITES + 2):  # the caller never waits on the store
        writer.put_later([bytes([i])], page, page)
    assert failures.count("write") >= 1  # past the queue's bound: dropped, counted
    store.release.set()
    assert writer.flush(10.0)
    assert len(store.puts) >= MAX_PENDING_WRITES
    store.fail = True
    writer.put_later([b"x"], page, page)
    assert writer.flush(10.0)
    assert failures[-1] == "write"
    writer.close()


class CopyEvent:
    """A GPU copy's event as the writer sees it: ``synchronize`` returns once it landed."""

    def __init__(self) -> None:
        self.landed = threading.Event()
        self.waited = threading.Event()

    def synchronize(self) -> None:
        self.waited.set()
        assert self.landed.wait(10.0)


def test_the_writer_reads_a_page_only_after_its_copy_landed() -> None:
    store = Store()
    writer = StoreWriter(store)
    copy = CopyEvent()
    page = torch.zeros(1, 1, 4, 1, 2)
    started = time.monotonic()
    writer.put_later([b"x"], page, page, ready=copy)
    assert time.monotonic() - started < 1.0  # the caller never waits on the copy
    assert copy.waited.wait(10.0)
    time.sleep(0.05)
    assert store.puts == []  # the writer waits for the copy, not the caller
    copy.landed.set()
    writer.put_later([b"y"], page, page)  # no event (the CPU): written as it is
    assert writer.flush(10.0)
    assert store.puts == [[b"x"], [b"y"]]
    writer.close()


def request(request_id: str) -> PrefillInput:
    return PrefillInput(
        request_id,
        tuple(range(40)),
        (),
        SamplingParams(),
        kv_dst=None,  # type: ignore[arg-type]
        deadline_mono=time.monotonic() + 60,
        page_keys=tuple(bytes([i]) * 16 for i in range(10)),
    )


def test_a_request_waits_for_its_lookup_and_a_failed_store_batch_runs_again() -> None:
    scheduler = PrefillScheduler(EmbeddingRowManager(64), 64, 4, 1024)
    entry = scheduler.add(request("r"), {})
    entry.is_store_pending = True
    scheduler.admit()
    assert scheduler.schedule() is None  # READY, but the store has not answered
    entry.in_store, entry.is_store_pending = 6, False
    plan = scheduler.schedule()
    assert plan is not None and plan.requests[0].in_store == 6
    scheduler.retry_without_store(plan)
    assert entry.status is PrefillStatus.READY and entry.skips_store and entry.in_store == 0
    again = scheduler.schedule()
    assert again is not None and again.requests[0].in_store == 0
    outcomes = scheduler.fail_plan(again, StageServeError("then it fails for real"))
    assert [o.request_id for o in outcomes] == ["r"] and not scheduler.num_live


def test_an_aborted_request_is_not_run_again() -> None:
    scheduler = PrefillScheduler(EmbeddingRowManager(64), 64, 4, 1024)
    scheduler.add(request("r"), {})
    scheduler.admit()
    plan = scheduler.schedule()
    scheduler.abort("r", StageServeError("caller gone"))
    scheduler.retry_without_store(plan)
    assert not scheduler.num_live and scheduler.schedule() is None


def test_the_store_settings_are_checked_before_any_rank_starts() -> None:
    from services.prefill.app import store_init
    from tests.prefill.conftest import prefill_config

    assert store_init(prefill_config()) == {}
    init = store_init(prefill_config(kv_store_master="10.0.0.5:50051", kv_store_segment_gb=1))
    name, _, digest = init["kv_store_namespace"].rpartition("@")
    assert init["kv_store_segment_bytes"] == 10**9 and name and len(digest) == 16
    for bad, message in (
        (dict(kv_store_master="nohost"), "HOST:PORT"),
        (dict(kv_store_master="h:1", kv_store_segment_gb=0.001), "0 or at least"),
        (dict(kv_store_master="h:1", disable_prefix_cache=True), "not with --disable-prefix"),
    ):
        with pytest.raises(ValueError, match=message):
            store_init(prefill_config(**bad))
