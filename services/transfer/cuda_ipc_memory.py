"""CUDA IPC memory shared by the KV and embedding backends: export an allocation, map it elsewhere.

The owner (decode for its KV pool, prefill for its embedding buffer) exports each allocation
once (``export_buffer``) and publishes it in a destination's ``session_id``
(``encode_session``: a prefix and a base64 msgpack struct); the writer decodes it
(``decode_session``: ``InvalidRequestError`` for anything ``encode_session`` did not make),
checks that it can reach the owner's GPU (``peer_index``) and maps the allocation into its
own GPU once (``open_buffer``), then writes with device copies. Both processes must see both
GPUs (no disjoint ``CUDA_VISIBLE_DEVICES``), and the GPUs must be peers. An export can name
its owner process (``OwnerProcess``) so that a writer refuses memory whose owner has exited.
"""

from __future__ import annotations

import base64
import os
from collections.abc import Sequence
from typing import Any, TypeVar

import msgspec
import torch

from services.common.errors import InvalidRequestError, UnavailableError
from services.transfer.base import PublishedSession
from services.transfer.shm_memory import pid_namespace, process_start_time

T = TypeVar("T")


class IpcBuffer(msgspec.Struct, frozen=True, array_like=True):
    """One exported CUDA allocation (the fields of torch's ``UntypedStorage._share_cuda_``)."""

    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None


class OwnerProcess(msgspec.Struct, frozen=True, array_like=True):
    """The process that exported an allocation: its pid namespace, pid and start time."""

    pid_namespace: int
    pid: int
    start_time: int | None  # clock ticks after boot; None where /proc cannot tell

    @classmethod
    def this_process(cls) -> OwnerProcess:
        pid = os.getpid()
        return cls(pid_namespace(), pid, process_start_time(pid))

    def has_exited(self) -> bool:
        """True once this process is gone; False while it runs or when this process cannot tell
        (another pid namespace, no /proc)."""
        if self.start_time is None or self.pid_namespace != pid_namespace():
            return False
        return process_start_time(self.pid) != self.start_time


def encode_session(prefix: str, exported: msgspec.Struct) -> str:
    return prefix + base64.urlsafe_b64encode(msgspec.msgpack.encode(exported)).decode("ascii")


def decode_session(prefix: str, session_id: str, kind: type[T], what: str) -> T:
    """The ``kind`` struct in ``session_id``; ``InvalidRequestError`` naming ``what`` otherwise."""
    if not session_id.startswith(prefix):
        raise InvalidRequestError(f"not a {what}: {session_id[:64]!r}")
    try:
        return msgspec.msgpack.decode(
            base64.urlsafe_b64decode(session_id[len(prefix) :]), type=kind
        )
    except (ValueError, msgspec.DecodeError) as exc:
        raise InvalidRequestError(f"malformed {what}: {exc}") from exc


def device_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def export_buffer(buf: torch.Tensor) -> IpcBuffer:
    assert buf.is_cuda and buf.is_contiguous() and buf.storage_offset() == 0
    _, handle, size, offset, ref_handle, ref_offset, event_handle, _ = (
        buf.untyped_storage()._share_cuda_()
    )
    return IpcBuffer(handle, size, offset, ref_handle, ref_offset, event_handle)


def open_buffer(
    buf: IpcBuffer, shape: Sequence[int], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Map an exported allocation into ``device``'s context (peer memory if on another GPU).

    torch maps a handle once per process; opening it again returns the same memory.
    """
    storage = torch.UntypedStorage._new_shared_cuda(
        device.index,
        buf.handle,
        buf.storage_size_bytes,
        buf.storage_offset_bytes,
        buf.ref_counter_handle,
        buf.ref_counter_offset,
        buf.event_handle,
        False,  # no event wait: the owner synchronized before exporting
    )
    return torch.empty(0, dtype=dtype, device=device).set_(storage, 0, tuple(shape))


def peer_index(owner_uuid: str, device: torch.device, what: str) -> int:
    """The index here of the owner's GPU; ``UnavailableError`` naming ``what`` when ``device``
    cannot write into it."""
    index = visible_index(owner_uuid)
    if index is None:
        raise UnavailableError(f"{what}'s GPU {owner_uuid} is not visible to this process")
    if index != device.index and not torch.cuda.can_device_access_peer(device.index, index):
        raise UnavailableError(f"GPU {device.index} cannot access {what}'s GPU {index} as a peer")
    return index


def visible_index(uuid: str) -> int | None:
    for index in range(torch.cuda.device_count()):
        if device_uuid(torch.device("cuda", index)) == uuid:
            return index
    return None


class IpcReceiver(PublishedSession):
    """Receiver mixin of the CUDA IPC backends: ``register`` exports and publishes the memory."""

    backend = "cuda_ipc"

    def _unregister_memory(self, memory: Any) -> None:
        del memory  # its owner keeps using it while shutting down; it goes with the process
        self._session_id = None
