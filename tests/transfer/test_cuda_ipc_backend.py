"""The CUDA IPC KV backend: wire format and refusals on CPU; two processes on GPUs (gpu marker).

On the GPU, decode (a zeroed pool, on the last visible GPU) exports its pool and prefill
(a seeded pool on GPU 0) writes two requests into shuffled pages, one after its stand-in
forward and one layer by layer during it: the right bytes land in the right pages and
every other page stays zero; a passed deadline and a destination whose
layout disagrees with the exported pool are refused before anything is written.
"""

from __future__ import annotations

import faulthandler
import time
import traceback

import msgspec
import pytest
import torch
import torch.multiprocessing as mp

from services.common.destinations import KvDestination
from services.common.errors import DeadlineExceededError, InvalidRequestError
from services.engine import ops
from services.engine.kv_cache import KVPool
from services.transfer import create_kv_receiver, create_kv_sender, cuda_ipc_backend
from services.transfer.base import pool_layout
from services.transfer.cuda_ipc_backend import (
    CudaIpcKVReceiver,
    CudaIpcKVSender,
    IpcBuffer,
    IpcPool,
    decode_session_id,
    encode_session_id,
)

NUM_LAYERS, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM, NUM_PAGES = 3, 4, 2, 8, 12
SRC_PAGES = {"a": [0, 1, 2, 7], "b": [3, 4]}
DST_PAGES = {"a": [9, 2, 5, 11], "b": [0, 1]}


def _pool(device: torch.device, seed: int | None, dtype: torch.dtype = torch.float32) -> KVPool:
    pool = KVPool(NUM_LAYERS, NUM_PAGES, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype, device)
    if seed is not None:
        generator = torch.Generator().manual_seed(seed)
        pool.k_buffer.copy_(torch.randn(pool.k_buffer.shape, generator=generator))
        pool.v_buffer.copy_(torch.randn(pool.v_buffer.shape, generator=generator))
    return pool


