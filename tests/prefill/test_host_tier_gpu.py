"""GPU (device tool): the prefix cache's copies to host memory run beside the step's stream
(issue 38: tier moves never block a step) and stay ordered with what the step queues around
them (``HostTier``'s class docstring has the rules).

Each test holds one stream back on purpose (``torch.cuda._sleep``: the tier's or the store's
side stream, or the step's), so a missing order gives wrong pages every run rather than in a
rare race: a spill's copy that read its pages after the forward-like write queued behind it,
a load that read a slot before the copy into it landed, a spill's copy into a slot a load
still had to read. "Forward-like": writes queued on the current stream right after the move
returns, over the pages it freed and over new allocations of the gathered tensor's size (the
caching allocator hands that memory out again first, unless the side copy still holds it).
"""

from __future__ import annotations

import functools
import time

import pytest
import torch

from services.engine.kv_cache import KVPageManager, KVPool, RequestPageTable
from services.prefill.messages import CacheMoves
from services.prefill.prefix_pages import PrefixPages
from services.prefill.store_tier import StoreWriter

pytestmark = pytest.mark.gpu

PAGE, LAYERS, HEADS, DIM = 16, 4, 8, 128
NUM_PAGES = 96
N = 24  # pages a move carries
DELAY_S = 0.5  # how long a held stream sleeps: far longer than anything the test queues
GARBAGE = 7.0


