"""The shared KV store (L3) rows of ``python -m benchmarks.host_tier --kv-store``: for each
prompt length a ``mooncake_master`` on loopback and three store clients in this process, like
three prefill workers: one lends the segment, one writes the prompt's full pages
(``PrefixPages.write_to_store``) and one fetches them into its own device pages
(``CacheMoves.fetch``), checked bit for bit against what the forward wrote."""

from __future__ import annotations

import contextlib
import importlib.metadata
import inspect
import socket
import statistics
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

from benchmarks.host_tier import PAGE_SIZE, _page_keys, _prefill, _prompt, _time_ms
from services.engine.kv_cache import KVPool
from services.engine.model_runner import ModelRunner
from services.prefill.kv_store import MIN_SEGMENT_BYTES, KvStore, PageLayout
from services.prefill.kv_store_master import MASTER_HOST, start_master, stop_master
from services.prefill.messages import CacheMoves
from services.prefill.prefix_pages import PrefixPages
from services.prefill.store_tier import StoreWriter

STORE_NAMESPACE = "benchmarks.host_tier"
# the master evicts once its segments are 90% full (puts then evict pages just put), and its
# allocator may round a value up by 1/8: every round's pages stay under 75% of the segment
SEGMENT_HEADROOM = 1.5
# what a rank leaves KvStore at (rank_step.connect_store): the clients here take all of it but
# the bound of a call, so that a call a rank would give up on is timed and reported
_RANK_DEFAULTS = {name: p.default for name, p in inspect.signature(KvStore).parameters.items()}
RANK_CALL_BOUND_S: float = _RANK_DEFAULTS["timeout_s"]
STORE_CALL_TIMEOUT_S = 300.0
STORE_NOTE = (
    "L3 store rows (`--kv-store`): for each prompt length a `mooncake_master` on loopback, "
    "started as `stageserve up --kv-store-gb` starts it, and three store clients in this "
    "process, built as a prefill rank builds its own (`KvStore`: "
    f"{_RANK_DEFAULTS['protocol']}, staging buffers of {_RANK_DEFAULTS['max_pages_per_call']} "
    f"pages) but waiting up to {STORE_CALL_TIMEOUT_S:g} s per call, not a rank's "
    f"{RANK_CALL_BOUND_S:g} s: one lends the segment (sized for every round's pages), two lend "
    "none, so every page lands in another client's segment and every byte crosses Mooncake's "
    "transport (TCP over loopback), as between prefill workers. Each round computes the prompt "
    "again under new page keys (the store keeps a key's first value); one warm-up round, then "
    "the median of the timed ones. Write is the put: `PrefixPages.write_to_store` of the full "
    "pages (on a GPU a gather on the device, then a copy to pinned host memory on a side "
    "stream) through the rank's `StoreWriter`, until its background thread has put the last "
    "page (each batch of pages copied into the registered staging buffer, then "
    "`batch_put_from`). Fetch: another client's `PrefixPages.apply` of the keys as "
    "`CacheMoves.fetch` (`batch_get_into` the staging buffer per batch, a copy into a CPU "
    "tensor, then into new device pages), to the device's synchronize; the fetched pages equal "
    "the computed ones bit for bit (checked every round). Mooncake moves only host memory "
    "here: the device copies are torch's."
)


