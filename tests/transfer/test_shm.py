"""The shm transfer backend: decode's KV pool and prefill's embedding buffer in /dev/shm,
written by a peer that knows only the destination."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import msgspec
import pytest
import torch

from services.common.destinations import EmbeddingDestination, KvDestination
from services.common.errors import DeadlineExceededError, InvalidRequestError, UnavailableError
from services.engine.kv_cache import KVPool
from services.transfer.embeddings import EmbeddingBuffer
from services.transfer.embeddings_shm import ShmEmbeddingReceiver, ShmEmbeddingSender
from services.transfer.shm_backend import ShmKVReceiver, ShmKVSender
from services.transfer.shm_memory import ShmPeers, ShmSegment, decode_session_id
from tests.transfer.shm_helpers import (
    DST_PAGES,
    HIDDEN,
    ROW_RUNS,
    SRC_PAGES,
    WAIT_S,
    fill,
    make_pool,
    pages_landed,
    rows_landed,
    same,
    segment_path,
    source_rows,
)

# --- two processes: the peer knows only the destination ------------------------------


def sender_main(kv_dst: bytes, emb_dst: bytes, dtype_name: str, results) -> None:
    dtype = getattr(torch, dtype_name)
    kv_sender, emb_sender = ShmKVSender(), ShmEmbeddingSender()
    deadline_mono = time.monotonic() + WAIT_S
    kv = kv_sender.send(
        "req-1",
        make_pool(32, dtype, seed=1),
        SRC_PAGES,
        msgspec.msgpack.decode(kv_dst, type=KvDestination),
        deadline_mono,
    )
    emb = emb_sender.send_runs(
        "req-1",
        source_rows(dtype, seed=3),
        ROW_RUNS,
        msgspec.msgpack.decode(emb_dst, type=EmbeddingDestination),
        deadline_mono,
    )
    results.put((kv.num_descriptors, kv.num_bytes, emb.num_descriptors, emb.num_bytes))


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_another_process_writes_kv_pages_and_rows_byte_exact(dtype) -> None:
    kv_receiver, emb_receiver = ShmKVReceiver(), ShmEmbeddingReceiver()
    pool, buffer = make_pool(64, dtype, seed=10), EmbeddingBuffer(64, HIDDEN, dtype)
    fill(buffer.tensor, seed=11)
    before_kv, before_rows = (pool.k_buffer.clone(), pool.v_buffer.clone()), buffer.tensor.clone()
    try:
        kv_receiver.register(pool)
        emb_receiver.register(buffer)
        assert same(pool.k_buffer, before_kv[0]) and same(
            buffer.tensor, before_rows
        )  # kept by the move
        kv_dst = msgspec.msgpack.encode(kv_receiver.destination("req-1", DST_PAGES))
        emb_dst = msgspec.msgpack.encode(emb_receiver.destination("req-1", 30, 30))
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        dtype_name = str(dtype).removeprefix("torch.")
        process = ctx.Process(target=sender_main, args=(kv_dst, emb_dst, dtype_name, results))
        process.start()
        counts = results.get(timeout=WAIT_S)
        process.join(timeout=WAIT_S)
        assert process.exitcode == 0
        page_bytes = pool.page_nbytes
        assert counts == (
            4 * 2,
            len(SRC_PAGES) * 4 * 2 * page_bytes,
            2,
            11 * HIDDEN * dtype.itemsize,
        )
        assert pages_landed(pool, before_kv, make_pool(32, dtype, seed=1))
        assert rows_landed(buffer, 30, before_rows, source_rows(dtype, seed=3))
    finally:
        kv_receiver.close()
        emb_receiver.close()


# --- one process: owner and peer map the same file ----------------------------------


def test_pages_land_across_runs_and_layers(kv_pair) -> None:
    receiver, sender = kv_pair
    pool = make_pool(64, torch.bfloat16, seed=2)
    before = (pool.k_buffer.clone(), pool.v_buffer.clone())
    receiver.register(pool)
    src = make_pool(32, torch.bfloat16, seed=1)
    dst = receiver.destination("req-1", DST_PAGES)
    sender.send("req-1", src, SRC_PAGES, dst, time.monotonic() + WAIT_S)
    assert pages_landed(pool, before, src)
    k_addr, k_bytes = pool.memory_regions()[0]
    v_addr, _ = pool.memory_regions()[1]
    assert (
        decode_session_id(receiver.session_id).base_address == k_addr and v_addr == k_addr + k_bytes
    )


def test_close_unlinks_and_senders_then_fail_unavailable(kv_pair) -> None:
    receiver, sender = kv_pair
    pool = make_pool(8, torch.float32, seed=0)
    receiver.register(pool)
    dst = receiver.destination("req-1", [1])
    src = make_pool(8, torch.float32, seed=1)
    sender.send("req-1", src, [2], dst, time.monotonic() + WAIT_S)  # mapped now
    path = segment_path(receiver.session_id)
    receiver.close()
    assert not os.path.exists(path)
    pool.k_buffer[:, 5] = 1.0  # decode's own mapping stays valid while it shuts down
    with pytest.raises(UnavailableError, match="was closed by its owner"):
        sender.send("req-1", src, [2], dst, time.monotonic() + WAIT_S)
    with pytest.raises(UnavailableError, match="no longer exists"):
        ShmKVSender().send("req-1", src, [2], dst, time.monotonic() + WAIT_S)


def test_deadline_and_destination_checks(kv_pair) -> None:
    receiver, sender = kv_pair
    pool = make_pool(12, torch.float32, seed=0)
    receiver.register(pool)
    before = pool.k_buffer.clone()
    dst = receiver.destination("req-1", [1, 2])
    src = make_pool(8, torch.float32, seed=1)
    with pytest.raises(DeadlineExceededError):
        sender.send("req-1", src, [0, 1], dst, time.monotonic() - 1)
    assert same(pool.k_buffer, before)
    layout = dst.layout
    replace = msgspec.structs.replace
    smaller = replace(layout, num_pages=6, v_base=layout.k_base + 4 * 6 * layout.page_nbytes)
    with pytest.raises(InvalidRequestError, match="needs .* bytes, decode's KV pool has"):
        sender.send("req-1", src, [0, 1], replace(dst, layout=smaller), time.monotonic() + WAIT_S)
    moved = replace(layout, k_base=layout.k_base + 64)
    with pytest.raises(InvalidRequestError, match="does not match the shared pool"):
        sender.send("req-1", src, [0, 1], replace(dst, layout=moved), time.monotonic() + WAIT_S)
    with pytest.raises(InvalidRequestError, match="a inprocess destination for the shm sender"):
        sender.send(
            "req-1", src, [0, 1], replace(dst, backend="inprocess"), time.monotonic() + WAIT_S
        )
    assert same(pool.k_buffer, before)


def test_a_gpu_pool_is_refused_naming_cuda_ipc() -> None:
    receiver = ShmKVReceiver()
    with pytest.raises(ValueError, match="moves host memory .* use --kv-transfer-backend cuda_ipc"):
        receiver.register(KVPool(2, 4, 4, 2, 8, torch.float32, "meta"))  # a pool off the host


def test_peers_keep_the_most_recently_used_mappings() -> None:
    segments = [ShmSegment("kv", 4096, "a test segment") for _ in range(3)]
    peers = ShmPeers(max_peers=2)
    try:
        for segment in segments:
            peers.open(segment.name, "a test segment").tensor[0] = 7
        assert len(peers) == 2
        assert all(int(segment.tensor[0]) == 7 for segment in segments)
        peers.open(segments[0].name, "a test segment").tensor[1] = 8  # reopened after its eviction
        assert int(segments[0].tensor[1]) == 8 and len(peers) == 2
        roomy = ShmPeers(max_peers=8)
        roomy.open(segments[0].name, "a test segment")
        roomy.open(segments[1].name, "a test segment")
        segments[0].close()  # its owner went away (a decode that restarts gets a new segment)
        roomy.open(segments[2].name, "a test segment")
        assert len(roomy) == 2  # a new owner's first open let go of the unlinked one
        roomy.close()
    finally:
        peers.close()
        for segment in segments:
            segment.close()


# --- embedding rows ---------------------------------------------------------------------


def test_rows_land_in_the_window_and_tampered_windows_are_refused() -> None:
    receiver, sender = ShmEmbeddingReceiver(), ShmEmbeddingSender()
    buffer = EmbeddingBuffer(64, HIDDEN, torch.float32)
    try:
        assert receiver.buffer_device(torch.device("cuda", 0)) == torch.device("cpu")
        receiver.register(buffer)
        before = buffer.tensor.clone()
        dst = receiver.destination("req-1", 30, 30)
        rows = source_rows(torch.float32, seed=5)
        result = sender.send_runs("req-1", rows, ROW_RUNS, dst, time.monotonic() + WAIT_S)
        assert (result.num_descriptors, result.num_bytes) == (2, 11 * HIDDEN * 4)
        assert rows_landed(buffer, 30, before, rows)
        moved = dst.base_address + 40 * dst.row_stride_bytes
        past_end = msgspec.structs.replace(dst, base_address=moved)
        with pytest.raises(InvalidRequestError, match="do not fit"):
            sender.send_rows("req-1", rows, past_end, 0, time.monotonic() + WAIT_S)
        with pytest.raises(DeadlineExceededError):
            sender.send_rows("req-1", rows, dst, 0, time.monotonic() - 1)
        path = segment_path(receiver.session_id)
    finally:
        receiver.close()
    assert not os.path.exists(path)
    with pytest.raises(
        UnavailableError, match="prefill's embedding buffer .* was closed by its owner"
    ):
        sender.send_rows("req-1", rows, dst, 0, time.monotonic() + WAIT_S)
