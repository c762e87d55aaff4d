"""Embedding rows handoff: row bookkeeping, descriptors, torch copies (inprocess, shm), Mooncake.

Mooncake runs across two processes.
"""

import multiprocessing as mp
import os
import socket
import time

import msgspec
import pytest
import torch

from services.common.errors import (
    CapacityError,
    DeadlineExceededError,
    InvalidRequestError,
    UnavailableError,
)
from services.transfer import create_embedding_receiver, create_embedding_sender
from services.transfer.embeddings import (
    EmbeddingBuffer,
    EmbeddingDestination,
    EmbeddingRowManager,
    coalesce_runs,
)
from services.transfer.embeddings_inprocess import EmbeddingFabric
from services.transfer.embeddings_mooncake import plan_row_transfer
from tests.conftest import needs_mooncake

QUEUE_TIMEOUT_S = 45  # a hang fails the test instead of blocking it


# --- EmbeddingRowManager ------------------------------------------------------------


def test_row_manager_allocates_contiguous_ranges_and_merges_freed_ones() -> None:
    rows = EmbeddingRowManager(10)
    a, b, c = rows.allocate(3), rows.allocate(4), rows.allocate(3)
    assert (a, b, c) == (0, 3, 7)
    assert not rows.can_allocate(1)
    with pytest.raises(CapacityError):
        rows.allocate(1)
    rows.free(a, 3)
    rows.free(c, 3)
    assert rows.num_free_rows == 6 and not rows.can_allocate(4)  # two holes of 3, not one of 6
    rows.free(b, 4)
    assert rows.num_free_rows == 10 and rows.num_allocations == 0
    assert rows.allocate(10) == 0  # the holes merged back into one range


def test_row_manager_rejects_bad_frees_and_sizes() -> None:
    rows = EmbeddingRowManager(8)
    start = rows.allocate(4)
    with pytest.raises(ValueError):
        rows.free(start, 3)  # not the size given out
    rows.free(start, 4)
    with pytest.raises(ValueError):
        rows.free(start, 4)  # double free
    with pytest.raises(ValueError):
        rows.allocate(0)
    assert rows.num_free_rows == 8


def test_row_manager_first_fit_reuses_holes() -> None:
    rows = EmbeddingRowManager(12)
    starts = [rows.allocate(2) for _ in range(6)]
    for start in starts[1::2]:
        rows.free(start, 2)
    assert rows.allocate(2) == 2
    with pytest.raises(CapacityError, match="largest free range has 2"):
        rows.allocate(3)


# --- descriptors ------------------------------------------------------------------


def destination(
    base: int, num_rows: int, stride: int, hidden: int = 4, dtype: str = "float32"
) -> EmbeddingDestination:
    return EmbeddingDestination("inprocess", "", "s", 0, base, num_rows, stride, hidden, dtype)


def test_adjacent_runs_coalesce_into_one_descriptor() -> None:
    assert coalesce_runs([(0, 5, 2), (2, 7, 3), (5, 20, 1), (6, 21, 0), (6, 21, 2)]) == [
        (0, 5, 5),
        (5, 20, 3),
    ]
    plan = plan_row_transfer(
        1000, [(0, 5, 2), (2, 7, 3), (5, 20, 1)], 16, destination(5000, 32, 16)
    )
    assert plan.src_addrs == (1000, 1080)
    assert plan.dst_addrs == (5000 + 5 * 16, 5000 + 20 * 16)
    assert plan.lengths == (80, 16)


def test_padded_destination_rows_get_one_descriptor_each() -> None:
    plan = plan_row_transfer(0, [(0, 1, 3)], 16, destination(4096, 8, 64))
    assert plan.dst_addrs == (4096 + 64, 4096 + 128, 4096 + 192)
    assert plan.src_addrs == (0, 16, 32) and plan.lengths == (16, 16, 16)


# --- backends that copy with torch (inprocess: one process; shm: /dev/shm between processes) ---

COPYING_BACKENDS = ["inprocess", "shm"]


def endpoints(backend: str, **receiver_kwargs):
    """A receiver and a sender that reach each other (in-process ones share a fresh fabric)."""
    kwargs = {"fabric": EmbeddingFabric()} if backend == "inprocess" else {}
    return create_embedding_receiver(backend, **kwargs, **receiver_kwargs), create_embedding_sender(
        backend, **kwargs
    )


