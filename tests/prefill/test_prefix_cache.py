"""The prefix cache's two halves without a model: the leader's ``PrefixIndex`` (what each
rank holds in device memory and its host tier, LRU eviction, moves, forgetting a failed
plan) and a rank's ``PrefixPages`` on a real ``KVPool`` (every move copies the page's KV
bit for bit). A randomized run drives both the way a plan does and checks after every plan
that each rank holds exactly what the leader says, in the tier it says, with no page lost.
"""

from __future__ import annotations

import random

import pytest
import torch

from services.engine.kv_cache import KVPageManager, KVPool, KVScales, RequestPageTable
from services.prefill.host_tier import num_host_pages
from services.prefill.messages import CacheMoves
from services.prefill.prefix_cache import CacheAsk, PrefixIndex
from services.prefill.prefix_pages import PrefixPages

PAGE = 4


def keys(*names: str) -> tuple[bytes, ...]:
    return tuple(n.encode().ljust(16, b"-") for n in names)


def ask(names: str, num_tokens: int | None = None, **kw) -> CacheAsk:
    """A prompt of ``len(names)`` full pages (plus one token unless ``num_tokens``)."""
    ks = keys(*names)
    return CacheAsk(ks, num_tokens or len(ks) * PAGE + 1, kw.get("read", True), True)


def test_a_prompt_reuses_its_full_pages_but_the_last_tokens() -> None:
    index = PrefixIndex(1, 64, PAGE)
    uses, _ = index.plan([ask("abc")], [0])
    assert uses[0].prefix_keys == () and uses[0].store_keys == keys("a", "b", "c")
    uses, _ = index.plan([ask("abc")], [0])
    assert uses[0].prefix_keys == keys("a", "b", "c")
    # exactly three pages long: the last token sits in page c, which is computed again
    uses, _ = index.plan([ask("abc", num_tokens=3 * PAGE)], [0])
    assert uses[0].prefix_keys == keys("a", "b") and uses[0].store_keys == keys("c")
    uses, _ = index.plan([ask("abd")], [0])  # diverges at the third page
    assert uses[0].prefix_keys == keys("a", "b") and uses[0].store_keys == keys("d")
    uses, _ = index.plan([ask("abc", read=False)], [0])  # prompt logprobs: reads nothing
    assert uses[0].prefix_keys == ()


def test_a_sharded_plan_reuses_only_what_every_rank_holds() -> None:
    index = PrefixIndex(2, 64, PAGE)
    index.plan([ask("ab")], [0])  # rank 0 alone ran it
    assert index.match(keys("a", "b"), [0]) == 2 and index.match(keys("a", "b"), [0, 1]) == 0
    uses, _ = index.plan([ask("abc")], [0, 1])
    assert uses[0].prefix_keys == ()


def test_eviction_is_least_recently_used_and_never_orphans_a_page() -> None:
    index = PrefixIndex(1, 6, PAGE)
    index.plan([ask("ab")], [0])  # a, b
    index.plan([ask("xy")], [0])  # x, y
    index.plan([ask("ab")], [0])  # a and b used again: x, y are the oldest
    _, moves = index.plan([ask("pqr")], [0])  # 4 new pages of 6: two cached must go
    assert set(moves[0].drop) == set(keys("x", "y"))
    assert moves[0].drop.index(keys("y")[0]) < moves[0].drop.index(keys("x")[0])  # child first
    assert index.held(0) == set(keys("a", "b", "p", "q", "r"))


def test_evicted_pages_spill_to_the_host_tier_and_load_back() -> None:
    index = PrefixIndex(1, 6, PAGE, num_host_pages=3)
    index.plan([ask("ab")], [0])
    _, moves = index.plan([ask("pqrst")], [0])  # 6 new pages: a and b spill
    assert moves[0] == CacheMoves((), keys("b", "a"), ())
    assert index.host_held(0) == set(keys("a", "b"))
    assert index.held(0) == set(keys("p", "q", "r", "s", "t"))
    uses, moves = index.plan([ask("abc")], [0])  # a, b come back; 2 + 2 new pages of 6
    assert uses[0].prefix_keys == keys("a", "b") and moves[0].load == keys("a", "b")
    # 2 loaded + 2 computed pages of 6: three of p..t go (the oldest: deepest first), into
    # the host tier the loads left
    assert moves[0].spill == keys("t", "s", "r") and not moves[0].drop
    assert index.host_held(0) == set(keys("t", "s", "r"))
    assert index.held(0) == set(keys("a", "b", "c", "p", "q"))


