"""KV backends that copy with torch (inprocess: one process; shm: /dev/shm between processes)."""

import time

import pytest
import torch

from services.common.errors import DeadlineExceededError, UnavailableError
from services.engine.kv_cache import KVPool
from services.transfer import create_kv_receiver, create_kv_sender
from services.transfer.inprocess_backend import InProcessFabric

COPYING_BACKENDS = ["inprocess", "shm"]
GONE = {"inprocess": "no in-process KV pool", "shm": "decode's KV pool .* no longer exists"}


def make_pool(num_pages: int, seed: int | None) -> KVPool:
    pool = KVPool(
        num_layers=3,
        num_pages=num_pages,
        page_size=4,
        num_kv_heads=2,
        head_dim=8,
        dtype=torch.float32,
        device="cpu",
    )
    if seed is not None:
        generator = torch.Generator().manual_seed(seed)
        pool.k_buffer.copy_(torch.randn(pool.k_buffer.shape, generator=generator))
        pool.v_buffer.copy_(torch.randn(pool.v_buffer.shape, generator=generator))
    return pool


def endpoints(backend: str):
    """A receiver and a sender that reach each other (in-process ones share a fresh fabric)."""
    kwargs = {"fabric": InProcessFabric()} if backend == "inprocess" else {}
    return create_kv_receiver(backend, **kwargs), create_kv_sender(backend, **kwargs)


@pytest.mark.parametrize("backend", COPYING_BACKENDS)
def test_pages_land_in_place_and_other_pages_are_untouched(backend) -> None:
    receiver, sender = endpoints(backend)
    src_pool, dst_pool = make_pool(8, seed=1), make_pool(12, seed=2)
    receiver.register(dst_pool)
    dst_before_k, dst_before_v = dst_pool.k_buffer.clone(), dst_pool.v_buffer.clone()
    src_pages, dst_pages = [2, 3, 4, 7, 0], [9, 10, 11, 1, 5]
    dst = receiver.destination("req-1", dst_pages)

    result = sender.send("req-1", src_pool, src_pages, dst, deadline_mono=time.monotonic() + 10)

    assert result.num_descriptors == 2 * 3  # runs (2->9 x3), (7->1), (0->5), for K and V
    assert result.num_bytes == 2 * 3 * 5 * dst_pool.page_nbytes
    for src_page, dst_page in zip(src_pages, dst_pages, strict=True):
        assert torch.equal(dst_pool.k_buffer[:, dst_page], src_pool.k_buffer[:, src_page])
        assert torch.equal(dst_pool.v_buffer[:, dst_page], src_pool.v_buffer[:, src_page])
    others = [page for page in range(12) if page not in dst_pages]
    assert torch.equal(dst_pool.k_buffer[:, others], dst_before_k[:, others])
    assert torch.equal(dst_pool.v_buffer[:, others], dst_before_v[:, others])
    receiver.close()


@pytest.mark.parametrize("backend", COPYING_BACKENDS)
def test_unknown_peer_and_passed_deadline_are_errors(backend) -> None:
    receiver, sender = endpoints(backend)
    receiver.register(make_pool(4, seed=None))
    dst = receiver.destination("req-1", [0])
    src_pool = make_pool(4, seed=3)
    with pytest.raises(DeadlineExceededError):
        sender.send("req-1", src_pool, [1], dst, deadline_mono=time.monotonic() - 1)
    receiver.close()
    with pytest.raises(UnavailableError, match=GONE[backend]):
        sender.send("req-1", src_pool, [1], dst, deadline_mono=time.monotonic() + 10)


def test_registry_rejects_unknown_backends() -> None:
    with pytest.raises(
        ValueError, match="unknown KV transfer backend 'rdma'; supported: mooncake, inprocess"
    ):
        create_kv_sender("rdma")
    with pytest.raises(ValueError, match="unknown KV transfer backend"):
        create_kv_receiver("rdma")
