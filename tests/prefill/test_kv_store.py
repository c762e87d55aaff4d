"""``services.prefill.kv_store`` against a real ``mooncake_master`` and real store clients.

Two "prefill workers": this process and a peer process (``peer_main``, driven over its stdin
and stdout), so pages cross processes over Mooncake's TCP transport both ways. Pages are
random bit patterns (NaNs, infinities and subnormals included) compared byte for byte.
Faults: the master SIGKILLed or stopped mid-traffic, the worker holding the pages SIGKILLed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from services.common.errors import UnavailableError
from services.prefill.kv_store import (
    KvPagesMissingError,
    KvStore,
    KvStoreError,
    KvStoreTimeoutError,
    KvStoreUnavailableError,
    PageLayout,
)
from services.prefill.kv_store_master import start_master, stop_master

REPO = Path(__file__).resolve().parents[2]
NAMESPACE = "tiny-model@rev1"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16}
SEGMENT = 32 << 20
SLACK_S = 0.6  # a bounded call may overrun its timeout by thread hand-off, not by a native wait


def layout(dtype: torch.dtype, page_size: int = 4) -> PageLayout:
    return PageLayout(num_layers=3, page_size=page_size, num_kv_heads=2, head_dim=8, dtype=dtype)


def pages(lay: PageLayout, seed: int, n: int) -> tuple[list[bytes], torch.Tensor, torch.Tensor]:
    """``n`` page keys and random-bit K and V for them, the same for the same arguments."""
    keys = [hashlib.sha256(f"{seed}/{i}".encode()).digest()[:16] for i in range(n)]
    gen = torch.Generator().manual_seed(seed)
    bits = BITS[lay.dtype]
    info = torch.iinfo(bits)
    k, v = (
        torch.randint(info.min, info.max, lay.batch_shape(n), generator=gen, dtype=bits).view(
            lay.dtype
        )
        for _ in range(2)
    )
    return keys, k, v


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(
        a.contiguous().view(BITS[a.dtype]), b.contiguous().view(BITS[b.dtype])
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(name: str) -> list[int]:
    """Live or zombie processes called ``name`` whose parent is this process."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                comm, rest = f.read().split(" (", 1)[1].rsplit(")", 1)
        except OSError:
            continue
        if comm == name[:15] and int(rest.split()[1]) == os.getpid():
            found.append(int(entry))
    return found


