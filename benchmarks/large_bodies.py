"""The router's liveness under bursts of chat bodies near its size limit (CPU, bounded).

``python -m benchmarks.large_bodies [--bursts 3] [--busy-loops 3]`` starts ``stageserve up`` on
CPU with an API key, optionally starts ``--busy-loops`` processes that spin on a core each (a
loaded machine), sends ``--bursts`` bursts of ``--concurrency`` chat bodies of ``--body-mb``
megabytes of text each (over the context limit: each is answered 400), checks the router's gRPC
health ``liveness`` every 0.2 s as ``up``'s supervisor does, and prints one JSON line: the
answers' statuses, each burst's seconds, the slowest and the failed liveness checks, and the
supervisor's lines about restarts (a router that answers no check for ``--liveness-timeout-s``
is killed and restarted, dropping its connections).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from benchmarks.system_load import CPU_UP, System, start_system
from services.supervisor import check_liveness

KEY = "sk-large-bodies"
PROBE_INTERVAL_S = 0.2
_LETTERS = bytes((32 if i % 8 == 0 else 97 + i % 26) for i in range(256))


def chat_body(num_bytes: int) -> bytes:
    text = os.urandom(num_bytes).translate(_LETTERS)  # distinct random words
    return b'{"messages":[{"role":"user","content":"' + text + b'"}],"max_tokens":4}'


def post(url: str, body: bytes) -> str:
    request = urllib.request.Request(
        url,
        data=body,
        headers={"authorization": f"Bearer {KEY}", "content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=300) as reply:
            return str(reply.status)
    except urllib.error.HTTPError as exc:
        return str(exc.code)
    except OSError as exc:  # the connection dropped (a restarted router)
        return type(exc).__name__


def measure(system: System, args: argparse.Namespace) -> dict:
    address = f"127.0.0.1:{system.state()['router']['port']}"
    checks: list[tuple[float, bool]] = []
    done = threading.Event()

    def probe() -> None:
        while not done.is_set():
            start = time.monotonic()
            answered = check_liveness(address, args.liveness_timeout_s)
            checks.append((time.monotonic() - start, answered))
            time.sleep(PROBE_INTERVAL_S)

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    statuses: dict[str, int] = {}
    burst_s = []
    url = f"{system.base_url}/chat/completions"
    with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
        for _ in range(args.bursts):
            bodies = [chat_body(int(args.body_mb * 1e6)) for _ in range(args.concurrency)]
            start = time.monotonic()
            for status in pool.map(lambda body: post(url, body), bodies):
                statuses[status] = statuses.get(status, 0) + 1
            burst_s.append(round(time.monotonic() - start, 2))
            del bodies
    done.set()
    prober.join()
    return {
        "busy_loops": args.busy_loops,
        "bodies": f"{args.bursts} x {args.concurrency} x {args.body_mb} MB",
        "statuses": statuses,
        "burst_s": burst_s,
        "liveness_checks": len(checks),
        "slowest_check_s": round(max(s for s, _ in checks), 2),
        "failed_checks": sum(not ok for _, ok in checks),
        "supervisor": [line for line in system.output if "liveness" in line],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bursts", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--body-mb", type=float, default=30.0)
    p.add_argument("--busy-loops", type=int, default=0)
    p.add_argument("--liveness-timeout-s", type=float, default=10.0, help="up's, and each check's")
    args = p.parse_args()
    busy = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy_loops)
    ]
    workdir = Path(tempfile.mkdtemp(prefix="large-bodies-"))
    up_args = [*CPU_UP, "--api-key", KEY, "--liveness-timeout-s", str(args.liveness_timeout_s)]
    try:
        system = start_system(up_args, workdir)
        try:
            print(json.dumps(measure(system, args)), flush=True)
        finally:
            system.stop()
    finally:
        for process in busy:
            process.kill()


if __name__ == "__main__":
    main()
