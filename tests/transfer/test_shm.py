"""The shm transfer backend: decode's KV pool and prefill's embedding buffer in /dev/shm."""

import multiprocessing as mp
import os
import signal
import stat
import subprocess
import sys
import time

import msgspec
import pytest
import torch

from services.common.errors import DeadlineExceededError, InvalidRequestError, UnavailableError
from services.engine.kv_cache import KVPool
from services.transfer import shm_memory
from services.transfer.base import KvDestination
from services.transfer.embeddings import EmbeddingBuffer, EmbeddingDestination
from services.transfer.embeddings_shm import ShmEmbeddingReceiver, ShmEmbeddingSender
from services.transfer.shm_backend import ShmKVReceiver, ShmKVSender
from services.transfer.shm_memory import NAME_RE, SHM_DIR, ShmPeers, ShmSegment, decode_session_id
from tests.conftest import REPO

SRC_PAGES = [0, 1, 2, 3, 10, 20, 21, 5]  # runs: 0..3 -> 40..43, 10 -> 7, 20..21 -> 30..31, 5 -> 3
DST_PAGES = [40, 41, 42, 43, 7, 30, 31, 3]
ROW_RUNS = [(0, 3, 5), (5, 8, 2), (7, 20, 4)]  # the first two coalesce
HIDDEN = 48
BITS = {torch.bfloat16: torch.int16, torch.float32: torch.int32}
WAIT_S = 60  # a hang fails the test instead of blocking it


def fill(t: torch.Tensor, seed: int) -> torch.Tensor:
    """``t`` overwritten with arbitrary bit patterns (NaNs included), compared as integers."""
    bits = t.view(BITS[t.dtype])
    info = torch.iinfo(bits.dtype)
    generator = torch.Generator().manual_seed(seed)
    bits.copy_(torch.randint(info.min, info.max, bits.shape, dtype=bits.dtype, generator=generator))
    return t


def make_pool(num_pages: int, dtype: torch.dtype, seed: int) -> KVPool:
    pool = KVPool(4, num_pages, 4, 2, 8, dtype, "cpu")  # [L=4, P, S=4, Hkv=2, D=8]
    fill(pool.k_buffer, seed)
    fill(pool.v_buffer, seed + 1)
    return pool


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(BITS[a.dtype]), b.view(BITS[b.dtype]))


def segment_path(session_id: str) -> str:
    return os.path.join(SHM_DIR, decode_session_id(session_id).name)


def pages_landed(dst: KVPool, before: tuple[torch.Tensor, torch.Tensor], src: KVPool) -> bool:
    """Every source page of every layer in its destination page; every other page unchanged."""
    landed = all(
        same(dst.k_buffer[:, d], src.k_buffer[:, s])
        and same(dst.v_buffer[:, d], src.v_buffer[:, s])
        for s, d in zip(SRC_PAGES, DST_PAGES, strict=True)
    )
    others = [p for p in range(dst.num_pages) if p not in DST_PAGES]
    return (
        landed
        and same(dst.k_buffer[:, others], before[0][:, others])
        and same(dst.v_buffer[:, others], before[1][:, others])
    )


def source_rows(dtype: torch.dtype, seed: int) -> torch.Tensor:
    return fill(torch.empty(11, HIDDEN, dtype=dtype), seed)  # [11, HIDDEN]


def rows_landed(
    buffer: EmbeddingBuffer, start: int, before: torch.Tensor, rows: torch.Tensor
) -> bool:
    got = buffer.tensor
    landed = all(same(got[start + d : start + d + n], rows[s : s + n]) for s, d, n in ROW_RUNS)
    written = {start + d + i for _, d, n in ROW_RUNS for i in range(n)}
    others = [r for r in range(buffer.num_rows) if r not in written]
    return landed and same(buffer.tensor[others], before[others])


# --- two processes: the peer knows only the destination ------------------------------


