"""The Mooncake store's master for the prefix cache's shared KV store (``kv_store.KvStore``
clients connect to it): ``start_master`` / ``stop_master`` (tests start one), and
``python -m services.prefill.kv_store_master``, the child ``stageserve up --kv-store-gb``
supervises.

That process starts ``mooncake_master`` on loopback (``MASTER_HOST``) as its own child, killed
with it (``PR_SET_PDEATHSIG``), serves gRPC health (liveness) on ``--host``/``--port`` and prints
``READY prefill.kv_store_master port=<grpc> metrics_port=<the master's /metrics>
master_port=<its RPC port> master_pid=<pid>``; the master logs to this process's stderr.
SIGTERM / SIGINT: the master is stopped, exit 0. The master exiting by itself ends this
process with 1, so ``up`` restarts both on the same ports (the master starts empty; its clients
reconnect and mount their segments again). Loads no torch.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import importlib.util
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from services.common.auth import Credentials
from services.common.envs import Envs
from services.common.errors import UnavailableError
from services.common.server import HealthState, create_server, serve_until_signal
from services.common.service_main import (
    ServiceConfig,
    build_service_parser,
    internal_credentials_or_exit,
    print_ready,
    setup_logging,
)
from services.common.settings import config_from_args, flag, port_number

logger = logging.getLogger(__name__)

MASTER_HOST = "127.0.0.1"  # the master serves this host's prefill workers only
SERVICE = "prefill.kv_store_master"  # the READY line's name: ``python -m services.<SERVICE>``
WATCH_INTERVAL_S = 0.2
STDERR_FD = 2
_PR_SET_PDEATHSIG = 1


def master_binary() -> Path:
    """The ``mooncake_master`` executable shipped in the ``mooncake`` package (the console
    script of the same name only ``exec``s it), else the one on ``PATH``."""
    spec = importlib.util.find_spec("mooncake")  # locates the package without importing it
    if spec is not None and spec.origin is not None:
        path = Path(spec.origin).parent / "mooncake_master"
        if path.is_file() and os.access(path, os.X_OK):
            return path
    found = shutil.which("mooncake_master")
    if found is None:
        from services.prefill.kv_store_calls import INSTALL_HINT  # imports torch

        raise FileNotFoundError(f"mooncake_master not found: {INSTALL_HINT}")
    return Path(found)


def start_master(
    port: int,
    *,
    host: str = "127.0.0.1",
    metrics_port: int = 0,
    client_ttl_s: int = 10,
    lease_ttl_ms: int = 10_000,
    eviction_high_watermark: float = 0.9,
    eviction_ratio: float = 0.05,
    log_path: Path | None = None,
    ready_timeout_s: float = 10.0,
    die_with_parent: bool = False,
    extra_args: Sequence[str] = (),
) -> subprocess.Popen[bytes]:
    """Start ``mooncake_master`` serving clients on ``host:port`` and return once it accepts
    connections (within ``ready_timeout_s``, else it is stopped and this raises).

    ``metrics_port``: its HTTP metrics/admin port on ``host`` (0: any free one).
    ``client_ttl_s``: how long a client that stopped pinging keeps its segment (and the pages
    there) listed. ``lease_ttl_ms``: Mooncake's lease, for which a page just read or put is
    not evicted. ``eviction_high_watermark``/``eviction_ratio``: when the segments are that
    full, the master evicts that fraction of the pages. ``log_path``: its log (glog, to
    stderr), else this process's stderr. ``die_with_parent``: it is SIGKILLed when the
    calling thread ends (call it from the main thread). ``KvStoreUnavailableError`` when the
    port is taken, the master exits, or it does not listen in time.
    """
    probe = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))
    except OSError as exc:
        raise _unavailable(f"mooncake master port {host}:{port}: {exc}") from exc
    finally:
        probe.close()
    args = [
        str(master_binary()),
        f"--rpc_address={host}",
        f"--rpc_port={port}",
        f"--metrics_host={host}",
        f"--metrics_port={metrics_port}",
        f"--client_ttl={client_ttl_s}",
        f"--default_kv_lease_ttl={lease_ttl_ms}",
        f"--eviction_high_watermark_ratio={eviction_high_watermark}",
        f"--eviction_ratio={eviction_ratio}",
        "--logtostderr",  # glog would otherwise write files under /tmp
        *extra_args,
    ]
    log = open(log_path, "ab") if log_path is not None else STDERR_FD  # noqa: SIM115
    try:
        proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            preexec_fn=functools.partial(_die_with, os.getpid()) if die_with_parent else None,
        )
    finally:
        if log_path is not None:
            log.close()  # the child holds its own descriptor
    deadline = time.monotonic() + ready_timeout_s
    while True:
        if proc.poll() is not None:
            raise _unavailable(
                f"mooncake_master exited with {proc.returncode} before listening on "
                f"{host}:{port}{_log_tail(log_path)}"
            )
        try:
            socket.create_connection((host, port), 0.2).close()
            return proc
        except OSError:
            pass
        if time.monotonic() > deadline:
            stop_master(proc)
            raise _unavailable(
                f"mooncake_master did not listen on {host}:{port} within {ready_timeout_s} s"
                f"{_log_tail(log_path)}"
            )
        time.sleep(0.05)


def stop_master(proc: subprocess.Popen[bytes], timeout_s: float = 5.0) -> int:
    """SIGTERM, then SIGKILL after ``timeout_s``; its exit status."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def lent_bytes(metrics_port: int, timeout_s: float = 5.0) -> int:
    """The memory the store's clients lend it: ``master_total_capacity_bytes`` on the /metrics
    of the master at ``MASTER_HOST``; ``OSError`` when it does not answer."""
    url = f"http://{MASTER_HOST}:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=timeout_s) as reply:
        text = reply.read().decode()
    match = re.search(r"^master_total_capacity_bytes (\S+)$", text, re.M)
    return int(float(match.group(1))) if match else 0


