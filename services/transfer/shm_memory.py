"""Shared-memory segments in /dev/shm: an owner creates and unlinks, peers of its user map them.

Lifecycle of one segment (decode owns its KV pool's, prefill its embedding buffer's):

  owner: segment = ShmSegment("kv", num_bytes)    O_CREAT|O_EXCL|O_NOFOLLOW, mode 0600, an
         unguessable name; the bytes are reserved up front (a full /dev/shm fails here, not
         as SIGBUS on a later write); ``segment.tensor`` is the zeroed mapping
         session_id = encode_session_id(ShmRef(segment.name, base_address))   (KvRef, EmbeddingRef)
  peer:  peers.open(ref.name) maps the file once (LRU of ``max_peers``) after checking it is a
         regular file of this user with mode 0600, then writes into it with torch copies
  owner: segment.close() unlinks the name (also at interpreter exit); mappings already made
         stay valid until they are dropped, so a peer in the middle of a write never faults

Naming rule: ``stageserve-<kind>-<pid namespace>-<pid>-<start time>-<128 random bits>``. A name
lives exactly as long as its owner process, since any peer may still have to open it (a
restarted prefill reopens decode's pool). For an owner that cannot unlink (SIGKILL, OOM kill)
a reaper does: a ``/bin/sh`` started with the segment blocks reading a pipe only the owner
holds and removes the name at end of file, which comes when the owner closes the segment or
dies however it dies. Should the reaper die too, every new segment, and
``sweep_stale_segments``, removes this user's files whose owner (same pid namespace, pid and
start time) no longer runs. A peer's open file or mapping keeps the memory alive after the
unlink; it is freed when the last one goes.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import secrets
import stat
import subprocess
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import msgspec
import torch

from services.common.errors import CapacityError, InvalidRequestError, UnavailableError
from services.transfer.base import PublishedSession

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
SESSION_PREFIX = "shm:"
MAX_PEERS = (
    16  # owners' segments kept mapped per peer; the least recently used is unmapped beyond it
)
KINDS = ("kv", "emb")
NAME_RE = re.compile(r"stageserve-(kv|emb)-([0-9]+)-([0-9]+)-([0-9]+)-([0-9a-f]{32})")
SESSION_RE = re.compile(rf"{SESSION_PREFIX}(stageserve-[a-z0-9-]+)@([0-9a-f]+)")
_OWNER_ONLY = 0o600


class ShmRef(msgspec.Struct, frozen=True):
    """What a destination's ``session_id`` names: the owner's segment and where it maps it."""

    name: str  # file name in SHM_DIR
    base_address: int  # address of the segment's first byte in the owner's process


def encode_session_id(ref: ShmRef) -> str:
    return f"{SESSION_PREFIX}{ref.name}@{ref.base_address:x}"


def decode_session_id(session_id: str) -> ShmRef:
    """The segment ``session_id`` names; ``InvalidRequestError`` unless ``encode_session_id``'s.

    The name must match ``NAME_RE`` exactly: a peer never opens a path it was sent.
    """
    match = SESSION_RE.fullmatch(session_id)
    if match is None or NAME_RE.fullmatch(match.group(1)) is None:
        raise InvalidRequestError(f"not a shared-memory transfer destination: {session_id[:96]!r}")
    return ShmRef(match.group(1), int(match.group(2), 16))


def pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def process_start_time(pid: int) -> int | None:
    """Clock ticks after boot at which ``pid`` started; None when no such process runs."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    return int(text.rsplit(")", 1)[1].split()[19])  # field 22; the command name may hold spaces


def new_name(kind: str) -> str:
    assert kind in KINDS, kind
    pid = os.getpid()
    return (
        f"stageserve-{kind}-{pid_namespace()}-{pid}-{process_start_time(pid)}-"
        f"{secrets.token_hex(16)}"
    )


def sweep_stale_segments() -> list[str]:
    """Unlink this user's segments whose owner is gone (killed before it could); their names."""
    removed: list[str] = []
    if (
        process_start_time(os.getpid()) is None
    ):  # no /proc to tell a live owner from a dead one: keep all
        return removed
    namespace, uid = pid_namespace(), os.geteuid()
    for entry in os.scandir(SHM_DIR):
        match = NAME_RE.fullmatch(entry.name)
        if match is None or int(match.group(2)) != namespace:  # another namespace's pid: unknowable
            continue
        try:
            if entry.stat(follow_symlinks=False).st_uid != uid:
                continue
        except FileNotFoundError:
            continue
        if process_start_time(int(match.group(3))) == int(match.group(4)):
            continue  # the owner still runs
        try:
            os.unlink(entry.path)
        except FileNotFoundError:
            continue
        removed.append(entry.name)
    return removed


