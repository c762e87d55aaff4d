"""Requests during a SIGSTOP of one process of ``stageserve up`` (loopback only, bounded).

``python -m benchmarks.freeze_liveness tokenizer-worker|router-2 [--freeze-s 30]`` starts
``up --router-workers 2`` on CPU, stops the target (a tokenizer pool worker: a grandchild of
the tokenizer; ``router-2``: the second router process), starts one short chat request every
``--interval-s`` while it is stopped, sends SIGCONT, and prints one JSON line: how the requests
ended (200, an HTTP error, or no answer within ``--request-timeout-s``), their longest wait,
and whether requests after the freeze succeed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import threading
import time
from pathlib import Path

import httpx

from benchmarks.system_load import CPU_UP, System, start_system

UP_ARGS = [*CPU_UP, "--router-workers", "2"]
AFTER_REQUESTS = 8


def tokenizer_worker_pids(tokenizer_pid: int) -> list[int]:
    """The tokenizer's pool workers: its grandchildren (children of its fork server)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except (FileNotFoundError, ProcessLookupError):
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    children = {pid for pid, parent in parents.items() if parent == tokenizer_pid}
    return sorted(pid for pid, parent in parents.items() if parent in children)


def queue_reader(pids: list[int]) -> int:
    """The worker blocked reading the job pipe (it holds the job queue's lock: stopping it
    stops every worker), else the first."""
    for pid in pids:
        if "pipe" in Path(f"/proc/{pid}/wchan").read_text():
            return pid
    return pids[0]


def one_request(url: str, model: str, timeout_s: float, outcomes: list[dict]) -> None:
    start = time.monotonic()
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    try:
        reply = httpx.post(url, json=body, timeout=timeout_s, trust_env=False)
        outcome = str(reply.status_code)
    except httpx.HTTPError as exc:
        outcome = f"no answer ({type(exc).__name__})"
    outcomes.append({"outcome": outcome, "wait_s": round(time.monotonic() - start, 2)})


def measure(system: System, target: str, args: argparse.Namespace) -> dict:
    url = f"{system.base_url}/chat/completions"
    model = system.served_model() or ""
    if target == "tokenizer-worker":
        pid = queue_reader(tokenizer_worker_pids(system.pids("tokenizer")["tokenizer"]))
    else:
        pid = system.pids(target)[target]
    outcomes: list[dict] = []
    threads = []
    os.kill(pid, signal.SIGSTOP)
    try:
        stop_at = time.monotonic() + args.freeze_s
        while time.monotonic() < stop_at:
            t = threading.Thread(
                target=one_request, args=(url, model, args.request_timeout_s, outcomes)
            )
            t.start()
            threads.append(t)
            time.sleep(args.interval_s)
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass  # killed and replaced meanwhile
    for t in threads:
        t.join()
    after: list[dict] = []
    for _ in range(AFTER_REQUESTS):
        one_request(url, model, args.request_timeout_s, after)
    counts: dict[str, int] = {}
    for o in outcomes:
        counts[o["outcome"]] = counts.get(o["outcome"], 0) + 1
    return {
        "target": target,
        "freeze_s": args.freeze_s,
        "num_requests": len(outcomes),
        "outcomes": counts,
        "max_wait_s": max(o["wait_s"] for o in outcomes),
        "num_waited_over_15_s": sum(o["wait_s"] > 15 for o in outcomes),
        "after": [o["outcome"] for o in after],
        "supervisor": [line for line in system.output if "answer" in line or "again" in line],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("target", choices=("tokenizer-worker", "router-2"))
    p.add_argument("--freeze-s", type=float, default=30.0)
    p.add_argument("--interval-s", type=float, default=0.25)
    p.add_argument("--request-timeout-s", type=float, default=45.0)
    p.add_argument("up_args", nargs="*", help="more flags for up (after --)")
    args = p.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="freeze-liveness-"))
    system = start_system([*UP_ARGS, *args.up_args], workdir)
    try:
        for _ in range(3):  # warm: the first requests load lazily
            one_request(f"{system.base_url}/chat/completions", system.served_model() or "", 120, [])
        print(json.dumps(measure(system, args.target, args)), flush=True)
    finally:
        system.stop()


if __name__ == "__main__":
    main()