def test_a_full_host_tier_drops_its_oldest_pages() -> None:
    index = PrefixIndex(1, 4, PAGE, num_host_pages=2)
    index.plan([ask("ab")], [0])
    index.plan([ask("cde")], [0])  # a, b spill
    assert index.host_held(0) == set(keys("a", "b"))
    index.plan([ask("fgh")], [0])  # e, d, c spill; a, b and then e, the oldest, drop
    assert index.host_held(0) == set(keys("d", "c"))
    # d and c are not a prefix of anything asked: the ask for "abf" reuses nothing
    uses, moves = index.plan([ask("abf")], [0])
    assert uses[0].prefix_keys == () and not moves[0].load


def test_a_failed_plan_is_forgotten_and_dropped_by_every_rank_next() -> None:
    index = PrefixIndex(2, 64, PAGE)
    uses, _ = index.plan([ask("ab")], [0, 1])
    index.forget(uses[0].store_keys, [0, 1])
    assert not index.held(0) and not index.held(1)
    _, moves = index.plan([ask("z")], [1])  # rank 1 alone runs it; both drop
    assert set(moves[0].drop) == set(moves[1].drop) == set(keys("a", "b"))


def pool(num_pages: int) -> KVPool:
    return KVPool(2, num_pages, PAGE, 2, 8, torch.float32, "cpu")


def test_host_pages_fit_the_budget() -> None:
    p = pool(8)
    page_bytes = 2 * 2 * PAGE * 2 * 8 * 4
    assert num_host_pages(10 * page_bytes / 1e9, p) == 10
    assert num_host_pages(0.0, p) == 0


def test_spill_and_load_copy_the_kv_bit_for_bit() -> None:
    kv = pool(8)
    torch.manual_seed(0)
    kv.k_buffer.copy_(torch.randn_like(kv.k_buffer))
    kv.v_buffer.copy_(torch.randn_like(kv.v_buffer))
    pages = PrefixPages(RequestPageTable(KVPageManager(8, PAGE)), kv, num_host_pages=4)
    pages.lend("r", (), 3 * PAGE)
    held = pages.table.pages("r")
    k_before, v_before = kv.k_buffer[:, held].clone(), kv.v_buffer[:, held].clone()
    pages.settle("r", (), keys("a", "b", "c"), computed=True)
    pages.apply(CacheMoves(spill=keys("a", "b", "c")))
    assert pages.host_keys() == set(keys("a", "b", "c")) and not pages.keys()
    assert pages.table.manager.num_free_pages == 8
    kv.k_buffer.zero_()
    kv.v_buffer.zero_()
    pages.table.manager.allocate(3)  # the pages it comes back to are other ones
    pages.apply(CacheMoves(load=keys("a", "b", "c")))
    assert not pages.host_keys() and pages.keys() == set(keys("a", "b", "c"))
    pages.lend("s", keys("a", "b", "c"), 3 * PAGE + 1)
    back = pages.table.pages("s")[:3]
    assert set(back).isdisjoint(held)
    assert torch.equal(kv.k_buffer[:, back], k_before)
    assert torch.equal(kv.v_buffer[:, back], v_before)