def _die_with(parent_pid: int) -> None:
    """In the child, before ``exec``: SIGKILL when the parent's forking thread ends."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before prctl
        os._exit(1)


def _unavailable(message: str) -> UnavailableError:
    from services.prefill.kv_store_calls import KvStoreUnavailableError  # imports torch

    return KvStoreUnavailableError(message)


def _log_tail(log_path: Path | None, chars: int = 1500) -> str:
    if log_path is None:
        return ""
    try:
        return f"; its log ends: {log_path.read_text(errors='replace')[-chars:]}"
    except OSError:
        return ""


# --- python -m services.prefill.kv_store_master


@dataclass(frozen=True)
class KvStoreMasterConfig(ServiceConfig):
    """The master's process: ``port`` serves gRPC health, ``metrics_port`` is the master's own
    Prometheus /metrics on ``MASTER_HOST`` (0, here and for ``master_port``: a free one)."""

    master_port: int = flag(
        0,
        type=port_number,
        help=f"the master's RPC port on {MASTER_HOST} (0: a free one, on the READY line)",
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((MASTER_HOST, 0))
        return s.getsockname()[1]


async def _serve(
    config: KvStoreMasterConfig,
    auth: Credentials | None,
    master: subprocess.Popen[bytes],
    ports: dict[str, int],
) -> int:
    """Serve health until a signal (0) or the master's exit (1)."""
    health = HealthState()
    server, port = create_server(
        [], config.port, config.host, health=health, auth=auth, enable_reflection=False
    )
    await server.start()
    health.set_serving(True)
    logger.info("mooncake_master (pid %d) on %s:%d", master.pid, MASTER_HOST, ports["master"])
    print_ready(
        SERVICE,
        port=port,
        metrics_port=ports["metrics"],
        master_port=ports["master"],
        master_pid=master.pid,
    )
    stop = asyncio.Event()

    async def watch() -> None:
        while master.poll() is None:
            await asyncio.sleep(WATCH_INTERVAL_S)
        stop.set()

    watcher = asyncio.ensure_future(watch())
    try:
        await serve_until_signal(server, health, stop=stop)
    finally:
        watcher.cancel()
    if master.poll() is not None:
        logger.error("mooncake_master exited with code %d", master.returncode)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    envs = Envs.from_environ()
    parser = build_service_parser(
        f"python -m services.{SERVICE}",
        "mooncake_master on loopback, supervised (stageserve up --kv-store-gb)",
        KvStoreMasterConfig,
        runs_model=False,
        envs=envs,
    )
    config = config_from_args(KvStoreMasterConfig, parser.parse_args(argv))
    setup_logging("kv_store_master", config.log_level, config.log_format)
    auth = internal_credentials_or_exit(
        "kv_store_master", envs, config.internal_token_file, config.allow_unauthenticated
    )
    ports = {"master": config.master_port or _free_port()}
    ports["metrics"] = config.metrics_port or _free_port()
    try:  # from the main thread: the master lives as long as this process
        master = start_master(
            ports["master"],
            host=MASTER_HOST,
            metrics_port=ports["metrics"],
            die_with_parent=True,
        )
    except (FileNotFoundError, UnavailableError) as exc:
        print(f"kv_store_master: error: {exc}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_serve(config, auth, master, ports))
    finally:
        stop_master(master)


if __name__ == "__main__":
    sys.exit(main())