@pytest.mark.parametrize("backend", COPYING_BACKENDS)
def test_destination_is_a_window_of_the_buffer(backend) -> None:
    receiver, _ = endpoints(backend, cp_rank=2)
    buffer = EmbeddingBuffer(32, 8, torch.bfloat16)
    receiver.register(buffer)
    dst = receiver.destination("req-1", 10, 5)
    assert dst.base_address == buffer.base_address + 10 * 16
    assert (dst.num_rows, dst.row_stride_bytes, dst.hidden_size, dst.dtype, dst.cp_rank) == (
        5,
        16,
        8,
        "bfloat16",
        2,
    )
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(dst), type=EmbeddingDestination) == dst
    with pytest.raises(InvalidRequestError):
        receiver.destination("req-1", 30, 5)
    receiver.close()


@pytest.mark.parametrize("backend", COPYING_BACKENDS)
def test_rows_land_in_place_and_nothing_else_changes(backend) -> None:
    receiver, sender = endpoints(backend)
    buffer = EmbeddingBuffer(40, 16, torch.float32)
    buffer.tensor.copy_(torch.randn(40, 16))
    before = buffer.tensor.clone()
    receiver.register(buffer)
    assert torch.equal(buffer.tensor, before)  # registering keeps the rows, wherever they now live
    dst = receiver.destination("req-1", 20, 12)
    rows = torch.randn(7, 16)
    result = sender.send_runs("req-1", rows, [(0, 0, 4), (4, 4, 3)], dst, time.monotonic() + 10)
    assert (result.num_descriptors, result.num_bytes) == (1, 7 * 16 * 4)
    assert torch.equal(buffer.tensor[20:27], rows)
    assert torch.equal(buffer.tensor[:20], before[:20]) and torch.equal(
        buffer.tensor[27:], before[27:]
    )
    sender.send_rows("req-1", rows[:2], dst, 10, time.monotonic() + 10)
    assert torch.equal(buffer.tensor[30:32], rows[:2])
    receiver.close()


@pytest.mark.parametrize("backend", COPYING_BACKENDS)
def test_copying_backend_errors(backend) -> None:
    receiver, sender = endpoints(backend)
    receiver.register(EmbeddingBuffer(8, 4, torch.float32))
    dst = receiver.destination("req-1", 0, 4)
    with pytest.raises(InvalidRequestError, match="outside the 4 rows"):
        sender.send_rows("req-1", torch.zeros(3, 4), dst, 2, time.monotonic() + 10)
    with pytest.raises(InvalidRequestError, match="destination holds"):
        sender.send_rows(
            "req-1", torch.zeros(3, 4, dtype=torch.float16), dst, 0, time.monotonic() + 10
        )
    with pytest.raises(DeadlineExceededError):
        sender.send_rows("req-1", torch.zeros(3, 4), dst, 0, time.monotonic() - 1)
    receiver.close()
    with pytest.raises(UnavailableError):
        sender.send_rows("req-1", torch.zeros(3, 4), dst, 0, time.monotonic() + 10)


def test_unknown_backend_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="unknown embedding transfer backend 'carrier-pigeon'"):
        create_embedding_sender("carrier-pigeon")


# --- Mooncake: two real processes ------------------------------------------------------

HIDDEN = 48
RUNS = [(0, 3, 5), (5, 8, 2), (7, 20, 4)]  # the first two coalesce


def source_rows(seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**15), 2**15, (11, HIDDEN), dtype=torch.int16, generator=generator)
    return bits.view(torch.bfloat16)  # [11, HIDDEN] arbitrary bit patterns


def receiver_main(dst_queue, ready_queue, result_queue, exit_after_publish: bool) -> None:
    from services.transfer.embeddings_mooncake import MooncakeEmbeddingReceiver

    receiver = MooncakeEmbeddingReceiver()
    buffer = EmbeddingBuffer(64, HIDDEN, torch.bfloat16)
    buffer.tensor.view(torch.int16).fill_(7)
    receiver.register(buffer)
    dst_queue.put(msgspec.msgpack.encode(receiver.destination("req-1", 30, 30)))
    if exit_after_publish:
        return
    ready_queue.get(timeout=QUEUE_TIMEOUT_S)
    src = source_rows(seed=1).view(torch.int16)
    got = buffer.tensor.view(torch.int16)
    landed = all(torch.equal(got[30 + d : 30 + d + n], src[s : s + n]) for s, d, n in RUNS)
    written = {30 + d + i for _, d, n in RUNS for i in range(n)}
    others = [r for r in range(64) if r not in written]
    untouched = bool((got[others] == 7).all())
    result_queue.put((landed, untouched))
    receiver.close()