@pytest.mark.parametrize("host", [0, 12])
def test_ranks_hold_exactly_what_the_index_says(host: int) -> None:
    """Random plans over shared prefixes on two ranks (sharded and solo), some failing: after
    every plan each rank's device and host keys are the index's, and no page is lost."""
    rng = random.Random(host)
    num_pages = 24
    index = PrefixIndex(2, num_pages, PAGE, num_host_pages=host)
    ranks = [
        PrefixPages(RequestPageTable(KVPageManager(num_pages, PAGE)), pool(num_pages), host)
        for _ in range(2)
    ]
    num_loads = 0
    for step in range(400):
        asks = []
        for _ in range(rng.randint(1, 3)):
            stem = rng.choice(["ab", "abc", "ax", "q", "qrs", "abcd", "m", "mn"])
            names = stem + "".join(rng.choice("uvwxyz") for _ in range(rng.randint(0, 3)))
            chained = keys(*(names[: i + 1] for i in range(len(names))))  # as page_keys chain
            extra = rng.choice([0, 1, 3])
            asks.append(CacheAsk(chained, len(names) * PAGE + extra, rng.random() > 0.1, True))
        if sum(-(-a.num_tokens // PAGE) for a in asks) > num_pages:
            continue
        plan_ranks = rng.choice([[0, 1], [0], [1]])
        uses, moves = index.plan(asks, plan_ranks)
        fails = rng.random() < 0.05
        for rank, pages in enumerate(ranks):
            pages.apply(moves[rank])
            num_loads += len(moves[rank].load)
            if rank not in plan_ranks:
                continue
            for i, (a, use) in enumerate(zip(asks, uses, strict=True)):
                pages.lend(f"{step}-{i}", use.prefix_keys, a.num_tokens)
            for i, use in enumerate(uses):
                pages.settle(f"{step}-{i}", use.prefix_keys, use.store_keys, computed=not fails)
        if fails:
            moved = [k for m in moves for k in (*m.spill, *m.load)]
            index.forget([*(k for u in uses for k in u.store_keys), *moved], plan_ranks)
        for rank, pages in enumerate(ranks):
            device, on_host = pages.keys(), pages.host_keys()
            if fails:  # what the failed plan stored is dropped by the next plan
                assert index.held(rank) <= device
            else:
                assert device == index.held(rank) and on_host == index.host_held(rank), step
            assert not device & on_host
            assert len(on_host) <= host
            assert pages.table.manager.num_free_pages == num_pages - len(device)
            assert not len(pages.table)
    if host:
        assert num_loads > 20  # the host tier was used


def test_what_the_shared_store_holds_is_fetched_by_the_ranks_that_lack_it() -> None:
    index = PrefixIndex(2, 64, PAGE, has_store=True)
    index.plan([ask("ab")], [0])  # rank 0 alone computed a, b (and wrote them to the store)
    held = CacheAsk(keys("a", "b", "c", "d"), 4 * PAGE + 1, True, True, in_store=3)
    uses, moves = index.plan([held], [0, 1])
    assert uses[0].prefix_keys == keys("a", "b", "c") and uses[0].store_keys == keys("d")
    assert moves[0].fetch == keys("c") and moves[1].fetch == keys("a", "b", "c")
    assert moves[0].put == keys("d") and not moves[1].put  # one rank writes what it computed
    assert index.held(0) == index.held(1) == set(keys("a", "b", "c", "d"))
    # the store's answer never reaches past the page holding the last token
    last = CacheAsk(keys("x", "y"), 2 * PAGE, True, True, in_store=2)
    uses, moves = index.plan([last], [1])
    assert uses[0].prefix_keys == keys("x") and moves[1].fetch == keys("x")
    assert moves[1].put == ()  # y: the store has it already


def test_no_store_no_fetch_and_no_write() -> None:
    index = PrefixIndex(1, 64, PAGE)
    uses, moves = index.plan([ask("abc")], [0])
    assert not moves[0].fetch and not moves[0].put and uses[0].store_keys == keys("a", "b", "c")


class DictStore:
    """The store's contract over a dict (the real one: tests/prefill/test_kv_store.py)."""

    def __init__(self) -> None:
        self.pages: dict[bytes, tuple[torch.Tensor, torch.Tensor]] = {}
        self.written: list[bytes] = []

    def get(self, ks):
        missing = [k for k in ks if k not in self.pages]
        if missing:
            raise KeyError(f"{len(missing)} pages missing")
        k = torch.stack([self.pages[key][0] for key in ks], dim=1)
        v = torch.stack([self.pages[key][1] for key in ks], dim=1)
        return k, v

    def put_later(self, ks, k, v, **kw) -> None:
        assert not kw, "an event for a copy on a side stream: none on the CPU"
        assert k.device.type == v.device.type == "cpu"
        for i, key in enumerate(ks):
            self.pages[key] = (k[:, i].clone(), v[:, i].clone())
            self.written.append(key)


def test_on_the_cpu_moves_use_no_side_stream() -> None:
    """Every copy is done when the call returns (the GPU's side streams:
    tests/prefill/test_host_tier_gpu.py)."""
    pages = PrefixPages(RequestPageTable(KVPageManager(8, PAGE)), pool(8), 4, DictStore())
    assert pages.host is not None and pages.host.stream is None and pages.store_stream is None


def test_a_page_written_by_one_worker_is_fetched_bit_for_bit_by_another() -> None:
    store = DictStore()
    torch.manual_seed(1)
    first, second = pool(8), pool(8)
    first.k_buffer.copy_(torch.randn_like(first.k_buffer))
    first.v_buffer.copy_(torch.randn_like(first.v_buffer))
    a = PrefixPages(RequestPageTable(KVPageManager(8, PAGE)), first, store=store)
    b = PrefixPages(RequestPageTable(KVPageManager(8, PAGE)), second, store=store)
    a.lend("r", (), 2 * PAGE)
    pages = a.table.pages("r")
    a.settle("r", (), keys("a", "b"), computed=True)
    a.write_to_store(keys("a", "b"))
    assert store.written == list(keys("a", "b"))
    b.apply(CacheMoves(fetch=keys("a", "b")))
    assert b.keys() == set(keys("a", "b"))
    b.lend("s", keys("a", "b"), 2 * PAGE + 1)
    got = b.table.pages("s")[:2]
    assert torch.equal(second.k_buffer[:, got], first.k_buffer[:, pages])
    assert torch.equal(second.v_buffer[:, got], first.v_buffer[:, pages])
    with pytest.raises(KeyError, match="1 pages missing"):  # a failed fetch raises: the step fails
        b.apply(CacheMoves(fetch=keys("z")))


def test_fp8_pages_are_sized_spilled_loaded_and_fetched_as_stored() -> None:
    """An FP8 pool's pages (``--kv-cache-dtype fp8_e4m3``): one byte an element in the host
    tier's budget, and byte for byte through the host tier and the shared store."""
    torch.manual_seed(2)
    first, second = (
        KVPool(2, 8, PAGE, 2, 8, torch.float32, "cpu", scales=KVScales((0.5, 2.0), (1.0, 0.1)))
        for _ in "ab"
    )
    assert num_host_pages(10 * (2 * 2 * PAGE * 2 * 8) / 1e9, first) == 10
    for layer in range(2):
        first.write(layer, torch.arange(8 * PAGE), *torch.randn(2, 8 * PAGE, 2, 8))
    store = DictStore()
    a = PrefixPages(RequestPageTable(KVPageManager(8, PAGE)), first, 4, store)
    b = PrefixPages(RequestPageTable(KVPageManager(8, PAGE)), second, store=store)
    a.lend("r", (), 3 * PAGE)
    held = a.table.pages("r")
    k_before, v_before = first.k_buffer[:, held].clone(), first.v_buffer[:, held].clone()
    a.settle("r", (), keys("a", "b", "c"), computed=True)
    a.write_to_store(keys("a", "b", "c"))
    a.apply(CacheMoves(spill=keys("a", "b", "c")))
    first.k_buffer.view(torch.uint8).zero_()
    first.v_buffer.view(torch.uint8).zero_()
    a.table.manager.allocate(3)  # the pages it comes back to are other ones
    a.apply(CacheMoves(load=keys("a", "b", "c")))
    b.apply(CacheMoves(fetch=keys("a", "b", "c")))
    for pages, pool_ in ((a, first), (b, second)):
        pages.lend("s", keys("a", "b", "c"), 3 * PAGE + 1)
        back = pages.table.pages("s")[:3]
        assert torch.equal(pool_.k_buffer[:, back].view(torch.uint8), k_before.view(torch.uint8))
        assert torch.equal(pool_.v_buffer[:, back].view(torch.uint8), v_before.view(torch.uint8))