# The reaper's script: block until the pipe on stdin reaches end of file, then remove the name ($1).
_REAPER_SCRIPT = 'read -r _; rm -f -- "$1"'


def _start_reaper(path: str) -> tuple[subprocess.Popen | None, int | None]:
    """A process that unlinks ``path`` once the returned pipe end is closed in every process."""
    read_end, write_end = os.pipe()  # neither is inherited by programs this process starts later
    try:
        reaper = subprocess.Popen(
            ["/bin/sh", "-c", _REAPER_SCRIPT, "stageserve-shm-reaper", path],
            stdin=read_end,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C to the service's process group leaves it to finish
        )
    except OSError as exc:
        os.close(write_end)
        logger.warning(
            "no reaper for %s (%s): a killed owner leaves it to the next sweep", path, exc
        )
        return None, None
    finally:
        os.close(read_end)
    return reaper, write_end


def _release(
    path: str, owner_pid: int, reaper: subprocess.Popen | None, pipe_end: int | None
) -> None:
    """Unlink ``path`` in its owner only (a forked child exiting leaves its parent's alone)."""
    if pipe_end is not None:
        os.close(
            pipe_end
        )  # this process's copy: the reaper sees end of file once every copy is gone
    if os.getpid() != owner_pid:
        return
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    if reaper is not None:
        try:
            reaper.wait(timeout=5)  # it exits at once (end of file, nothing left to remove)
        except subprocess.TimeoutExpired:
            logger.warning("the reaper of %s did not exit", path)


class ShmSegment:
    """A zeroed ``num_bytes`` file in ``SHM_DIR`` this process made and maps; ``close`` unlinks."""

    def __init__(self, kind: str, num_bytes: int, what: str) -> None:
        """``what`` names the memory in errors ("decode's KV pool")."""
        assert num_bytes > 0
        sweep_stale_segments()
        self.name = new_name(kind)
        self.path = os.path.join(SHM_DIR, self.name)
        self.num_bytes = num_bytes
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(self.path, flags, _OWNER_ONLY)
        try:
            os.fchmod(fd, _OWNER_ONLY)  # the umask may only have narrowed it; state it exactly
            _reserve(fd, num_bytes, what)
            memory = _map(fd, num_bytes)
        except BaseException:
            os.unlink(self.path)
            raise
        finally:
            os.close(fd)  # the mapping holds the file
        self.tensor = torch.frombuffer(memory, dtype=torch.uint8)  # [num_bytes]; holds the mapping
        reaper, pipe_end = _start_reaper(self.path)
        self.reaper_pid = None if reaper is None else reaper.pid
        # runs at close(), when the segment is collected, or at interpreter exit
        self._release = weakref.finalize(self, _release, self.path, os.getpid(), reaper, pipe_end)

    def close(self) -> None:
        """Unlink the name: no new peer can open it. Mappings (``tensor`` and peers') stay valid."""
        self._release()


def _reserve(fd: int, num_bytes: int, what: str) -> None:
    try:
        os.posix_fallocate(fd, 0, num_bytes)
    except OSError as exc:
        free = os.statvfs(SHM_DIR)
        raise CapacityError(
            f"{what} needs {num_bytes / 2**20:.0f} MiB in {SHM_DIR} for the shm transfer backend, "
            f"{free.f_bavail * free.f_frsize / 2**20:.0f} MiB are free ({exc.strerror}): enlarge "
            f"{SHM_DIR} (docker --shm-size; Kubernetes: an emptyDir with medium Memory) "
            "or make the "
            "buffer smaller"
        ) from exc


class PeerMapping:
    """An owner's segment mapped in this process: ``tensor`` is ``[num_bytes]`` uint8."""

    def __init__(self, name: str, fd: int, tensor: torch.Tensor) -> None:
        self.name, self.fd, self.tensor = name, fd, tensor

    @property
    def num_bytes(self) -> int:
        return self.tensor.numel()

    def is_unlinked(self) -> bool:
        return os.fstat(self.fd).st_nlink == 0


