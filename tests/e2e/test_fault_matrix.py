"""The fault matrix: SIGKILL and SIGSTOP of the tokenizer, vision encoder, prefill and decode
under live streaming requests, case after case on one ``stageserve up``.

Each case:
1. 8 streams (every other one with a small image; max_tokens large, ignore_eos, temperature 0)
   run until each has streamed tokens; then the fault; right after it 4 more streams arrive
   (half with a fresh image) so the faulted stage also gets new work.
2. By ``BOUND_S`` after the fault (the router's stall bound + 5 s) every stream has ended
   (result or error) or is still streaming tokens: a request that does not need the faulted
   service must not be disturbed by it. None may sit silent. A decode fault ends every stream
   that was on decode with an error. The test then closes the streams still running.
3. Recovery: after SIGKILL ``up`` restarts the service on its ports (new pid, same ports in the
   state file); after SIGSTOP the test sends SIGCONT. Then ``/health`` is 200 and a text and an
   image request succeed.
4. Nothing leaks: decode's pages all come back (free == total, 0 used, 0 quarantined) and
   prefill's embedding rows return to their value before the suite.

Each case's record is written to ``fault_matrix.json`` in the system's directory and printed,
in seconds after the fault: ``fault_to_last_end_s`` (the last stream that ended by the bound),
``health_down_s`` (``/health`` first not 200), ``back_s`` (READY again, or SIGCONT sent),
``health_up_s`` (``/health`` 200 again), ``serving_s`` (a text and an image request succeeded;
sent after the bound), and the streams' outcomes, ``failed_requests_after_health`` and
``resources_settled_s`` (after the streams were closed).
"""

from __future__ import annotations

import base64
import collections
import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest

from tests.conftest import image_bytes
from tests.e2e.system import System, pid_alive, running_system

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STALL_S = 3.0  # the router's per-hop progress bound in this system
BOUND_S = STALL_S + 5  # every stream has ended or is streaming this long after the fault
QUARANTINE_S = 2.0  # decode's pages and prefill's embedding rows of failed requests rest this long
NUM_PAGES = 4096
MAX_TOKENS = 2000  # far more than a case lasts: the streams are still running at the fault
SETTLE_S = 120  # generous bound on recovering (restart, reconnect) and on resources settling
# up kills a service that answers no liveness check this long (10 s by default): a stopped one
# must still be there when the test sends SIGCONT, BOUND_S after the fault
LIVENESS_S = 30.0
HANG_S = (
    120  # a stream's client gives up after this long without a byte: a hang fails, never blocks
)
SYSTEM_FLAGS = (
    "--num-pages",
    str(NUM_PAGES),
    "--stall-timeout-s",
    str(STALL_S),
    "--kv-quarantine-s",
    str(QUARANTINE_S),
    "--embedding-quarantine-s",
    str(QUARANTINE_S),
    "--liveness-timeout-s",
    str(LIVENESS_S),
)
SERVICES = ("tokenizer", "vision_encoder", "prefill", "decode")
CASES = [(service, fault) for service in SERVICES for fault in (signal.SIGKILL, signal.SIGSTOP)]