@contextlib.contextmanager
def master(
    tmp_path: Path, graceful: bool = True, **kwargs: Any
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A master on a free port; stopped after (``graceful``: ``stop_master``, SIGTERM, which
    takes the master ~0.9 s; else SIGKILL)."""
    port = free_port()
    proc = start_master(port, log_path=tmp_path / f"master-{port}.log", **kwargs)
    try:
        yield f"127.0.0.1:{port}", proc
    finally:
        if graceful:
            assert stop_master(proc) == 0
        else:
            proc.kill()
            proc.wait()


def timed(call: Callable[[], Any]) -> tuple[float, Any]:
    """Seconds ``call`` took, and what it returned or raised."""
    start = time.monotonic()
    try:
        result = call()
    except Exception as exc:
        result = exc
    return time.monotonic() - start, result


# --- the peer worker: a KvStore in another process


def peer_main() -> None:
    """``python -c 'from tests.prefill.test_kv_store import peer_main; peer_main()' MASTER
    SEGMENT_BYTES``: one JSON command per stdin line, one JSON answer per stdout line."""
    master_addr, segment = sys.argv[1], int(sys.argv[2])
    stores: dict[str, KvStore] = {}

    def store(dtype: str) -> KvStore:
        if dtype not in stores:
            stores[dtype] = KvStore(
                master_addr, NAMESPACE, layout(DTYPES[dtype]), segment_bytes=segment
            )
        return stores[dtype]

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "close":
            print(json.dumps({"closed": [s.close() for s in stores.values()]}), flush=True)
            return
        kv = store(cmd["dtype"])
        if op == "put":
            keys, k, v = pages(kv.layout, cmd["seed"], cmd["n"])
            answer: dict[str, Any] = {"stored": kv.put(keys, k, v)}
        else:
            keys = [bytes.fromhex(key) for key in cmd["keys"]]
            try:
                if op == "exists":
                    answer = {"exists": kv.exists(keys)}
                else:
                    torch.save(kv.get(keys), cmd["path"])
                    answer = {"saved": cmd["path"]}
            except KvStoreError as exc:
                answer = {"error": type(exc).__name__, "message": exc.message}
                if isinstance(exc, KvPagesMissingError):
                    answer["missing"] = [key.hex() for key in exc.missing]
        print(json.dumps(answer), flush=True)


class Peer:
    def __init__(self, master_addr: str, segment: int, log: Path) -> None:
        with open(log, "ab") as err:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    "from tests.prefill.test_kv_store import peer_main; peer_main()",
                    master_addr,
                    str(segment),
                ],
                cwd=REPO,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
        assert self.read(30) == {"ready": True}

    def read(self, timeout_s: float) -> dict[str, Any]:
        box: list[str] = []
        reader = threading.Thread(target=lambda: box.append(self.proc.stdout.readline()))
        reader.start()
        reader.join(timeout_s)
        assert box and box[0], f"peer gave no answer within {timeout_s} s"
        return json.loads(box[0])

    def ask(self, timeout_s: float = 20, **cmd: Any) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.read(timeout_s)

    def close(self) -> None:
        assert all(self.ask(op="close")["closed"])
        assert self.proc.wait(10) == 0


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


# --- faults


def traffic(kv: KvStore, keys: list[bytes], k: torch.Tensor, v: torch.Tensor, timeout_s: float):
    """Rounds of exists, get and put on a thread until ``stop``; each call's (op, start,
    seconds, outcome). The thread ends within one call's bound of ``stop``."""
    log: list[tuple[str, float, float, Any]] = []
    stop = threading.Event()
    fresh = iter(range(10**6))

    def run() -> None:
        while not stop.is_set():
            extra = hashlib.sha256(f"fresh/{next(fresh)}".encode()).digest()[:16]
            for op, call in (
                ("exists", lambda: kv.exists(keys, timeout_s)),
                ("get", lambda: kv.get(keys, timeout_s)),
                ("put", lambda extra=extra: kv.put([extra], k[:, :1], v[:, :1], timeout_s)),
            ):
                if stop.is_set():
                    return
                start = time.monotonic()
                elapsed, outcome = timed(call)
                log.append((op, start, elapsed, outcome))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return log, stop, thread