def _segment_bytes(layout: PageLayout, num_pages: int, num_rounds: int) -> int:
    """The segment the store's memory client lends: ``num_rounds`` puts of ``num_pages`` pages,
    with the headroom that keeps the master from evicting any of them."""
    need = layout.value_nbytes * num_pages * num_rounds
    return max(MIN_SEGMENT_BYTES, int(need * SEGMENT_HEADROOM))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((MASTER_HOST, 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _store_workers(
    layout: PageLayout, num_segment_bytes: int
) -> Iterator[tuple[StoreWriter, StoreWriter, list[str]]]:
    """A ``mooncake_master`` on loopback and three clients: one lends ``num_segment_bytes``
    (every page lands there), a writer and a reader lend none; the writer's and the reader's
    ``StoreWriter``, and what the background threads failed to write."""
    failures: list[str] = []
    with contextlib.ExitStack() as stack:
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        port = _free_port()
        master = start_master(
            port, host=MASTER_HOST, log_path=logs / "mooncake_master.log", die_with_parent=True
        )
        stack.callback(stop_master, master)

        def worker(num_bytes: int, on_failure: Callable[[str], None]) -> StoreWriter:
            """A rank's store (``rank_step.connect_store``), waiting longer on each call."""
            store = KvStore(
                f"{MASTER_HOST}:{port}",
                STORE_NAMESPACE,
                layout,
                segment_bytes=num_bytes,
                timeout_s=STORE_CALL_TIMEOUT_S,
            )
            writer = StoreWriter(store, on_failure)
            stack.callback(writer.close)
            return writer

        worker(num_segment_bytes, failures.append)  # lends the memory: every page lands there
        yield worker(0, failures.append), worker(0, failures.append), failures


def _put(pages: PrefixPages, writer: StoreWriter, keys: tuple[bytes, ...]) -> None:
    """A rank's put of ``keys``' pages, until the writer's thread has put the last one."""
    pages.write_to_store(keys)
    if not writer.flush(STORE_CALL_TIMEOUT_S):
        raise TimeoutError(
            f"the store write of {len(keys)} pages took over {STORE_CALL_TIMEOUT_S} s"
        )


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _check_fetched(pool: KVPool, computed: Sequence[int], fetched: Sequence[int]) -> int:
    """Assert that pages ``fetched`` hold ``computed``'s K and V bit for bit; pages checked."""
    assert not set(computed) & set(fetched), "the fetch wrote into the computed pages"
    assert len(computed) == len(fetched), (len(computed), len(fetched))
    for name, buf in (("K", pool.k_buffer), ("V", pool.v_buffer)):
        assert _same_bits(buf[:, list(fetched)], buf[:, list(computed)]), (
            f"the KV store changed {name}"
        )
    return len(fetched)


def _store_round(
    runner: ModelRunner,
    pages: tuple[PrefixPages, PrefixPages],
    workers: tuple[StoreWriter, StoreWriter, list[str]],
    ids: list[int],
    keys: tuple[bytes, ...],
) -> tuple[float, float, int]:
    """The prompt computed under ``keys``, put by the writer's pages and fetched by the
    reader's; put ms, fetch ms and the pages checked."""
    on_cuda = runner.device.type == "cuda"
    (ours, theirs), (writer, reader, failures) = pages, workers
    computed = _prefill(runner, ours, ids, keys)
    try:
        put_ms = _time_ms(lambda: _put(ours, writer, keys), on_cuda, 1)
        stored = reader.store.exists(keys)
        if failures or not all(stored):
            raise RuntimeError(
                f"the store kept {sum(stored)} of {len(keys)} pages "
                f"(writer failures: {failures or 'none'})"
            )
        fetch_ms = _time_ms(lambda: theirs.apply(CacheMoves(fetch=keys)), on_cuda, 1)
        theirs.lend("fetched", keys, len(keys) * PAGE_SIZE)
        fetched = runner.page_table.pages("fetched")
        theirs.settle("fetched", keys, (), computed=False)
        return put_ms, fetch_ms, _check_fetched(runner.kv_pool, computed, fetched)
    finally:
        ours.clear()
        theirs.clear()


def measure_store(runner: ModelRunner, num_tokens: int, iters: int) -> dict[str, float]:
    """Put and fetch times (ms) of a ``num_tokens`` prompt's full pages through the shared KV
    store (``_store_workers``), the bytes moved, the segment lent and the pages checked bit
    for bit (every round)."""
    num_full = num_tokens // PAGE_SIZE
    layout = PageLayout.of(runner.kv_pool)
    ids = _prompt(runner, num_tokens)
    num_segment_bytes = _segment_bytes(layout, num_full, iters + 1)
    rounds = []
    with _store_workers(layout, num_segment_bytes) as workers:
        pages = (
            PrefixPages(runner.page_table, runner.kv_pool, store=workers[0]),
            PrefixPages(runner.page_table, runner.kv_pool, store=workers[1]),
        )
        for round_ in range(iters + 1):  # round 0: a warm-up
            keys = _page_keys(round_ * num_full, num_full)
            rounds.append(_store_round(runner, pages, workers, ids, keys))
    return {
        "put_ms": statistics.median(r[0] for r in rounds[1:]),
        "fetch_ms": statistics.median(r[1] for r in rounds[1:]),
        "bytes": layout.value_nbytes * num_full,
        "segment_bytes": num_segment_bytes,
        "checked_pages": sum(r[2] for r in rounds),
    }


def _mooncake_build() -> str:
    for dist in ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return f"{dist} {importlib.metadata.version(dist)}"
    return "mooncake (no distribution found)"


def store_info(lens: list[int], stores: list[dict[str, float]]) -> list[str]:
    segments = ", ".join(f"{s['segment_bytes'] / 1e9:.2f}" for s in stores)
    over = [
        f"{n:,} tokens ({what} {s[f'{what}_ms'] / 1e3:.1f} s)"
        for n, s in zip(lens, stores, strict=True)
        for what in ("put", "fetch")
        if s[f"{what}_ms"] / 1e3 > RANK_CALL_BOUND_S
    ]
    return [
        f"- KV store: {_mooncake_build()}; a master and three clients on loopback (TCP) for "
        f"each length; segment GB lent: {segments}",
        f"- a rank gives up on a store call after {RANK_CALL_BOUND_S:g} s: "
        + (f"over it: {'; '.join(over)}" if over else "every put and fetch here took less"),
    ]
