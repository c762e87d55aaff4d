"""The system benchmark's moving parts: the system (``stageserve up``) as a process, the serving
client spread over several processes, and what the services report while it runs.

The load of one concurrency level is split over ``num_processes`` client processes (each
``benchmarks.serve``'s client with its share of the requests and of the concurrency), which
build their requests and then start together at a barrier, so no client process is the
bottleneck; their records are summarized as one run, on one clock. CPU use of a process is
its utime + stime over the wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue
from pathlib import Path

from benchmarks.serve_client import Outcome, RequestRecord
from benchmarks.serve_metrics import Slo
from benchmarks.serve_run import BenchConfig, run_benchmark
from benchmarks.serve_workload import IntRange, WorkloadSpec

UP_TIMEOUT_S = 1800.0  # a 7B checkpoint loaded by three services on one GPU
GPU_UP = [
    "--device",
    "cuda",
    "--attention-backend",
    "flashinfer",
    "--kv-transfer-backend",
    "cuda_ipc",
]
CPU_UP = ["--device", "cpu"]
BARRIER_S = 600.0  # for every client process to have built its requests


@dataclass
class System:
    """``stageserve up`` running: its process, HTTP port and state file."""

    process: subprocess.Popen
    http_port: int
    state_file: Path
    output: list[str] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/v1"

    def state(self) -> dict:
        return json.loads(self.state_file.read_text())

    def metric(self, service: str, name: str, labels: str = "") -> float:
        """Sum of a Prometheus sample on ``service``'s metrics port.

        ``labels``: a ``{...}`` part to match.
        """
        port = self.state()[service]["metrics_port"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as reply:
            text = reply.read().decode()
        pattern = rf"^{re.escape(name + labels)}(?:{{[^}}]*}})? (\S+)$"
        return sum(float(m.group(1)) for m in re.finditer(pattern, text, re.M))

    def pids(self, prefix: str) -> dict[str, int]:
        return {
            name: entry["pid"] for name, entry in self.state().items() if name.startswith(prefix)
        }

    def argv(self, service: str) -> list[str]:
        """The command line ``service``'s process runs (Linux: its /proc entry)."""
        pid = self.state()[service]["pid"]
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]

    def served_model(self) -> str | None:
        """The first model of GET /models; None when the router does not say."""
        import httpx

        try:
            reply = httpx.get(f"{self.base_url}/models", timeout=30, trust_env=False)
            return reply.json()["data"][0]["id"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError):
            return None

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(120)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_UP_LINE = re.compile(r"stageserve is up: OpenAI API at http://[^/]+:(\d+)/v1")


def up_http_port(line: str) -> int | None:
    """The HTTP port of ``up``'s "stageserve is up" line; None for any other line."""
    match = _UP_LINE.match(line)
    return int(match.group(1)) if match else None


def up_command(port: int, workdir: Path, up_args: Sequence[str] = ()) -> list[str]:
    """``stageserve up`` on ``port`` (0: the router binds a free one and ``up`` prints it),
    its state file and logs in ``workdir``, then ``up_args``."""
    return [
        *(sys.executable, "-m", "services.cli", "up", "--port", str(port)),
        *("--state-file", str(workdir / "state.json"), "--log-dir", str(workdir / "logs")),
        *up_args,
    ]


def start_system(up_args: list[str], workdir: Path, port: int = 0) -> System:
    """``stageserve up`` with ``up_args``; returns once it says it is up (output: the log).

    ``port`` 0: the router binds a free port and the system takes it from ``up``'s line (a port
    picked here beforehand can be taken by another socket before the router binds it)."""
    workdir.mkdir(parents=True, exist_ok=True)
    state_file = workdir / "state.json"
    cmd = up_command(port, workdir, up_args)
    print("starting: " + " ".join(cmd[2:]), flush=True)
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    system = System(process, port, state_file)
    is_up = threading.Event()

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            system.output.append(line.rstrip())
            http_port = up_http_port(line)
            if http_port is not None:
                system.http_port = http_port
                is_up.set()

    threading.Thread(target=read, daemon=True).start()
    deadline_mono = time.monotonic() + UP_TIMEOUT_S
    while not is_up.wait(0.5):
        if process.poll() is not None or time.monotonic() > deadline_mono:
            system.stop()
            raise RuntimeError("the system did not come up:\n" + "\n".join(system.output[-40:]))
    return system


def add_system_args(p: argparse.ArgumentParser) -> None:
    """The system benchmarks' shared options: ``--out``, ``--checkpoint-dir``, ``--workdir``."""
    p.add_argument(
        "--out",
        default="docs/benchmarks.md",
        help="markdown report whose section is written ('': none)",
    )
    p.add_argument(
        "--checkpoint-dir", type=Path, default=Path(tempfile.gettempdir()) / "stageserve-7b-random"
    )
    p.add_argument(
        "--workdir", type=Path, default=None, help="logs and state (default: a temporary one)"
    )


@contextlib.contextmanager
def running_system(up_args: list[str], workdir: Path | None, prefix: str) -> Iterator[System]:
    """``stageserve up`` in ``workdir`` (None: a new temporary one named ``prefix``...), stopped
    on the way out; its exit code is then ``system.process.returncode``."""
    workdir = workdir or Path(tempfile.mkdtemp(prefix=prefix))
    system = start_system(up_args, workdir)
    try:
        yield system
    finally:
        system.stop()


