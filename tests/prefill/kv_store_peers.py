"""Mooncake store masters and ``KvStore`` clients in other processes for the store's tests,
and the pages they put: random bit patterns (NaNs, infinities and subnormals included) that
the same arguments make again, compared byte for byte.

A peer (``peer_main``, driven over its stdin and stdout by ``Peer``) is a second "prefill
worker", so pages cross processes over Mooncake's TCP transport both ways.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from services.prefill.kv_store import KvStore, PageLayout
from services.prefill.kv_store_calls import KvPagesMissingError, KvStoreError
from services.prefill.kv_store_master import start_master, stop_master

REPO = Path(__file__).resolve().parents[2]
NAMESPACE = "tiny-model@rev1"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16}
SEGMENT = 32 << 20


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
    """``python -c 'from tests.prefill.kv_store_peers import peer_main; peer_main()' MASTER
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
                    "from tests.prefill.kv_store_peers import peer_main; peer_main()",
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
