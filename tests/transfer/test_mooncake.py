"""Two real processes over Mooncake TE (TCP, loopback): decode registers, prefill writes."""

import multiprocessing as mp
import os
import socket
import time

import msgspec
import pytest
import torch

from services.common.destinations import KvDestination
from services.engine.kv_cache import KVPool
from services.transfer.base import TransferResult
from tests.conftest import needs_mooncake

pytestmark = [pytest.mark.integration, needs_mooncake]

SRC_PAGES = [0, 1, 2, 3, 10, 20, 21, 5]
DST_PAGES = [40, 41, 42, 43, 7, 30, 31, 3]
QUEUE_TIMEOUT_S = 45  # a hang fails the test instead of blocking it


def make_pool(num_pages: int, seed: int) -> KVPool:
    # [L=4, P, S=16, Hkv=4, D=64] bf16: 8 KiB pages, filled with arbitrary bit patterns
    pool = KVPool(4, num_pages, 16, 4, 64, torch.bfloat16, "cpu")
    generator = torch.Generator().manual_seed(seed)
    for buf in (pool.k_buffer, pool.v_buffer):
        buf.view(torch.int16).copy_(
            torch.randint(-(2**15), 2**15, buf.shape, dtype=torch.int16, generator=generator)
        )
    return pool


def receiver_main(dst_queue, ready_queue, result_queue, exit_after_publish: bool) -> None:
    from services.transfer.mooncake_backend import MooncakeKVReceiver

    receiver = MooncakeKVReceiver()
    pool = make_pool(64, seed=2)
    receiver.register(pool)
    before_k, before_v = pool.k_buffer.clone(), pool.v_buffer.clone()
    dst_queue.put(msgspec.msgpack.encode(receiver.destination("req-1", DST_PAGES)))
    if exit_after_publish:
        return
    ready_queue.get(timeout=QUEUE_TIMEOUT_S)  # prefill's "KV ready"
    src = make_pool(32, seed=1)  # the sender's pool, rebuilt from its seed
    landed = all(
        torch.equal(pool.k_buffer[:, d].view(torch.int16), src.k_buffer[:, s].view(torch.int16))
        and torch.equal(pool.v_buffer[:, d].view(torch.int16), src.v_buffer[:, s].view(torch.int16))
        for s, d in zip(SRC_PAGES, DST_PAGES, strict=True)
    )
    others = [p for p in range(64) if p not in DST_PAGES]
    untouched = torch.equal(
        pool.k_buffer[:, others].view(torch.int16), before_k[:, others].view(torch.int16)
    )
    untouched = untouched and torch.equal(
        pool.v_buffer[:, others].view(torch.int16), before_v[:, others].view(torch.int16)
    )
    result_queue.put((landed, untouched))
    receiver.close()


def sender_main(
    dst_bytes: bytes, deadline_s: float, result_queue, max_descriptors: int = 1024
) -> None:
    from services.common.errors import StageServeError
    from services.transfer.mooncake_backend import MooncakeKVSender

    dst = msgspec.msgpack.decode(dst_bytes, type=KvDestination)
    sender = MooncakeKVSender(max_descriptors_per_call=max_descriptors)
    pool = make_pool(32, seed=1)
    try:
        result = sender.send("req-1", pool, SRC_PAGES, dst, time.monotonic() + deadline_s)
        result_queue.put(("ok", msgspec.msgpack.encode(result)))
    except StageServeError as exc:
        result_queue.put((type(exc).__name__, exc.message))
    result_queue.close()
    result_queue.join_thread()
    os._exit(0)  # a send abandoned at its deadline still runs in the engine; skip its teardown


def spawn(ctx, target, *args):
    process = ctx.Process(target=target, args=args, daemon=True)
    process.start()
    return process


