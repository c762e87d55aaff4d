"""``services.prefill.kv_store`` against a real ``mooncake_master`` and real store clients.

Two "prefill workers": this process and a peer process (``kv_store_peers.Peer``), so pages
cross processes over Mooncake's TCP transport both ways, compared byte for byte. Faults
(the master or the worker holding the pages killed or stopped): ``test_kv_store_faults.py``.
"""

from __future__ import annotations

import hashlib
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from services.common.errors import UnavailableError
from services.prefill.kv_store import KvStore, PageLayout
from services.prefill.kv_store_calls import (
    KvPagesMissingError,
    KvStoreError,
    KvStoreUnavailableError,
)
from services.prefill.kv_store_master import start_master
from tests.prefill.kv_store_peers import (
    DTYPES,
    NAMESPACE,
    SEGMENT,
    Peer,
    children,
    free_port,
    layout,
    master,
    pages,
    same_bits,
    timed,
)

# --- one master and two workers for the functional tests


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The master, this process's clients (they hold the store's memory; pages cross to and
    from the peer over TCP) and the peer (lends none)."""
    tmp = tmp_path_factory.mktemp("kv_store")
    with master(tmp) as (addr, _proc):
        # max_pages_per_call=2: a 5-page call is split into three native calls
        # the float32 client lends the store's memory (all clients' pages land there)
        ours = {
            name: KvStore(
                addr,
                NAMESPACE,
                layout(dtype),
                segment_bytes=SEGMENT if name == "float32" else 0,
                max_pages_per_call=2,
            )
            for name, dtype in DTYPES.items()
        }
        peer = Peer(addr, 0, tmp / "peer.log")
        try:
            yield {"addr": addr, "ours": ours, "peer": peer, "tmp": tmp}
        finally:
            peer.close()
            for store in ours.values():
                assert store.close(timeout_s=10)
    assert children("mooncake_master") == []


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_a_page_put_by_one_worker_is_found_by_the_other_bit_identical(
    cluster: dict[str, Any], dtype: str
) -> None:
    ours: KvStore = cluster["ours"][dtype]
    peer: Peer = cluster["peer"]
    # the peer computes 5 pages and puts them; this worker finds them and reads them back
    assert peer.ask(op="put", dtype=dtype, seed=1, n=5) == {"stored": [True] * 5}
    keys, k, v = pages(ours.layout, 1, 5)
    unknown = hashlib.sha256(b"never put").digest()[:16]
    assert ours.exists([*keys, unknown]) == [True] * 5 + [False]
    got_k, got_v = ours.get(keys)
    assert got_k.dtype == ours.layout.dtype and got_k.device.type == "cpu"
    assert same_bits(got_k, k) and same_bits(got_v, v)
    # any subset, in the order asked
    got_k, got_v = ours.get([keys[3], keys[0]])
    assert same_bits(got_k, k[:, [3, 0]]) and same_bits(got_v, v[:, [3, 0]])
    # the other way: this worker puts, the peer finds and reads
    keys, k, v = pages(ours.layout, 2, 3)
    assert ours.put(keys, k, v) == [True] * 3
    assert peer.ask(op="exists", dtype=dtype, keys=[key.hex() for key in keys]) == {
        "exists": [True] * 3
    }
    path = cluster["tmp"] / f"peer-got-{dtype}.pt"
    assert peer.ask(op="get", dtype=dtype, keys=[key.hex() for key in keys], path=str(path))
    peer_k, peer_v = torch.load(path)
    assert same_bits(peer_k, k) and same_bits(peer_v, v)


def test_a_missing_page_is_absent_and_get_names_it(cluster: dict[str, Any]) -> None:
    ours: KvStore = cluster["ours"]["float32"]
    keys, k, v = pages(ours.layout, 3, 2)
    assert ours.put(keys, k, v) == [True, True]
    missing = hashlib.sha256(b"missing").digest()[:16]
    asked = [keys[0], missing, keys[1]]
    assert ours.exists(asked) == [True, False, True]
    with pytest.raises(KvPagesMissingError) as caught:
        ours.get(asked)
    assert caught.value.missing == (missing,)
    assert isinstance(caught.value, KvStoreError) and isinstance(caught.value, UnavailableError)
    assert missing.hex() in caught.value.message
    # the peer sees the same
    answer = cluster["peer"].ask(
        op="get", dtype="float32", keys=[key.hex() for key in asked], path="/nonexistent"
    )
    assert answer["error"] == "KvPagesMissingError" and answer["missing"] == [missing.hex()]
    # a failed get leaves the client working
    got_k, got_v = ours.get(keys)
    assert same_bits(got_k, k) and same_bits(got_v, v)


def test_other_namespaces_and_layouts_do_not_see_the_pages(cluster: dict[str, Any]) -> None:
    ours: KvStore = cluster["ours"]["float32"]
    keys, k, v = pages(ours.layout, 4, 3)
    assert ours.put(keys, k, v) == [True] * 3
    # another model, same layout
    with KvStore(cluster["addr"], "other-model", ours.layout, segment_bytes=0) as other:
        assert other.exists(keys) == [False] * 3
        with pytest.raises(KvPagesMissingError) as caught:
            other.get(keys)
        assert caught.value.missing == tuple(keys)
    # same model, another layout (dtype): the bf16 client of this worker
    assert cluster["ours"]["bfloat16"].exists(keys) == [False] * 3
    assert ours.store_key(keys[0]) != cluster["ours"]["bfloat16"].store_key(keys[0])
    assert layout(torch.float32).tag != layout(torch.float32, page_size=8).tag


def test_the_first_put_of_a_key_wins(cluster: dict[str, Any]) -> None:
    ours: KvStore = cluster["ours"]["float32"]
    keys, k, v = pages(ours.layout, 5, 1)
    _, k2, v2 = pages(ours.layout, 6, 1)
    assert ours.put(keys, k, v) == [True]
    assert ours.put(keys, k2, v2) == [True]  # already there: kept as it was
    got_k, got_v = ours.get(keys)
    assert same_bits(got_k, k) and same_bits(got_v, v)


def test_bad_arguments_are_refused_before_the_store_is_asked(cluster: dict[str, Any]) -> None:
    ours: KvStore = cluster["ours"]["float32"]
    keys, k, v = pages(ours.layout, 7, 2)
    with pytest.raises(ValueError, match="16 bytes"):
        ours.exists([b"short"])
    with pytest.raises(ValueError, match=r"k must be torch.float32 \[3, 2, 4, 2, 8\]"):
        ours.put(keys, k[:, :1], v)
    with pytest.raises(ValueError, match="v must be"):
        ours.put(keys, k, v.to(torch.bfloat16))
    assert ours.exists(keys) == [False, False]
    assert ours.exists([]) == [] and ours.put([], k[:, :0], v[:, :0]) == []
    with pytest.raises(ValueError, match="namespace"):
        KvStore(cluster["addr"], "has space", ours.layout)
    with pytest.raises(ValueError, match="host:port"):
        KvStore("nohost", NAMESPACE, ours.layout)
    # nothing listens there: refused at once, before Mooncake's setup (which holds the GIL)
    elapsed, result = timed(lambda: KvStore(f"127.0.0.1:{free_port()}", NAMESPACE, ours.layout))
    assert isinstance(result, KvStoreUnavailableError) and elapsed < 1.0


def test_start_master_refuses_a_taken_port(tmp_path: Path) -> None:
    running = children("mooncake_master")  # the module's master, when it is up
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(KvStoreUnavailableError, match=f"127.0.0.1:{port}"):
            start_master(port, log_path=tmp_path / "master.log")
    assert children("mooncake_master") == running


@pytest.mark.slow
def test_a_full_store_refuses_pages_without_failing(tmp_path: Path) -> None:
    big = PageLayout(num_layers=8, page_size=16, num_kv_heads=8, head_dim=128, dtype=torch.float32)
    assert big.value_nbytes == 1 << 20
    with master(tmp_path, graceful=False) as (addr, _):
        with KvStore(addr, NAMESPACE, big, segment_bytes=16 << 20, max_pages_per_call=24) as kv:
            keys, k, v = pages(big, 8, 24)  # 24 MiB into a 16 MiB store
            stored = kv.put(keys, k, v)
            assert 0 < sum(stored) < 24
            assert kv.exists(keys) == stored
            kept = [i for i, ok in enumerate(stored) if ok]
            got_k, got_v = kv.get([keys[i] for i in kept])
            assert same_bits(got_k, k[:, kept]) and same_bits(got_v, v[:, kept])
        with pytest.raises(ValueError, match="segment_bytes"):
            KvStore(addr, NAMESPACE, big, segment_bytes=1 << 20)
