"""The shm transfer backend's segments: owner-only files with unguessable names, refused
impostors, and no file left behind by an owner that exits."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time

import pytest
import torch

from services.common.errors import InvalidRequestError, UnavailableError
from services.transfer import shm_memory
from services.transfer.shm_backend import ShmKVReceiver
from services.transfer.shm_memory import NAME_RE, SHM_DIR, ShmPeers, ShmSegment, decode_session_id
from tests.conftest import REPO
from tests.transfer.shm_helpers import (
    WAIT_S,
    make_pool,
    segment_path,
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
        deadline_mono = time.monotonic() + WAIT_S
        while os.path.exists(path) and time.monotonic() < deadline_mono:
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