@pytest.mark.parametrize("max_descriptors", [1024, 5], ids=["one-batch", "batches-of-5"])
def test_two_processes_move_pages_byte_exact(max_descriptors: int) -> None:
    ctx = mp.get_context("spawn")
    dst_queue, ready_queue, receiver_results, sender_results = (ctx.Queue() for _ in range(4))
    receiver = spawn(ctx, receiver_main, dst_queue, ready_queue, receiver_results, False)
    dst_bytes = dst_queue.get(timeout=QUEUE_TIMEOUT_S)
    sender = spawn(ctx, sender_main, dst_bytes, 30.0, sender_results, max_descriptors)
    status, payload = sender_results.get(timeout=QUEUE_TIMEOUT_S)
    assert status == "ok", payload
    result = msgspec.msgpack.decode(payload, type=TransferResult)
    # runs: (0..3 -> 40..43), (10 -> 7), (20,21 -> 30,31), (5 -> 3): 4 runs x 4 layers x {K, V}
    assert result.num_descriptors == 4 * 4 * 2
    assert result.num_bytes == len(SRC_PAGES) * 4 * 2 * 16 * 4 * 64 * 2
    ready_queue.put("kv-ready")
    landed, untouched = receiver_results.get(timeout=QUEUE_TIMEOUT_S)
    assert landed and untouched
    for process in (sender, receiver):
        process.join(timeout=QUEUE_TIMEOUT_S)
        assert process.exitcode == 0


def test_dead_peer_is_unavailable_not_a_hang() -> None:
    ctx = mp.get_context("spawn")
    dst_queue, results = ctx.Queue(), ctx.Queue()
    receiver = spawn(ctx, receiver_main, dst_queue, None, None, True)
    dst_bytes = dst_queue.get(timeout=QUEUE_TIMEOUT_S)
    receiver.join(timeout=QUEUE_TIMEOUT_S)  # the decode process is gone
    assert receiver.exitcode == 0
    spawn(ctx, sender_main, dst_bytes, 30.0, results)
    status, message = results.get(timeout=QUEUE_TIMEOUT_S)
    assert status == "UnavailableError" and "mooncake batch write" in message


def test_silent_peer_hits_the_deadline() -> None:
    # a peer that accepts TCP but never answers the handshake holds the engine call for ~60 s
    ctx = mp.get_context("spawn")
    dst_queue, results = ctx.Queue(), ctx.Queue()
    receiver = spawn(ctx, receiver_main, dst_queue, None, None, True)
    real = msgspec.msgpack.decode(dst_queue.get(timeout=QUEUE_TIMEOUT_S), type=KvDestination)
    receiver.join(timeout=QUEUE_TIMEOUT_S)
    with socket.create_server(("127.0.0.1", 0)) as silent:
        dst = msgspec.structs.replace(real, session_id=f"127.0.0.1:{silent.getsockname()[1]}")
        spawn(ctx, sender_main, msgspec.msgpack.encode(dst), 1.0, results)
        status, message = results.get(timeout=QUEUE_TIMEOUT_S)
    assert status == "DeadlineExceededError" and "did not finish before its deadline" in message


def listeners_main(result_queue) -> None:
    from services.transfer.mooncake_engine import MooncakeEngine

    engine = MooncakeEngine("127.0.0.1")
    port = int(engine.session_id.rsplit(":", 1)[1])
    local = []  # the LISTEN sockets of that port, as (hex address, family)
    for family in ("tcp", "tcp6"):
        with open(f"/proc/net/{family}") as table:
            for row in list(table)[1:]:
                address, state = row.split()[1], row.split()[3]
                if state == "0A" and int(address.rsplit(":", 1)[1], 16) == port:
                    local.append((address.rsplit(":", 1)[0], family))
    result_queue.put(local)
    result_queue.close()
    result_queue.join_thread()
    os._exit(0)


def test_the_handshake_port_listens_on_every_interface_whatever_the_hostname() -> None:
    """Why ``up`` refuses Mooncake on a loopback --host (``exposure.MOONCAKE_EXPOSURE``): when
    this fails, Mooncake binds the host it is given; bind it there and lift the refusal."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    process = spawn(ctx, listeners_main, results)
    try:
        local = results.get(timeout=QUEUE_TIMEOUT_S)
    finally:
        process.kill()
        process.join()
    assert local == [("00000000", "tcp")]  # 0.0.0.0, not 127.0.0.1 (0100007F)