def sender_main(kv_dst: bytes, emb_dst: bytes, dtype_name: str, results) -> None:
    dtype = getattr(torch, dtype_name)
    kv_sender, emb_sender = ShmKVSender(), ShmEmbeddingSender()
    deadline = time.monotonic() + WAIT_S
    kv = kv_sender.send(
        "req-1",
        make_pool(32, dtype, seed=1),
        SRC_PAGES,
        msgspec.msgpack.decode(kv_dst, type=KvDestination),
        deadline,
    )
    emb = emb_sender.send_runs(
        "req-1",
        source_rows(dtype, seed=3),
        ROW_RUNS,
        msgspec.msgpack.decode(emb_dst, type=EmbeddingDestination),
        deadline,
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


@pytest.fixture
def kv_pair():
    receiver, sender = ShmKVReceiver(), ShmKVSender()
    yield receiver, sender
    sender.close()
    receiver.close()


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


def test_segment_is_owner_only_with_an_unguessable_name(kv_pair) -> None:
    receiver, _ = kv_pair
    receiver.register(make_pool(4, torch.float32, seed=0))
    other = ShmKVReceiver()
    other.register(make_pool(4, torch.float32, seed=0))
    try:
        path = segment_path(receiver.session_id)
        info = os.stat(path, follow_symlinks=False)
        assert stat.S_ISREG(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600
        assert info.st_uid == os.geteuid()
        assert info.st_size == 2 * 4 * 4 * 4 * 2 * 8 * 4  # K and V: [4, 4, 4, 2, 8] fp32 each
        names = [decode_session_id(r.session_id).name for r in (receiver, other)]
        tokens = [NAME_RE.fullmatch(name).group(5) for name in names]
        assert (
            all(len(token) == 32 for token in tokens) and tokens[0] != tokens[1]
        )  # 128 random bits
    finally:
        other.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another user needs root")
def test_another_user_cannot_open_the_segment(kv_pair) -> None:
    receiver, _ = kv_pair
    receiver.register(make_pool(4, torch.float32, seed=0))
    path = segment_path(receiver.session_id)
    for flags in (os.O_RDONLY, os.O_RDWR):
        pid = os.fork()
        if pid == 0:  # a process of user "nobody" on the same host
            status = 2
            try:
                os.setgid(65534)
                os.setuid(65534)
                os.close(os.open(path, flags))
                status = 0
            except PermissionError:
                status = 1
            finally:
                os._exit(status)
        assert os.waitpid(pid, 0)[1] >> 8 == 1  # refused with EACCES


def test_a_name_taken_in_advance_is_not_reused(monkeypatch) -> None:
    planted = shm_memory.new_name("kv")
    path = os.path.join(SHM_DIR, planted)
    fd = os.open(
        path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644
    )  # someone created the name first
    os.close(fd)
    monkeypatch.setattr(shm_memory, "new_name", lambda kind: planted)
    try:
        with pytest.raises(FileExistsError):
            ShmSegment("kv", 4096, "a test segment")
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o644  # untouched
    finally:
        os.unlink(path)


def _planted(kind: str) -> tuple[str, str]:
    name = shm_memory.new_name(kind)
    return name, os.path.join(SHM_DIR, name)


def test_peer_refuses_files_that_are_not_an_owners_segment() -> None:
    peers = ShmPeers()
    name, path = _planted("kv")
    with open(path, "wb") as f:
        f.write(bytes(4096))
    try:
        os.chmod(path, 0o644)
        with pytest.raises(UnavailableError, match="has mode 644, not 600"):
            peers.open(name, "a test pool")
        os.chmod(path, 0o600)
        if os.geteuid() == 0:
            os.chown(path, 65534, -1)
            with pytest.raises(UnavailableError, match="not a regular file of this user"):
                peers.open(name, "a test pool")
        os.unlink(path)
        os.symlink("/etc/hostname", path)
        with pytest.raises(UnavailableError, match="cannot open a test pool"):
            peers.open(name, "a test pool")
    finally:
        os.unlink(path)
    assert len(peers) == 0
    bad_ids = (
        "shm:../../etc/passwd@0",
        "shm:stageserve-kv-1-2-3-x@0",
        "127.0.0.1:15000",
        "shm:stageserve-kv@zz",
    )
    for bad in bad_ids:
        with pytest.raises(InvalidRequestError, match="not a shared-memory transfer destination"):
            decode_session_id(bad)


def test_close_unlinks_and_senders_then_fail_unavailable(kv_pair) -> None:
    receiver, sender = kv_pair
    pool = make_pool(8, torch.float32, seed=0)
    receiver.register(pool)
    dst = receiver.destination("req-1", [1])
    src = make_pool(8, torch.float32, seed=1)
    sender.send("req-1", src, [2], dst, time.monotonic() + WAIT_S)  # mapped now
    path = segment_path(receiver.session_id)
    released: list[str] = []
    receiver.open_session(
        "req-2", [3], time.monotonic() + WAIT_S, lambda rid, _: released.append(rid)
    )
    receiver.close()
    assert not os.path.exists(path) and released == [
        "req-2"
    ]  # live sessions aborted, pages released
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


# --- owners that exit -----------------------------------------------------------------

OWNER = """
import sys, time, torch
from services.engine.kv_cache import KVPool
from services.transfer.shm_backend import ShmKVReceiver
receiver = ShmKVReceiver()
receiver.register(KVPool(2, 4, 4, 2, 8, torch.float32, "cpu"))
print(receiver.session_id, flush=True)
if sys.argv[1] == "wait":
    time.sleep(600)
"""


def pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def start_owner(how: str) -> tuple[subprocess.Popen, str]:
    command = [sys.executable, "-c", OWNER, how]
    owner = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, text=True)
    return owner, segment_path(owner.stdout.readline().strip())


@pytest.mark.slow
def test_an_owner_that_exits_or_is_killed_leaves_no_file() -> None:
    owner, path = start_owner("exit")  # exits without close(): the finalizer unlinks at exit
    assert owner.wait(timeout=WAIT_S) == 0 and not os.path.exists(path)
    owner, path = start_owner("wait")
    try:
        assert os.path.exists(path)
        os.kill(owner.pid, signal.SIGKILL)  # nothing runs in the owner: its reaper removes the name
        owner.wait(timeout=WAIT_S)
        deadline = time.monotonic() + WAIT_S
        while os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(path)
    finally:
        owner.kill()
        owner.wait(timeout=WAIT_S)


def test_sweep_removes_only_files_of_owners_that_no_longer_run() -> None:
    live = ShmSegment("kv", 4096, "a test segment")
    kind, namespace, pid, start, token = NAME_RE.fullmatch(live.name).groups()
    stale = (
        f"stageserve-{kind}-{namespace}-{pid}-{int(start) + 1}-{token}"  # this pid, another process
    )
    foreign = (
        f"stageserve-{kind}-{int(namespace) + 1}-{pid}-0-{token}"  # a pid of another namespace
    )
    for name in (stale, foreign):
        os.close(os.open(os.path.join(SHM_DIR, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    try:
        removed = shm_memory.sweep_stale_segments()
        assert stale in removed and live.name not in removed and foreign not in removed
        assert os.path.exists(live.path) and os.path.exists(os.path.join(SHM_DIR, foreign))
    finally:
        os.unlink(os.path.join(SHM_DIR, foreign))
        live.close()


def test_a_forked_child_does_not_unlink_its_parents_segment() -> None:
    segment = ShmSegment("emb", 4096, "a test segment")
    assert segment.reaper_pid is not None and pid_running(segment.reaper_pid)
    try:
        pid = os.fork()
        if pid == 0:  # what the finalizer does at the child's exit
            segment._release()
            os._exit(0)
        assert os.waitpid(pid, 0)[1] == 0
        assert os.path.exists(segment.path)
    finally:
        segment.close()
    assert not os.path.exists(segment.path) and not pid_running(
        segment.reaper_pid
    )  # reaper waited for