def sender_main(dst_bytes: bytes, deadline_s: float, result_queue, staging_rows: int = 64) -> None:
    from services.common.errors import StageServeError
    from services.transfer.embeddings_mooncake import MooncakeEmbeddingSender

    dst = msgspec.msgpack.decode(dst_bytes, type=EmbeddingDestination)
    sender = MooncakeEmbeddingSender(staging_rows=staging_rows)
    try:
        result = sender.send_runs(
            "req-1", source_rows(seed=1), RUNS, dst, time.monotonic() + deadline_s
        )
        result_queue.put(("ok", result.num_descriptors, result.num_bytes))
    except StageServeError as exc:
        result_queue.put((type(exc).__name__, exc.message, 0))
    result_queue.close()
    result_queue.join_thread()
    os._exit(0)  # a send abandoned at its deadline still runs in the engine; skip its teardown


def spawn(ctx, target, *args):
    process = ctx.Process(target=target, args=args, daemon=True)
    process.start()
    return process


@pytest.mark.integration
@needs_mooncake
@pytest.mark.parametrize("staging_rows", [64, 4], ids=["staged", "private-registration"])
def test_mooncake_two_processes_byte_exact(staging_rows: int) -> None:
    ctx = mp.get_context("spawn")
    dst_queue, ready_queue, receiver_results, sender_results = (ctx.Queue() for _ in range(4))
    receiver = spawn(ctx, receiver_main, dst_queue, ready_queue, receiver_results, False)
    dst_bytes = dst_queue.get(timeout=QUEUE_TIMEOUT_S)
    sender = spawn(ctx, sender_main, dst_bytes, 30.0, sender_results, staging_rows)
    status, num_descriptors, num_bytes = sender_results.get(timeout=QUEUE_TIMEOUT_S)
    assert status == "ok", num_descriptors
    assert (num_descriptors, num_bytes) == (2, 11 * HIDDEN * 2)
    ready_queue.put("done")
    landed, untouched = receiver_results.get(timeout=QUEUE_TIMEOUT_S)
    assert landed and untouched
    for process in (sender, receiver):
        process.join(timeout=QUEUE_TIMEOUT_S)
        assert process.exitcode == 0


@pytest.mark.integration
@needs_mooncake
def test_mooncake_dead_peer_is_unavailable() -> None:
    ctx = mp.get_context("spawn")
    dst_queue, results = ctx.Queue(), ctx.Queue()
    receiver = spawn(ctx, receiver_main, dst_queue, None, None, True)
    dst_bytes = dst_queue.get(timeout=QUEUE_TIMEOUT_S)
    receiver.join(timeout=QUEUE_TIMEOUT_S)  # the prefill process is gone
    spawn(ctx, sender_main, dst_bytes, 30.0, results)
    status, message, _ = results.get(timeout=QUEUE_TIMEOUT_S)
    assert status == "UnavailableError" and "mooncake batch write" in message


@pytest.mark.integration
@needs_mooncake
def test_mooncake_silent_peer_hits_the_deadline() -> None:
    ctx = mp.get_context("spawn")
    dst_queue, results = ctx.Queue(), ctx.Queue()
    receiver = spawn(ctx, receiver_main, dst_queue, None, None, True)
    real = msgspec.msgpack.decode(dst_queue.get(timeout=QUEUE_TIMEOUT_S), type=EmbeddingDestination)
    receiver.join(timeout=QUEUE_TIMEOUT_S)
    with socket.create_server(("127.0.0.1", 0)) as silent:
        peer = f"127.0.0.1:{silent.getsockname()[1]}"
        dst = msgspec.structs.replace(real, session_id=peer, engine_address=peer)
        spawn(ctx, sender_main, msgspec.msgpack.encode(dst), 1.0, results)
        status, message, _ = results.get(timeout=QUEUE_TIMEOUT_S)
    assert status == "DeadlineExceededError" and "did not finish before its deadline" in message


@needs_mooncake
def test_host_only_mooncake_keeps_registered_rows_in_host_memory(monkeypatch) -> None:
    from services.common import kv_transfer
    from services.transfer import embeddings_mooncake

    assert not kv_transfer.mooncake_moves_device_memory()  # this machine has the -non-cuda build
    gpu = torch.device("cuda", 0)
    gpu_rows = torch.empty(
        2, HIDDEN, device="meta"
    )  # stands for rows on a GPU: only its device is read
    stage = embeddings_mooncake.MooncakeEmbeddingSender._staging_device
    receiver = embeddings_mooncake.MooncakeEmbeddingReceiver()
    try:
        assert receiver.buffer_device(gpu) == torch.device("cpu")  # prefill's buffer: host memory
        assert stage(gpu_rows) == torch.device("cpu")  # the encoder stages GPU rows on the host
        monkeypatch.setattr(
            embeddings_mooncake, "mooncake_moves_device_memory", lambda: True
        )  # CUDA build
        assert receiver.buffer_device(gpu) == gpu
        assert stage(gpu_rows) == gpu_rows.device
    finally:
        receiver.close()
