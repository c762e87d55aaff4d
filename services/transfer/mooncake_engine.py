"""One Mooncake ``TransferEngine`` in P2P-handshake mode, shared by the KV and embedding backends.

There is no metadata server: a receiver's ``session_id`` is ``"host:rpc_port"``, and a
sender opens the segment on the first write to it. A plan is written in
``batch_transfer_sync_write`` calls of at most ``max_descriptors`` descriptors: the TCP
transport queues at most ``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`` (1024) +
``MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER`` (1024) descriptors per peer and fails a larger
batch outright.

The engine call blocks (GIL released) until the bytes land, the peer fails, or the
engine's own timeout passes (``MC_TRANSFER_TIMEOUT``; a peer that accepts TCP but never
answers the handshake holds it for the engine's own handshake timeout).
``write_within`` runs it on a daemon thread and stops waiting at the caller's deadline, so a
slow peer becomes ``DeadlineExceededError``.

``hostname`` is only the address the engine advertises (its ``session_id``): Mooncake binds
its handshake port and its TCP data port on every interface (0.0.0.0 and [::]) and has no
setting that changes it (MC_TCP_BIND_ADDRESS, MC_LEGACY_RPC_PORT_BINDING, MC_USE_IPV6,
MC_HANDSHAKE_PORT do not), and anyone who reaches them can read and write the registered
memory. Every engine logs that at start (WARNING, with its handshake port), and
``stageserve up`` refuses Mooncake on a loopback ``--host`` (``exposure.check_transfer_exposure``).
Between the processes of one host use the ``shm`` backend; across hosts, fence the ports off
(NetworkPolicy, firewall).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from services.common.errors import DeadlineExceededError, UnavailableError
from services.common.exposure import MOONCAKE_EXPOSURE
from services.transfer.base import TransferPlan

logger = logging.getLogger(__name__)
_INSTALL_HINT = (
    "install mooncake-transfer-engine-non-cuda (CPU) or mooncake-transfer-engine (GPU) "
    "and libibverbs1 librdmacm1 libnuma1"
)


class MooncakeEngine:
    """One ``mooncake.engine.TransferEngine``; C return codes < 0 become ``UnavailableError``."""

    def __init__(
        self, hostname: str = "127.0.0.1", protocol: str = "tcp", device_name: str = ""
    ) -> None:
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:  # the wheel, or a shared library it links (libibverbs, libnuma)
            raise ImportError(
                f"Mooncake transfer backend unavailable ({exc}): {_INSTALL_HINT}"
            ) from exc
        self._engine: Any = TransferEngine()
        _check(
            self._engine.initialize(hostname, "P2PHANDSHAKE", protocol, device_name),
            "initialize",
            hostname,
        )
        rpc_port = self._engine.get_rpc_port()
        self.session_id = f"{hostname}:{rpc_port}"
        self._registered: list[int] = []
        logger.warning(
            "%s (this engine: handshake port %d, advertised as %s)",
            MOONCAKE_EXPOSURE,
            rpc_port,
            hostname,
        )

    def register(self, regions: Sequence[tuple[int, int]]) -> None:
        addrs = [addr for addr, _ in regions]
        _check(
            self._engine.batch_register_memory(addrs, [n for _, n in regions]),
            "register_memory",
            self.session_id,
        )
        self._registered.extend(addrs)

    def unregister(self, addrs: Sequence[int]) -> None:
        """Unregister single regions (per-send registrations) by their start address."""
        _check(
            self._engine.batch_unregister_memory(list(addrs)), "unregister_memory", self.session_id
        )
        gone = set(addrs)
        self._registered = [a for a in self._registered if a not in gone]

    def unregister_all(self) -> None:
        if self._registered:
            _check(
                self._engine.batch_unregister_memory(self._registered),
                "unregister_memory",
                self.session_id,
            )
            self._registered = []

    def write(
        self, peer: str, plan: TransferPlan, max_descriptors: int, stop: threading.Event
    ) -> None:
        """Blocking write of ``plan`` into ``peer``'s memory, ``max_descriptors`` at once."""
        for begin in range(0, plan.num_descriptors, max_descriptors):
            if stop.is_set():  # the caller gave up at its deadline: issue no more batches
                return
            end = begin + max_descriptors
            lengths = list(plan.lengths[begin:end])
            rc = self._engine.batch_transfer_sync_write(
                peer, list(plan.src_addrs[begin:end]), list(plan.dst_addrs[begin:end]), lengths
            )
            _check(rc, f"batch write of {sum(lengths)} bytes in {len(lengths)} descriptors", peer)

    def write_within(
        self,
        peer: str,
        plan: TransferPlan,
        max_descriptors: int,
        timeout_s: float,
        what: str,
        thread_name: str,
        on_done: Callable[[], None] = lambda: None,
    ) -> None:
        """``write`` on a daemon thread, waiting at most ``timeout_s`` seconds for it.

        Raises the write's error, or ``DeadlineExceededError`` naming ``what`` (``"KV transfer
        for req-1"``) when the wait runs out; the abandoned write then issues no more batches.
        ``on_done`` runs on that thread once the engine call returns, even after the caller gave up.
        """
        errors: list[BaseException] = []
        done, stop = threading.Event(), threading.Event()

        def run() -> None:
            try:
                self.write(peer, plan, max_descriptors, stop)
            except BaseException as exc:  # handed to the waiting caller below
                errors.append(exc)
            finally:
                on_done()
                done.set()

        threading.Thread(target=run, name=thread_name, daemon=True).start()
        if not done.wait(timeout_s):
            stop.set()
            raise DeadlineExceededError(
                f"{what} to {peer} did not finish before its deadline "
                f"({plan.num_bytes} bytes); the peer is slow or unreachable"
            )
        if errors:
            raise errors[0]


def _check(rc: int, what: str, peer: str) -> None:
    if rc < 0:
        raise UnavailableError(f"mooncake {what} failed for {peer} (rc={rc})")