def chat_body(model: str, text: str, image: bytes | None, max_tokens: int, stream: bool) -> dict:
    parts = [{"type": "text", "text": text}]
    if image is not None:
        url = "data:image/png;base64," + base64.b64encode(image).decode()
        parts.insert(0, {"type": "image_url", "image_url": {"url": url}})
    return {
        "model": model,
        "messages": [{"role": "user", "content": parts}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
        "ignore_eos": True,
    }


@dataclass
class Stream:
    """One streaming chat request, read on its own thread; SSE split on b"\\n" only."""

    url: str
    body: dict
    outcome: str = ""  # set once it ended: "finished length", "sse error ...", "http 503 ...", ...
    num_chunks: int = 0
    last_chunk_mono: float = 0.0
    ended_mono: float | None = None
    closing: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self._read()
        except httpx.HTTPError as exc:
            self.outcome = f"client {type(exc).__name__}"
        finally:
            self.outcome = self.outcome or "cut off"
            self.ended_mono = time.monotonic()

    def _read(self) -> None:
        with (
            httpx.Client(timeout=HANG_S) as client,
            client.stream("POST", self.url, json=self.body) as reply,
        ):
            if reply.status_code != 200:
                error = json.loads(reply.read())["error"]
                self.outcome = f"http {reply.status_code} {error['type']}"
                return
            pending = b""
            for data in reply.iter_bytes():
                *lines, pending = (pending + data).split(b"\n")
                if any(self._on_line(line) for line in lines):
                    return
                if self.closing.is_set():
                    self.outcome = "closed while streaming"
                    return

    def _on_line(self, line: bytes) -> bool:
        """Handle one SSE line; True at the end of the stream."""
        if not line.startswith(b"data: "):
            return False
        if line == b"data: [DONE]":
            return True
        event = json.loads(line[len(b"data: ") :])
        if "error" in event:
            self.outcome = f"sse error {event['error']['type']}"
        elif event["choices"] and event["choices"][0].get("finish_reason"):
            self.outcome = f"finished {event['choices'][0]['finish_reason']}"
        else:
            self.num_chunks += 1
            self.last_chunk_mono = time.monotonic()
        return False


def open_streams(system: System, model: str, count: int, tag: str, seed: int) -> list[Stream]:
    streams = []
    for i in range(count):
        image = image_bytes(64, 48, seed=seed + i) if i % 2 else None
        body = chat_body(model, f"{tag} {i}: count on and on.", image, MAX_TOKENS, stream=True)
        streams.append(Stream(f"{system.base_url}/chat/completions", body))
        streams[-1].start()
    return streams


def wait_streaming(streams: list[Stream]) -> None:
    deadline_mono = time.monotonic() + SETTLE_S
    while not all(s.num_chunks >= 2 for s in streams):
        ended = [s.outcome for s in streams if s.ended_mono is not None]
        assert not ended and time.monotonic() < deadline_mono, f"streams did not get going: {ended}"
        time.sleep(0.05)


def status_at_bound(s: Stream, fault_mono: float, now: float) -> str:
    """What a stream did by the bound: its outcome, "streaming" (a token within the last
    STALL_S, after the fault), "silent" or "late: <outcome>" (both fail the case)."""
    if s.ended_mono is not None:
        return s.outcome if s.ended_mono <= fault_mono + BOUND_S else f"late: {s.outcome}"
    return "streaming" if s.last_chunk_mono > max(fault_mono, now - STALL_S) else "silent"


def wait_health(system: System, timeout_s: float) -> None:
    deadline_mono = time.monotonic() + timeout_s
    while system.health() != 200:
        assert time.monotonic() < deadline_mono, f"/health not 200 within {timeout_s:.0f} s"
        time.sleep(0.1)


def serve_again(system: System, model: str, seed: int) -> int:
    """Send a text and an image request until both succeed (bounded); the failed attempts."""
    deadline_mono, num_failed = time.monotonic() + SETTLE_S, 0
    for image in (None, image_bytes(80, 60, seed=seed)):
        body = chat_body(model, "Say something.", image, 4, stream=False)
        while True:
            reply = httpx.post(f"{system.base_url}/chat/completions", json=body, timeout=SETTLE_S)
            if reply.status_code == 200:
                break
            num_failed += 1
            assert time.monotonic() < deadline_mono, (
                f"not serving again: {reply.status_code} {reply.text}"
            )
            time.sleep(0.5)
    return num_failed


def resources(system: System) -> dict[str, float]:
    pages = {
        k: system.metric("decode", f"stageserve_decode_kv_pages_{k}")
        for k in ("free", "used", "quarantined")
    }
    rows = system.metric("prefill", "stageserve_prefill_embedding_rows_used")
    return {**pages, "embedding_rows": rows}


def settled_resources(start_rows: float) -> dict[str, float]:
    return {"free": NUM_PAGES, "used": 0, "quarantined": 0, "embedding_rows": start_rows}


def wait_resources(system: System, start_rows: float) -> dict[str, float]:
    settled = settled_resources(start_rows)
    deadline_mono = time.monotonic() + SETTLE_S
    while True:
        try:
            now = resources(system)
        except OSError:  # a metrics server not back yet
            now = {}
        if now == settled or time.monotonic() > deadline_mono:
            return now
        time.sleep(0.2)


class HealthWatch:
    """Polls ``/health`` on a thread from the fault on: when it first was not 200, and when it
    was 200 again after that."""

    def __init__(self, system: System) -> None:
        self.down_mono: float | None = None
        self.up_mono: float | None = None
        self._system = system
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            is_ok, now = self._system.health() == 200, time.monotonic()
            if not is_ok and self.down_mono is None:
                self.down_mono = now
            if is_ok and self.down_mono is not None and self.up_mono is None:
                self.up_mono = now

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def recover(
    system: System, service: str, fault: signal.Signals, old: dict, num_lines: int
) -> float:
    """SIGCONT a stopped service, or wait for ``up`` to restart a killed one on its ports; then
    wait for ``/health`` 200. Returns when the service was back (SIGCONT sent, or READY again)."""
    if fault is signal.SIGSTOP:
        os.kill(old["pid"], signal.SIGCONT)
        return time.monotonic()
    system.wait_for_output(f"{service} exited with code -9; restarting in", num_lines, SETTLE_S)
    _, back_mono = system.wait_for_output(f"{service} is ready again (pid", num_lines, SETTLE_S)
    new = system.reload_state()[service]
    assert new["pid"] != old["pid"] and pid_alive(new["pid"])
    assert {k: v for k, v in new.items() if k != "pid"} == {
        k: v for k, v in old.items() if k != "pid"
    }
    return back_mono


def observe(
    live: list[Stream], arriving: list[Stream], fault_mono: float, record: dict
) -> list[str]:
    """Record what the streams did by the bound; the ones that went silent or ended late."""
    now = time.monotonic()
    statuses = [status_at_bound(s, fault_mono, now) for s in live + arriving]
    ended = [s.ended_mono - fault_mono for s in live + arriving if s.ended_mono is not None]
    record.update(
        fault_to_last_end_s=round(max(ended), 2) if ended else None,
        live=dict(collections.Counter(statuses[: len(live)])),
        arriving=dict(collections.Counter(statuses[len(live) :])),
    )
    return [
        f"stream {i}: {status}, {(live + arriving)[i].num_chunks} chunks"
        for i, status in enumerate(statuses)
        if status == "silent" or status.startswith("late")
    ]


def since(start_mono: float, mono: float | None) -> float | None:
    return None if mono is None else round(mono - start_mono, 2)


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    with running_system(tmp_path_factory.mktemp("faults"), *SYSTEM_FLAGS) as system:
        yield system


@contextlib.contextmanager
def case_records(system: System, request, file_name: str, label: str) -> Iterator[list[dict]]:
    """One dict per case, written to ``file_name`` in the system's directory and printed,
    each line led by ``label``, once the cases are done."""
    records: list[dict] = []
    yield records
    (system.workdir / file_name).write_text(json.dumps(records, indent=2))
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    with request.config.pluginmanager.get_plugin("capturemanager").global_and_fixture_disabled():
        for record in records:
            reporter.write_line(f"{label}: " + json.dumps(record))


@pytest.fixture(scope="module")
def records(system, request):
    with case_records(system, request, "fault_matrix.json", "fault matrix") as records:
        yield records


@pytest.fixture(scope="module")
def model(system):
    return httpx.get(f"{system.base_url}/models", timeout=30).json()["data"][0]["id"]


@pytest.fixture(scope="module")
def start_rows(system):
    wait_health(system, SETTLE_S)
    return system.metric("prefill", "stageserve_prefill_embedding_rows_used")


@pytest.mark.parametrize(("service", "fault"), CASES, ids=[f"{s}-{f.name}" for s, f in CASES])
def test_fault(system, records, model, start_rows, service, fault):
    seed = 1000 * (CASES.index((service, fault)) + 1)
    wait_health(system, SETTLE_S)
    old = dict(system.reload_state()[service])
    record: dict = {"case": f"{fault.name} {service}"}
    records.append(record)
    live, arriving = open_streams(system, model, 8, "live", seed), []
    health = None
    try:
        wait_streaming(live)
        num_lines, fault_mono = len(system.output), time.monotonic()
        os.kill(old["pid"], fault)
        health = HealthWatch(system)
        arriving = open_streams(system, model, 4, "arriving", seed + 100)
        time.sleep(max(0.0, fault_mono + BOUND_S - time.monotonic()))
        silent = observe(live, arriving, fault_mono, record)
        assert not silent, f"silent {BOUND_S:.0f} s after the fault: {silent}; {record}"
        if service == "decode":
            assert all(s.outcome.startswith("sse error") for s in live), record
        back_mono = recover(system, service, fault, old, num_lines)
        wait_health(system, SETTLE_S)
        record["failed_requests_after_health"] = serve_again(system, model, seed + 200)
        health.stop()
        record.update(
            health_down_s=since(fault_mono, health.down_mono),
            back_s=since(fault_mono, back_mono),
            health_up_s=since(fault_mono, health.up_mono),
            serving_s=since(fault_mono, time.monotonic()),
        )
    finally:
        if health is not None:
            health.stop()
        if fault is signal.SIGSTOP:  # not to hide the error when recover's SIGCONT failed
            with contextlib.suppress(ProcessLookupError):
                os.kill(old["pid"], signal.SIGCONT)
        for s in live + arriving:
            s.closing.set()
        for s in live + arriving:
            assert s.thread is not None
            s.thread.join(timeout=HANG_S + 10)
    settle_mono = time.monotonic()
    settled = wait_resources(system, start_rows)
    record["resources_settled_s"] = since(settle_mono, time.monotonic())
    assert settled == settled_resources(start_rows), record