@functools.cache
def _cycles_per_s() -> float:
    """``torch.cuda._sleep`` spins this many GPU clock cycles a second."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)  # warm
    start.record()
    torch.cuda._sleep(100_000_000)
    end.record()
    end.synchronize()
    return 100_000_000 / (start.elapsed_time(end) / 1e3)


def hold(stream: torch.cuda.Stream, seconds: float = DELAY_S) -> None:
    """``stream`` runs nothing queued after this for ``seconds``."""
    cycles = int(seconds * _cycles_per_s())
    with torch.cuda.stream(stream):
        torch.cuda._sleep(cycles)


def done(stream: torch.cuda.Stream) -> bool:
    """Whether ``stream`` ran everything queued on it so far."""
    event = torch.cuda.Event()
    event.record(stream)
    return event.query()


def step_stream_runs_ahead(side: torch.cuda.Stream) -> None:
    """What the current stream has queued finishes while ``side`` (held) has not: the step's
    stream does not wait for the side copy."""
    marker = torch.cuda.Event()
    marker.record()
    marker.synchronize()
    assert not done(side), "the step's stream waited for the copy to host memory"


def rank_pages(host: int = NUM_PAGES, store: object | None = None) -> PrefixPages:
    kv = KVPool(LAYERS, NUM_PAGES, PAGE, HEADS, DIM, torch.bfloat16, "cuda")
    return PrefixPages(RequestPageTable(KVPageManager(NUM_PAGES, PAGE)), kv, host, store)  # type: ignore[arg-type]


def cache(
    pages: PrefixPages, tag: str, n: int = N
) -> tuple[tuple[bytes, ...], list[int], torch.Tensor, torch.Tensor]:
    """``n`` cached pages of fresh random KV under keys ``tag``0...: keys, device pages and
    a copy of K and V."""
    ks = tuple(f"{tag}{i}".encode().ljust(16, b"-") for i in range(n))
    pages.lend(tag, (), n * PAGE)
    held = pages.table.pages(tag)
    pool = pages.pool
    pool.k_buffer[:, held] = torch.randn_like(pool.k_buffer[:, held])
    pool.v_buffer[:, held] = torch.randn_like(pool.v_buffer[:, held])
    pages.settle(tag, (), ks, computed=True)
    return ks, held, pool.k_buffer[:, held].clone(), pool.v_buffer[:, held].clone()


def overwrite(pages: PrefixPages, freed: list[int], n: int = N) -> list[torch.Tensor]:
    """A forward's writes queued right after a move: over the pages it freed and over new
    tensors of the sizes a move of ``n`` pages gathers (kept alive until the test's end)."""
    pool = pages.pool
    if freed:
        pool.k_buffer[:, freed] = GARBAGE
        pool.v_buffer[:, freed] = GARBAGE
    shape = (LAYERS, n, PAGE, HEADS, DIM)
    page_major = (n, 2, LAYERS, PAGE, HEADS, DIM)
    return [
        torch.full(s, GARBAGE, dtype=pool.dtype, device=pool.device)
        for s in (page_major, page_major, shape, shape, shape, shape)
    ]


def assert_held(
    pages: PrefixPages, ks: tuple[bytes, ...], k: torch.Tensor, v: torch.Tensor
) -> None:
    """``pages`` holds ``ks`` in device pages, their KV bit for bit ``k`` and ``v``."""
    torch.cuda.synchronize()
    assert pages.keys() >= set(ks)
    back = [pages._pages[key] for key in ks]  # noqa: SLF001
    assert torch.equal(pages.pool.k_buffer[:, back], k), "K changed on its way"
    assert torch.equal(pages.pool.v_buffer[:, back], v), "V changed on its way"


def warm(pages: PrefixPages, n: int = N) -> None:
    """One spill and load of ``n`` pages: the caching allocators (device and pinned) hold
    blocks of the sizes the test moves, so no allocation in it waits on the device."""
    ks, _, k, v = cache(pages, "warm", n)
    pages.apply(CacheMoves(spill=ks))
    pages.apply(CacheMoves(load=ks))
    assert_held(pages, ks, k, v)
    pages.drop(ks)
    torch.cuda.synchronize()


def test_a_spill_leaves_the_step_stream_and_its_pages_free_at_once() -> None:
    pages = rank_pages()
    warm(pages)
    ks, held, k, v = cache(pages, "a")
    torch.cuda.synchronize()
    assert pages.host is not None and pages.host.stream is not None
    hold(pages.host.stream)
    pages.apply(CacheMoves(spill=ks))
    assert pages.host_keys() == set(ks) and not pages.keys()
    junk = overwrite(pages, held)  # the forward, queued at once
    step_stream_runs_ahead(pages.host.stream)  # ... and run before the copy did
    pages.apply(CacheMoves(load=ks))  # waits for the copy into its slots
    assert_held(pages, ks, k, v)
    del junk


def test_a_load_right_after_the_spill_of_its_keys_waits_for_the_copy() -> None:
    pages = rank_pages()
    warm(pages)
    ks, _, k, v = cache(pages, "a")
    torch.cuda.synchronize()
    assert pages.host is not None and pages.host.stream is not None
    hold(pages.host.stream)
    pages.apply(CacheMoves(spill=ks))
    assert not done(pages.host.stream)  # its copy has not run yet
    pages.apply(CacheMoves(load=ks))
    junk = overwrite(pages, [])
    assert_held(pages, ks, k, v)
    del junk


def test_a_load_waits_only_for_copies_into_its_own_slots() -> None:
    pages = rank_pages()
    warm(pages)
    a, _, k_a, v_a = cache(pages, "a")
    b, _, k_b, v_b = cache(pages, "b")
    pages.apply(CacheMoves(spill=a))
    torch.cuda.synchronize()  # a's copy landed
    assert pages.host is not None and pages.host.stream is not None
    hold(pages.host.stream)
    pages.apply(CacheMoves(spill=b))  # b's copy waits behind the held side stream
    pages.apply(CacheMoves(load=a))
    step_stream_runs_ahead(pages.host.stream)  # a's load did not wait for b's copy
    pages.apply(CacheMoves(load=b))
    assert_held(pages, a, k_a, v_a)
    assert_held(pages, b, k_b, v_b)


def test_a_spill_into_slots_a_load_just_freed_waits_for_the_load() -> None:
    """On the tier itself: ``take`` and ``store`` upload nothing, so no call here can wait for
    the held step stream, and the side copy is queued while the load has not run."""
    pages = rank_pages(host=N)  # one move fills the tier: b gets the slots a's load frees
    warm(pages)
    host, device = pages.host, pages.pool.device
    assert host is not None
    a, _, k_a, v_a = cache(pages, "a")
    pages.apply(CacheMoves(spill=a))
    b = tuple(f"b{i}".encode().ljust(16, b"-") for i in range(N))
    k_b, v_b = torch.randn_like(k_a), torch.randn_like(v_a)
    torch.cuda.synchronize()
    step = torch.cuda.current_stream()
    hold(step)  # the load's copy out of the slots runs late
    k_got, v_got = host.take(a, device)
    host.store(b, k_b, v_b)
    assert set(host.slots.values()) == set(range(N))  # a's slots
    assert not done(step)  # the load has not read them yet; b's copy is queued
    torch.cuda.synchronize()
    assert torch.equal(k_got, k_a) and torch.equal(v_got, v_a), "b's copy landed first"
    k_back, v_back = host.take(b, device)
    torch.cuda.synchronize()
    assert torch.equal(k_back, k_b) and torch.equal(v_back, v_b)


def test_a_slot_dropped_while_its_copy_runs_takes_the_next_spill_after_it() -> None:
    pages = rank_pages(host=N)
    warm(pages)
    a, _, _, _ = cache(pages, "a")
    torch.cuda.synchronize()
    assert pages.host is not None and pages.host.stream is not None
    hold(pages.host.stream)
    pages.apply(CacheMoves(spill=a))
    slots = set(pages.host.slots.values())
    pages.apply(CacheMoves(drop=a))  # a's copy still waits to run
    b, _, k_b, v_b = cache(pages, "b")
    pages.apply(CacheMoves(spill=b))
    assert set(pages.host.slots.values()) == slots  # the same slots, after a's copy
    pages.apply(CacheMoves(load=b))
    assert_held(pages, b, k_b, v_b)


class CapturingStore:
    """The store behind a ``StoreWriter``: keeps a copy of what each put read."""

    def __init__(self) -> None:
        self.puts: list[tuple[list[bytes], torch.Tensor, torch.Tensor, bool]] = []

    def put(self, keys, k, v) -> list[bool]:
        pinned = k.is_pinned() and v.is_pinned()
        self.puts.append((list(keys), k.clone(), v.clone(), pinned))
        return [True] * len(keys)

    def get(self, keys):
        raise AssertionError("not used here")

    def exists(self, keys):
        raise AssertionError("not used here")

    def close(self) -> None:
        pass


def test_a_store_write_returns_at_once_and_its_pages_may_be_overwritten() -> None:
    store = CapturingStore()
    writer = StoreWriter(store)
    pages = rank_pages(host=0, store=writer)
    assert pages.store_stream is not None
    ks, held, k, v = cache(pages, "w")
    pages.write_to_store(ks)  # warm: pinned buffers of this size in the allocator's cache
    assert writer.flush(10.0)
    store.puts.clear()
    torch.cuda.synchronize()
    hold(pages.store_stream)
    started = time.perf_counter()
    pages.write_to_store(ks)
    returned_s = time.perf_counter() - started
    junk = overwrite(pages, held)  # the next forward, queued before the copy ran
    step_stream_runs_ahead(pages.store_stream)
    assert returned_s < DELAY_S / 2, "the rank's thread waited for the copy"
    assert store.puts == []  # the writer waits for the copy's event
    assert writer.flush(10.0)
    [(keys, k_put, v_put, pinned)] = store.puts
    assert keys == list(ks) and pinned
    assert torch.equal(k_put, k.cpu()) and torch.equal(v_put, v.cpu())
    writer.close()
    del junk