def await_failures(log, since: float, error: type[Exception], limit_s: float = 15) -> None:
    """Until exists, get and put have each failed with ``error`` in a call started after
    ``since`` (at most ``limit_s``)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        ops = {op for op, start, _, out in list(log) if start >= since and isinstance(out, error)}
        if ops == {"exists", "get", "put"}:
            return
        time.sleep(0.1)


def check_after(
    log, since: float, timeout_s: float, error: type[Exception], k: torch.Tensor, v: torch.Tensor
) -> None:
    """Every call that started after ``since`` ended within its bound, with ``error`` (a get
    may instead return the right pages: the client keeps the replica locations of pages it
    just read and reads them without the master), and each of exists, get and put failed
    so at least once."""
    after = [entry for entry in log if entry[1] >= since]
    failed = {op for op, *_, outcome in after if isinstance(outcome, error)}
    assert failed == {"exists", "get", "put"}, after
    for op, _, elapsed, outcome in after:
        assert elapsed <= timeout_s + SLACK_S, (op, elapsed, outcome)
        if op == "get" and not isinstance(outcome, Exception):
            assert same_bits(outcome[0], k) and same_bits(outcome[1], v)
        else:
            assert isinstance(outcome, error), (op, outcome)


@pytest.mark.slow
def test_the_master_killed_mid_traffic_ends_every_call_in_bound(tmp_path: Path) -> None:
    lay = layout(torch.float32)
    running = children("mooncake_master")  # the module's master, when it is up
    with master(tmp_path, graceful=False) as (addr, proc):
        port = int(addr.rsplit(":", 1)[1])
        kv = KvStore(addr, NAMESPACE, lay, segment_bytes=SEGMENT)
        keys, k, v = pages(lay, 9, 4)
        assert kv.put(keys, k, v) == [True] * 4
        log, stop, thread = traffic(kv, keys, k, v, timeout_s=1.0)
        time.sleep(0.5)
        before = list(log)
        assert before and all(not isinstance(out, Exception) for *_, out in before)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        killed_at = time.monotonic()
        await_failures(log, killed_at, KvStoreUnavailableError)
        stop.set()
        thread.join(1.0 + SLACK_S + 1.0)
        assert not thread.is_alive()
        check_after(log, killed_at, 1.0, KvStoreUnavailableError, k, v)
        # a master restarted on the same port: the client reconnects by itself, store empty
        restarted = start_master(port, log_path=tmp_path / "restarted.log")
        try:
            deadline = time.monotonic() + 20
            while True:
                _, outcome = timed(lambda: kv.exists(keys, 1.0))
                if not isinstance(outcome, Exception) or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            assert outcome == [False] * 4
            # the store has room again once the client has remounted its segment (its ping)
            while kv.put(keys, k, v) != [True] * 4 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert kv.exists(keys) == [True] * 4
            got_k, got_v = kv.get(keys)
            assert same_bits(got_k, k) and same_bits(got_v, v)
            assert kv.close(timeout_s=10)
        finally:
            restarted.kill()
            restarted.wait()
    with pytest.raises(KvStoreUnavailableError, match="closed"):
        kv.exists(keys)
    assert kv.close(timeout_s=1)  # closing twice is fine
    assert children("mooncake_master") == running


@pytest.mark.slow
def test_a_stopped_master_times_calls_out_and_the_client_recovers(tmp_path: Path) -> None:
    lay = layout(torch.float32)
    with master(tmp_path, graceful=False) as (addr, proc):
        kv = KvStore(addr, NAMESPACE, lay, segment_bytes=SEGMENT)
        keys, k, v = pages(lay, 10, 2)
        assert kv.put(keys, k, v) == [True] * 2
        log, stop, thread = traffic(kv, keys, k, v, timeout_s=0.5)
        time.sleep(0.3)
        proc.send_signal(signal.SIGSTOP)  # accepts TCP, answers nothing: a partition
        stopped_at = time.monotonic()
        try:
            await_failures(log, stopped_at, KvStoreTimeoutError)
            stop.set()
            thread.join(0.5 + SLACK_S + 1.0)
            assert not thread.is_alive()
            check_after(log, stopped_at, 0.5, KvStoreTimeoutError, k, v)
        finally:
            # before close: Mooncake's close holds the GIL ~6 s while the master does not answer
            proc.send_signal(signal.SIGCONT)
        # the abandoned calls return (their RPC timeout) and free their buffers; calls work again
        deadline = time.monotonic() + 10
        while True:
            _, outcome = timed(lambda: kv.get(keys, 1.0))
            if not isinstance(outcome, Exception) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert not isinstance(outcome, Exception), outcome
        assert same_bits(outcome[0], k) and same_bits(outcome[1], v)
        assert kv.close(timeout_s=10)


@pytest.mark.slow
def test_the_worker_holding_pages_killed_fails_gets_not_the_client(tmp_path: Path) -> None:
    lay = layout(torch.float32)
    with master(tmp_path, graceful=False, client_ttl_s=1) as (addr, _):
        holder = Peer(addr, SEGMENT, tmp_path / "holder.log")
        with KvStore(addr, NAMESPACE, lay, segment_bytes=0) as kv:  # every page is the peer's
            assert holder.ask(op="put", dtype="float32", seed=11, n=3) == {"stored": [True] * 3}
            keys, k, v = pages(lay, 11, 3)
            got_k, _ = kv.get(keys)
            assert same_bits(got_k, k)
            holder.proc.kill()
            holder.proc.wait()
            elapsed, outcome = timed(lambda: kv.get(keys, 2.0))
            assert isinstance(outcome, KvStoreUnavailableError) and elapsed < 2.0 + SLACK_S
            assert "TRANSFER_FAIL" in outcome.message
            # the master drops the dead client after client_ttl: its pages are gone
            deadline = time.monotonic() + 15
            while kv.exists(keys) != [False] * 3 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert kv.exists(keys) == [False] * 3
            with pytest.raises(KvPagesMissingError):
                kv.get(keys)
            assert kv.put(keys, k, v) == [False] * 3  # no segment left anywhere: no room