class MetricDelta:
    """Samples' increase on a running system since construction or the last ``reset``.

    ``samples``: (key, service, metric name); ``histograms``: (column, service, histogram
    name), read as its ``_sum`` and ``_count`` samples (keys ``column + " sum"`` / ``" count"``).
    """

    def __init__(
        self,
        system: System,
        samples: Iterable[tuple[str, str, str]] = (),
        histograms: Iterable[tuple[str, str, str]] = (),
    ) -> None:
        self.system = system
        self.samples: list[tuple[str, str, str]] = []
        for column, service, name in histograms:
            self.samples.append((column + " sum", service, name + "_sum"))
            self.samples.append((column + " count", service, name + "_count"))
        self.samples += samples
        self.reset()

    def _read(self) -> dict[str, float]:
        return {key: self.system.metric(service, name) for key, service, name in self.samples}

    def reset(self) -> None:
        self.start = self._read()

    def since(self) -> dict[str, float]:
        end = self._read()
        return {key: end[key] - self.start[key] for key in end}


def histogram_mean_ms(delta: dict[str, float], column: str) -> float | None:
    """Mean of ``column``'s histogram over a ``MetricDelta.since`` in ms; None if not observed."""
    count = delta[column + " count"]
    return delta[column + " sum"] / count * 1e3 if count else None


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of ``pid`` (its threads included), seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children_cpu_seconds() -> float:
    """User + system CPU time of this process's children that ended and were waited for."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


@dataclass(frozen=True)
class Load:
    base_url: str
    model: str
    concurrency: int
    num_requests: int
    input_len: int  # prompt text tokens, exact (counted with ``tokenizer``)
    output_len: int
    tokenizer: Path  # the served model's tokenizer.json
    seed: int
    extra_body: dict = field(default_factory=dict)  # merged into every request body


def _client(load: Load, index: int, num_processes: int, barrier, results) -> None:
    """One client process: its share of the requests and of the concurrency."""
    share = len(range(index, load.num_requests, num_processes))
    concurrency = len(range(index, load.concurrency, num_processes))
    workload = WorkloadSpec(
        IntRange(load.input_len, load.input_len),
        IntRange(load.output_len, load.output_len),
        IntRange(0, 0),
        (64, 64),
        ignore_eos=True,
        temperature=0.0,
        extra_body=load.extra_body,
    )
    cfg = BenchConfig(
        base_url=load.base_url,
        model=load.model,
        api_key=None,
        tokenizer=load.tokenizer,
        request_rate=float("inf"),
        max_concurrency=max(concurrency, 1),
        num_requests=max(share, 1),
        seed=load.seed + index,
        workload=workload,
        request_timeout_s=3600.0,
        max_duration_s=7200.0,
        slo=Slo(),
        output_json=None,
        markdown=None,
    )
    try:
        run = asyncio.run(run_benchmark(cfg, before_start=lambda: barrier.wait(BARRIER_S)))
    except BaseException as exc:  # the parent reports it instead of waiting for a result
        barrier.abort()  # the others stop waiting at the start
        results.put(f"client {index}: {type(exc).__name__}: {exc}")
        raise
    results.put((run.records, run.t0, run.duration_s))


def template_tokens(records: Sequence[RequestRecord], text_len: int) -> int:
    """Tokens the server put around prompts of ``text_len`` tokens of text (the chat
    template's), from the usage of ``records``' successful requests (their median)."""
    counts = sorted(
        r.prompt_tokens for r in records if r.outcome is Outcome.OK and r.prompt_tokens is not None
    )
    if not counts:
        raise RuntimeError("no successful request reported its prompt tokens (usage)")
    served = counts[len(counts) // 2]
    if not text_len <= served < 2 * text_len:
        raise RuntimeError(
            f"the server counted {served} prompt tokens for {text_len} tokens of text: the chat "
            "template's tokens cannot be taken out of a prompt of that length"
        )
    return served - text_len


def run_load(load: Load, num_processes: int) -> tuple[list[RequestRecord], float]:
    """Run ``load`` over ``num_processes`` client processes that build their requests, wait for
    each other, then send.

    Returns the records, each ``start_s`` counted from the first process's start, and the
    duration from that start to the last request's end. The processes' clocks are one clock:
    ``time.perf_counter`` is the host's ``CLOCK_MONOTONIC`` on Linux.
    """
    num_processes = max(1, min(num_processes, load.concurrency))
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(num_processes), context.Queue()
    clients = [
        context.Process(target=_client, args=(load, i, num_processes, barrier, results))
        for i in range(num_processes)
    ]
    return merge_runs(run_clients(clients, results))


def run_clients(
    clients: Sequence[BaseProcess],
    results: Queue,
    label: str = "",
    while_running: Callable[[], None] | None = None,
) -> list[tuple[list[RequestRecord], float, float]]:
    """Start ``clients``, call ``while_running`` (if given), then take one result per client
    from ``results``: its (records, t0, duration), or the string it put instead when it failed
    (then ``RuntimeError`` naming them all, after ``label``). Every client is joined, or killed
    after 60 s, on the way out."""
    for client in clients:
        client.start()
    try:
        if while_running is not None:
            while_running()
        outcomes = [results.get(timeout=7200) for _ in clients]
    finally:
        for client in clients:
            client.join(60)
            if client.is_alive():
                client.kill()
    errors = [outcome for outcome in outcomes if isinstance(outcome, str)]
    if errors:
        raise RuntimeError((f"{label}: " if label else "") + "; ".join(errors))
    return outcomes


def merge_runs(
    runs: Sequence[tuple[list[RequestRecord], float, float]],
) -> tuple[list[RequestRecord], float]:
    """One run of several processes' (records, t0, duration): every ``start_s`` moved to count
    from the first t0, and the duration from it to the last process's end."""
    origin = min(t0 for _, t0, _ in runs)
    end = max(t0 + duration_s for _, t0, duration_s in runs)
    records = []
    for process_records, t0, _ in runs:
        for record in process_records:
            record.start_s += t0 - origin
            records.append(record)
    for index, record in enumerate(records):
        record.index = index
    return records, end - origin
