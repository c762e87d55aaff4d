"""The Mooncake store's master process for the prefix cache's shared KV store (tests and
deployments start one; ``kv_store.KvStore`` clients connect to it)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from services.prefill.kv_store_calls import INSTALL_HINT, KvStoreUnavailableError


def master_binary() -> Path:
    """The ``mooncake_master`` executable shipped in the ``mooncake`` package (the console
    script of the same name only ``exec``s it), else the one on ``PATH``."""
    spec = importlib.util.find_spec("mooncake")
    if spec is not None and spec.origin is not None:
        path = Path(spec.origin).parent / "mooncake_master"
        if path.is_file() and os.access(path, os.X_OK):
            return path
    found = shutil.which("mooncake_master")
    if found is None:
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
    extra_args: Sequence[str] = (),
) -> subprocess.Popen[bytes]:
    """Start ``mooncake_master`` serving clients on ``host:port`` and return once it accepts
    connections (within ``ready_timeout_s``, else it is stopped and this raises).

    ``metrics_port``: its HTTP metrics/admin port on ``host`` (0: any free one).
    ``client_ttl_s``: how long a client that stopped pinging keeps its segment (and the pages
    there) listed. ``lease_ttl_ms``: Mooncake's lease, for which a page just read or put is
    not evicted. ``eviction_high_watermark``/``eviction_ratio``: when the segments are that
    full, the master evicts that fraction of the pages. ``log_path``: its log (glog, to
    stderr), else discarded. ``KvStoreUnavailableError`` when the port is taken, the master
    exits, or it does not listen in time.
    """
    probe = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))
    except OSError as exc:
        raise KvStoreUnavailableError(f"mooncake master port {host}:{port}: {exc}") from exc
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
    log = open(log_path, "ab") if log_path is not None else subprocess.DEVNULL
    try:
        proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    finally:
        if log_path is not None:
            log.close()  # the child holds its own descriptor
    deadline = time.monotonic() + ready_timeout_s
    while True:
        if proc.poll() is not None:
            raise KvStoreUnavailableError(
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
            raise KvStoreUnavailableError(
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


def _log_tail(log_path: Path | None, chars: int = 1500) -> str:
    if log_path is None:
        return ""
    try:
        return f"; its log ends: {log_path.read_text(errors='replace')[-chars:]}"
    except OSError:
        return ""