class ShmPeers:
    """Owners' segments this process writes into, each mapped once, least recently used first.

    Thread-safe.
    """

    def __init__(self, max_peers: int = MAX_PEERS) -> None:
        assert max_peers > 0
        self.max_peers = max_peers
        self._lock = threading.Lock()
        self._mappings: OrderedDict[str, PeerMapping] = OrderedDict()

    def open(self, name: str, what: str) -> PeerMapping:
        """The mapping of segment ``name``; ``UnavailableError`` once unlinked (closed, swept).

        ``what`` names the memory in errors ("decode's KV pool"). A file that is not a regular
        file of this user with mode 0600 is refused (``UnavailableError``) before it is mapped.
        """
        with self._lock:
            mapping = self._mappings.get(name)
            if (
                mapping is None
            ):  # a new owner, maybe one restarted: let go of segments already unlinked
                for gone in [m for m in self._mappings.values() if m.is_unlinked()]:
                    os.close(self._mappings.pop(gone.name).fd)
                mapping = self._mappings[name] = _open_mapping(name, what)
                while len(self._mappings) > self.max_peers:
                    os.close(
                        self._mappings.popitem(last=False)[1].fd
                    )  # unmapped once no copy uses it
            self._mappings.move_to_end(name)
            if mapping.is_unlinked():  # the owner closed the segment or a sweep removed it
                os.close(self._mappings.pop(name).fd)
                raise UnavailableError(f"{what} ({name}) was closed by its owner")
        return mapping

    def __len__(self) -> int:
        with self._lock:
            return len(self._mappings)

    def close(self) -> None:
        with self._lock:
            for mapping in self._mappings.values():
                os.close(mapping.fd)
            self._mappings.clear()


def _open_mapping(name: str, what: str) -> PeerMapping:
    path = os.path.join(SHM_DIR, name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError as exc:
        raise UnavailableError(
            f"{what} ({name}) no longer exists: its owner closed it or exited"
        ) from exc
    except OSError as exc:  # ELOOP for a symbolic link, EACCES for another user's file
        raise UnavailableError(f"cannot open {what} ({name}): {exc.strerror}") from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            raise UnavailableError(f"{what} ({name}) is not a regular file of this user")
        if stat.S_IMODE(info.st_mode) != _OWNER_ONLY:
            raise UnavailableError(
                f"{what} ({name}) has mode {stat.S_IMODE(info.st_mode):o}, not 600"
            )
        if info.st_size == 0:
            raise UnavailableError(f"{what} ({name}) is empty")
        memory = _map(fd, info.st_size)
    except BaseException:
        os.close(fd)
        raise
    return PeerMapping(name, fd, torch.frombuffer(memory, dtype=torch.uint8))


def _map(fd: int, num_bytes: int) -> mmap.mmap:
    return mmap.mmap(fd, num_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def typed_view(
    mapping: torch.Tensor, offset: int, shape: tuple[int, ...], dtype: torch.dtype, what: str
) -> torch.Tensor:
    """``mapping[offset:]`` (uint8) seen as a contiguous ``shape`` tensor of ``dtype``.

    ``InvalidRequestError`` naming ``what`` when that span is misaligned or runs past the mapping.
    """
    num_bytes = dtype.itemsize
    for size in shape:
        num_bytes *= size
    if offset < 0 or offset % dtype.itemsize or offset + num_bytes > mapping.numel():
        raise InvalidRequestError(
            f"{what}: {num_bytes} bytes at offset {offset} do not fit the "
            f"{mapping.numel()}-byte shared segment"
        )
    return mapping[offset : offset + num_bytes].view(dtype).view(shape)


class ShmReceiver(PublishedSession):
    """Receiver mixin of the shm backends: ``register`` moves the memory into an owned segment."""

    backend = "shm"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._segment: ShmSegment | None = None

    def _own_segment(
        self, kind: str, num_bytes: int, what: str, move: Callable[[ShmSegment], int]
    ) -> None:
        """Create the segment and publish it; ``move`` moves the memory in, returning its base.

        The segment is closed again when ``move`` raises.
        """
        segment = ShmSegment(kind, num_bytes, what)
        try:
            base_address = move(segment)
        except BaseException:
            segment.close()
            raise
        self._segment = segment
        self._session_id = encode_session_id(ShmRef(segment.name, base_address))

    def _unregister_memory(self, memory: Any) -> None:
        del memory  # it keeps its mapping: its owner may still read it while shutting down
        if self._segment is not None:
            self._segment.close()
            self._segment = None
        self._session_id = None


class ShmSender:
    """Sender mixin of the shm backends: owners' segments mapped once (LRU of ``max_peers``)."""

    backend = "shm"

    def __init__(self, max_peers: int = MAX_PEERS) -> None:
        self._peers = ShmPeers(max_peers)

    def close(self) -> None:
        self._peers.close()