def _expected(
    src: KVPool, dst_shape: torch.Size, names: tuple[str, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    k, v = torch.zeros(dst_shape), torch.zeros(dst_shape)
    for name in names:
        for s, d in zip(SRC_PAGES[name], DST_PAGES[name], strict=True):
            k[:, d], v[:, d] = src.k_buffer[:, s].float().cpu(), src.v_buffer[:, s].float().cpu()
    return k, v


def test_copy_pages_moves_every_layer_of_each_page_and_nothing_else():
    src, dst = _pool(torch.device("cpu"), seed=1), _pool(torch.device("cpu"), seed=None)
    pages = [
        torch.tensor(SRC_PAGES["a"] + SRC_PAGES["b"]),
        torch.tensor(DST_PAGES["a"] + DST_PAGES["b"]),
    ]
    ops.copy_pages(src.k_buffer, src.v_buffer, pages[0], dst.k_buffer, dst.v_buffer, pages[1])
    k, v = _expected(src, dst.k_buffer.shape, ("a", "b"))
    assert torch.equal(dst.k_buffer, k) and torch.equal(dst.v_buffer, v)


def test_session_id_round_trips_and_rejects_garbage():
    buf = IpcBuffer(b"\x00\x01" * 32, 4096, 512, b"/torch_123_4", 7, None)
    pool = IpcPool("GPU-abc", (3, 12, 4, 2, 8), "bfloat16", buf, buf)
    assert decode_session_id(encode_session_id(pool)) == pool
    for bad in ("mooncake:127.0.0.1:1234", "cuda-ipc:not base64!", "cuda-ipc:" + "QUJD"):
        with pytest.raises(InvalidRequestError):
            decode_session_id(bad)


def test_registry_builds_both_ends_without_touching_cuda():
    assert isinstance(create_kv_sender("cuda_ipc"), CudaIpcKVSender)
    assert isinstance(create_kv_receiver("cuda_ipc"), CudaIpcKVReceiver)


def test_cpu_pools_are_refused_with_a_clear_error():
    with pytest.raises(ValueError, match="needs a CUDA KV pool"):
        CudaIpcKVReceiver().register(_pool(torch.device("cpu"), seed=None))
    src = _pool(torch.device("cpu"), seed=1)
    layout = pool_layout(src)
    dest = KvDestination("cuda_ipc", "cuda-ipc:QUJD", "a", layout, tuple(DST_PAGES["a"]))
    with pytest.raises(InvalidRequestError, match="needs a CUDA KV pool"):
        CudaIpcKVSender().send("a", src, SRC_PAGES["a"], dest, time.monotonic() + 5)
    with pytest.raises(InvalidRequestError, match="mooncake destination"):
        CudaIpcKVSender().send(
            "a",
            src,
            SRC_PAGES["a"],
            msgspec.structs.replace(dest, backend="mooncake"),
            time.monotonic() + 5,
        )
    with pytest.raises(InvalidRequestError, match="source pages"):
        CudaIpcKVSender().send("a", src, SRC_PAGES["b"], dest, time.monotonic() + 5)


def test_sender_keeps_the_most_recent_pools_mapped_and_checks_each_destination(monkeypatch):
    src = _pool(torch.device("cpu"), seed=1)
    opened: list[str] = []

    def fake_open(self, exported, src_pool):  # CPU stand-in for mapping decode's pool over CUDA IPC
        opened.append(exported.device_uuid)
        return torch.zeros(exported.shape), torch.zeros(exported.shape)

    monkeypatch.setattr(CudaIpcKVSender, "_open", fake_open)
    sender = CudaIpcKVSender(max_peers=2)
    buf = IpcBuffer(b"h", 1, 0, b"r", 0, None)
    shape = (NUM_LAYERS, NUM_PAGES, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM)
    dests = {
        name: KvDestination(
            "cuda_ipc",
            encode_session_id(IpcPool(name, shape, "float32", buf, buf)),
            "a",
            pool_layout(src),
            tuple(DST_PAGES["a"]),
        )
        for name in ("gpu-a", "gpu-b", "gpu-c")
    }
    for name in ("gpu-a", "gpu-b", "gpu-a", "gpu-c", "gpu-a", "gpu-b"):
        sender._peer(dests[name], src)
    # a and b mapped; c evicted b (least recently used); b mapped again evicted c
    assert opened == ["gpu-a", "gpu-b", "gpu-c", "gpu-b"]
    assert [key[0] for key in sender._peers] == [
        dests["gpu-a"].session_id,
        dests["gpu-b"].session_id,
    ]
    wrong = msgspec.structs.replace(
        dests["gpu-a"], layout=msgspec.structs.replace(dests["gpu-a"].layout, num_pages=99)
    )
    with pytest.raises(InvalidRequestError, match="does not match the exported pool"):
        sender._peer(wrong, src)  # checked on every send, not only when the pool was first mapped


def _decode(device_index: int, to_prefill: mp.Queue, from_prefill: mp.Queue) -> None:
    faulthandler.dump_traceback_later(100, exit=True)
    device = torch.device("cuda", device_index)
    pool = _pool(device, seed=None, dtype=torch.bfloat16)
    receiver = CudaIpcKVReceiver()
    receiver.register(pool)
    destinations = [receiver.destination(name, DST_PAGES[name]) for name in ("a", "b")]
    to_prefill.put([msgspec.msgpack.encode(d) for d in destinations])
    sent = from_prefill.get(timeout=90)
    source = _pool(torch.device("cpu"), seed=1, dtype=torch.bfloat16)
    k, v = _expected(source, pool.k_buffer.shape, tuple(sent))
    ok = torch.equal(pool.k_buffer.float().cpu(), k) and torch.equal(pool.v_buffer.float().cpu(), v)
    to_prefill.put(("checked", ok, sorted(sent)))
    receiver.close()


def _prefill_sends(
    sender: CudaIpcKVSender, pool: KVPool, dests: dict[str, KvDestination]
) -> tuple[list, list]:
    errors = []
    try:
        sender.send("a", pool, SRC_PAGES["a"], dests["a"], time.monotonic() - 1)
    except DeadlineExceededError:
        errors.append("deadline")
    bad = msgspec.structs.replace(
        dests["b"], layout=msgspec.structs.replace(dests["b"].layout, num_pages=99)
    )
    try:
        sender.send("b", pool, SRC_PAGES["b"], bad, time.monotonic() + 30)
    except InvalidRequestError:
        errors.append("layout")
    # "a" queued after its forward, "b" layer by layer during a stand-in forward that writes each of
    # its layers after a ~1 ms busy kernel; neither awaited before both are queued (a batch)
    truth = pool.k_buffer.clone(), pool.v_buffer.clone()
    b_pages = torch.tensor(SRC_PAGES["b"], device=pool.device)
    for buf in (pool.k_buffer, pool.v_buffer):
        buf[:, b_pages] = 0
    pending = [sender.start("a", pool, SRC_PAGES["a"], dests["a"], time.monotonic() + 30)]
    layerwise = sender.start_layerwise("b", pool, SRC_PAGES["b"], dests["b"], time.monotonic() + 30)
    for layer in range(NUM_LAYERS):
        torch.cuda._sleep(1_000_000)
        for buf, full in zip((pool.k_buffer, pool.v_buffer), truth, strict=True):
            buf[layer, b_pages] = full[layer, b_pages]
        layerwise.layer_done(
            layer
        )  # a copy per layer (LAYER_CHUNK_BYTES is 1 here), behind that write
    pending.append(layerwise.finish())
    for buf in (
        pool.k_buffer,
        pool.v_buffer,
    ):  # the next forward reuses the pages: behind the copies
        buf[:, b_pages] = 0
    results = [p.wait() for p in pending]
    return errors, [r.num_bytes for r in results]


def _prefill(to_prefill: mp.Queue, from_prefill: mp.Queue, out: mp.Queue) -> None:
    faulthandler.dump_traceback_later(100, exit=True)
    pool = _pool(torch.device("cuda", 0), seed=1, dtype=torch.bfloat16)
    dests = {
        d.request_id: d
        for d in (msgspec.msgpack.decode(raw, type=KvDestination) for raw in to_prefill.get())
    }
    sender = CudaIpcKVSender()
    cuda_ipc_backend.LAYER_CHUNK_BYTES = 1  # one copy per layer
    try:
        errors, num_bytes = _prefill_sends(sender, pool, dests)
    except BaseException:  # report it at once: decode must not wait for a "sent" that never comes
        from_prefill.put([])
        out.put((["crashed: " + traceback.format_exc()], [], (None, False, [])))
        raise
    from_prefill.put(["a", "b"])
    out.put((errors, num_bytes, to_prefill.get(timeout=90)))
    sender.close()


@pytest.mark.gpu
def test_two_processes_write_the_right_pages_over_cuda_ipc():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    ctx = mp.get_context("spawn")
    to_prefill, from_prefill, out = ctx.Queue(), ctx.Queue(), ctx.Queue()
    decode = ctx.Process(
        target=_decode, args=(torch.cuda.device_count() - 1, to_prefill, from_prefill)
    )
    prefill = ctx.Process(target=_prefill, args=(to_prefill, from_prefill, out))
    decode.start()
    prefill.start()
    try:
        errors, num_bytes, (_, ok, states) = out.get(timeout=110)
    finally:
        for process in (prefill, decode):
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
    page_bytes = 2 * NUM_LAYERS * PAGE_SIZE * NUM_KV_HEADS * HEAD_DIM * 2
    assert errors == ["deadline", "layout"]
    assert num_bytes == [4 * page_bytes, 2 * page_bytes]
    assert ok, "decode's pool does not hold exactly the sent pages"
    assert states == ["a", "b"]  # both writes reported sent, and checked above
