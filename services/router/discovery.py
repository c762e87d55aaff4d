"""Worker discovery: the router's workers follow DNS while it runs.

Each kind's addresses (``WorkerAddresses``) are ``host:port`` (static: a worker for as long as
the router runs) or ``dns:///name:port`` (every address the name resolves to, each a worker; a
Kubernetes headless Service's name resolves to each of its ready pods). Every interval
``refresh`` resolves each name through a ``BaseResolver`` and makes the registry's members
match:

  joined   -> an address in the answer the registry lacks: a new worker (UNKNOWN, not routed),
              checked at once, so it serves from the end of the refresh that found it if its
              health check passes, and later polls decide as for any worker
  left     -> a worker whose address no answer holds any more: no new request goes to it; the
              requests on it finish, or fail over / fail through their own bounded calls
              (``placement.py``, the stall bound), so none hangs
  dropped  -> a leaving worker that held no request for ``LEAVE_GRACE_S``: forgotten, its
              channels closed
  back     -> a leaving worker whose address is answered again joins again (checked first)

A failed resolution (timeout, a server error) keeps the name's last answer; a name that does
not exist or has no address (a Service with no ready pod) answers no workers.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable, Mapping, Sequence

from services.router.placement import ABORT_TIMEOUT_S
from services.router.registry import WorkerRegistry
from services.router.workers import DnsName, Worker, WorkerKind, parse_dns_name

logger = logging.getLogger(__name__)

RESOLVE_TIMEOUT_S = 10.0  # a resolution that takes longer keeps the name's last answer
LEAVE_GRACE_S = 2 * ABORT_TIMEOUT_S  # a leaving worker's last Aborts run on its channel
_NO_ADDRESS = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}


class BaseResolver(abc.ABC):
    @abc.abstractmethod
    async def resolve(self, name: DnsName) -> tuple[str, ...]:
        """Every ``host:port`` worker address ``name`` stands for now, () when it has none.

        Raises ``OSError`` when the answer is unknown now (the caller keeps the last one).
        """


class SystemResolver(BaseResolver):
    """The system resolver (``getaddrinfo``: /etc/hosts, then the cluster's DNS)."""

    async def resolve(self, name: DnsName) -> tuple[str, ...]:
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(name.host, name.port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            if exc.errno in _NO_ADDRESS:
                return ()
            raise
        hosts = {str(info[4][0]) for info in infos}
        return tuple(
            sorted(f"[{h}]:{name.port}" if ":" in h else f"{h}:{name.port}" for h in hosts)
        )


class WorkerDiscovery:
    """Keeps the registry's members those of the static addresses and the names' answers."""

    def __init__(
        self,
        registry: WorkerRegistry,
        addresses: Mapping[WorkerKind, Sequence[str]],
        make_worker: Callable[[WorkerKind, str], Worker],
        resolver: BaseResolver,
        interval_s: float,
        leave_grace_s: float = LEAVE_GRACE_S,
    ) -> None:
        """``addresses``: each kind's configured ones; the static ones are the registry's
        already."""
        assert interval_s > 0
        self._registry = registry
        self._make_worker = make_worker
        self._resolver = resolver
        self.interval_s = interval_s
        self._leave_grace_s = leave_grace_s
        self._static = {
            kind: {a for a in kind_addresses if parse_dns_name(a) is None}
            for kind, kind_addresses in addresses.items()
        }
        self._names = {
            kind: [n for a in kind_addresses if (n := parse_dns_name(a)) is not None]
            for kind, kind_addresses in addresses.items()
        }
        self._answers: dict[DnsName, tuple[str, ...]] = {}
        self.num_refreshes = 0  # refreshes completed (tests wait on it)
        self._task: asyncio.Task | None = None

    @property
    def has_names(self) -> bool:
        return any(self._names.values())

    async def refresh(self) -> None:
        """Resolve every name once, add, retire and readmit workers, and check the new ones."""
        names = {n for kind_names in self._names.values() for n in kind_names}
        await asyncio.gather(*(self._resolve(n) for n in names))
        joined: list[Worker] = []
        for kind, kind_names in self._names.items():
            if kind_names:
                wanted = self._static[kind].union(*(self._answers.get(n, ()) for n in kind_names))
                joined += self._update(kind, wanted)
        if joined:
            await self._registry.poll_once(joined)
        await self._registry.drop_idle(self._leave_grace_s)
        self.num_refreshes += 1

    async def _resolve(self, name: DnsName) -> None:
        try:
            async with asyncio.timeout(RESOLVE_TIMEOUT_S):
                answer = await self._resolver.resolve(name)
        except (OSError, TimeoutError) as exc:
            logger.warning("resolving %s failed (%s); keeping its last answer", name, exc)
            return
        if answer != self._answers.get(name):
            logger.info("%s resolves to %s", name, ", ".join(answer) or "nothing")
        self._answers[name] = answer

    def _update(self, kind: WorkerKind, wanted: set[str]) -> list[Worker]:
        current = {w.address: w for w in self._registry.workers(kind)}
        joined = []
        for address in sorted(wanted):
            worker = current.get(address)
            if worker is None or worker.is_leaving:
                worker = worker or self._make_worker(kind, address)
                self._registry.join(worker)
                joined.append(worker)
        for address, worker in current.items():
            if address not in wanted and not worker.is_leaving:
                self._registry.leave(worker)
        return joined

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.refresh()
            except Exception:  # the loop's last resort: dead, membership would freeze
                logger.exception("worker discovery round failed")

    def start(self) -> None:
        """Refresh every ``interval_s`` until ``close`` (when any address is a name)."""
        assert self._task is None, "already started"
        if self.has_names:
            self._task = asyncio.create_task(self._refresh_forever(), name="router-discovery")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
