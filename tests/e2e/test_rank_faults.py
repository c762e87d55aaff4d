"""Rank faults under live streams: SIGKILL and SIGSTOP of one rank process of a rank group, case
after case on one ``stageserve up`` per layout, with the fault matrix's streams and bounds
(``test_fault_matrix.py``).

Layouts, on the tiny Qwen3-VL MoE:
- ``cp2-ep2-into-dp-attention2``: prefill on two CP ranks with the experts split over them (an
  EP group), decode a DP-attention group of two ranks with the experts split over both. Victims:
  decode rank 1, decode rank 0 (the rank that steps the group) and prefill rank 1.
- ``decode-tp2-ep2``: decode one TP group of two ranks, experts split. Victims: rank 0 killed,
  rank 1 stopped.

Each case:
1. 8 streams (every other one with an image) run until each has streamed tokens; the victim
   rank process gets the signal; right after it 4 more streams arrive (half with an image).
2. By ``BOUND_S`` after the fault (the router's stall bound + 5 s) every stream has ended or is
   still streaming; none sits silent. A decode rank fault ends every live stream with an error
   (every request runs on the one group); a prefill rank fault leaves the live streams, all in
   decode already, streaming. The new streams may fail or succeed.
3. The group re-forms: its leader logs a new formation ready, with new processes for every rank
   (the victim gone: a stopped rank is killed by the leader, then sent SIGCONT in vain). Then
   ``/health`` is 200 and a text and an image request succeed.
4. Once the streams are closed, decode's pages (free, used, quarantined) and prefill's embedding
   rows return to their values before the suite.

The SIGKILL cases run first: a case that leaves the system unable to serve fails the cases after
it. Each case's record is written to ``rank_faults.json`` in the system's directory and printed,
in seconds after the fault: ``fault_to_last_end_s``, ``reformed_s`` (the leader's log line of the
new formation ready), ``health_down_s``, ``health_up_s``, ``serving_s``, the streams' outcomes,
``failed_requests_after_health`` and ``resources_settled_s`` (after the streams were closed).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import signal
import time

import httpx
import pytest

from tests.e2e.system import System, pid_alive, running_system
from tests.e2e.test_fault_matrix import (
    BOUND_S,
    HANG_S,
    SETTLE_S,
    SYSTEM_FLAGS,
    HealthWatch,
    Stream,
    case_records,
    observe,
    open_streams,
    resources,
    serve_again,
    since,
    wait_health,
    wait_streaming,
)
from tests.e2e.test_tensor_parallel import MOE_DIR, cmdline, rank_processes

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
DP_ATTENTION = "cp2-ep2-into-dp-attention2"
DECODE_TP = "decode-tp2-ep2"
LAYOUTS = {
    DP_ATTENTION: (
        *("--prefill-cp", "2", "--prefill-ep", "2", "--prefill-cp-min-tokens", "1"),
        *("--decode-dp", "2", "--decode-dp-attention", "--decode-ep", "2"),
    ),
    DECODE_TP: ("--decode-dp", "1", "--decode-tp", "2", "--decode-ep", "2"),
}
# a stopped rank is found by these bounds (60 s and 30 s by default): most of a SIGSTOP case's time
WATCHDOG_FLAGS = (
    *("--prefill-step-timeout-s", "12", "--prefill-watchdog-s", "10"),
    *("--decode-watchdog-s", "10"),
)
FAULTS = (signal.SIGKILL, signal.SIGSTOP)
# (service, rank, fault) of each layout's cases, the SIGKILLs first
DP_ATTENTION_CASES = [
    (service, rank, fault)
    for fault in FAULTS
    for service, rank in (("decode", 1), ("decode", 0), ("prefill", 1))
]
# TP decode's four cases run at the service level (tests/decode/test_tp_ranks.py): here one
# of each signal, to keep the suite's time
DECODE_TP_CASES = [("decode", 0, signal.SIGKILL), ("decode", 1, signal.SIGSTOP)]
# a leader's log line (text format): "2026-12-06 10:05:01,004 INFO ...: formation 2 is ready"
FORMATION_READY = re.compile(r"^(\S+ \S+) .*formation (\d+) is ready$", re.M)


def ranks_by_number(system: System, service: str) -> dict[int, int]:
    """``service``'s rank processes: rank -> pid."""
    out = {}
    for pid in rank_processes(system.state[service]["pid"]):
        with contextlib.suppress(OSError, ValueError):  # gone meanwhile
            argv = cmdline(pid).split("\0")
            out[int(argv[argv.index("--rank") + 1])] = pid
    return out


def formations_ready(system: System, service: str) -> dict[int, float]:
    """Formation number -> when ``service``'s leader logged it ready (unix seconds)."""
    log = (system.workdir / "logs" / f"{service}.log").read_text()
    return {
        int(number): datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
        for stamp, number in FORMATION_READY.findall(log)
    }


def wait_reformed(system: System, service: str, old: dict[int, int], formation: int) -> float:
    """Wait for a formation after ``formation`` to be ready, every rank a new process and the
    old ones gone; when it was logged ready (unix seconds)."""
    deadline_mono = time.monotonic() + SETTLE_S
    while True:
        ready = {n: t for n, t in formations_ready(system, service).items() if n > formation}
        now = ranks_by_number(system, service)
        is_new = now.keys() == old.keys() and set(now.values()).isdisjoint(old.values())
        if ready and is_new and not any(pid_alive(pid) for pid in old.values()):
            return ready[max(ready)]
        assert time.monotonic() < deadline_mono, f"{service} did not re-form: {old} -> {now}"
        time.sleep(0.1)


def wait_healthy(system: System) -> None:
    """``/health`` 200 within ``SETTLE_S``; else fail with the router's last answer."""
    try:
        wait_health(system, SETTLE_S)
    except AssertionError as exc:
        url = f"http://127.0.0.1:{system.http_port}/health"
        raise AssertionError(f"{exc}: {httpx.get(url, timeout=10).text}") from None


def resume(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # the leader killed and reaped it
        os.kill(pid, signal.SIGCONT)


def idle_resources(system: System) -> dict[str, float]:
    """Decode's pages and prefill's rows once no request holds a page (bounded)."""
    deadline_mono = time.monotonic() + SETTLE_S
    while True:
        now = resources(system)
        if now["used"] == now["quarantined"] == 0 or time.monotonic() > deadline_mono:
            return now
        time.sleep(0.2)


def wait_resources(system: System, start: dict[str, float]) -> dict[str, float]:
    deadline_mono = time.monotonic() + SETTLE_S
    while True:
        try:
            now = resources(system)
        except OSError:  # a metrics server not answering for a moment
            now = {}
        if now == start or time.monotonic() > deadline_mono:
            return now
        time.sleep(0.2)


@pytest.fixture(scope="module")
def system(request, tmp_path_factory):
    flags = LAYOUTS[request.param]
    workdir = tmp_path_factory.mktemp(request.param)
    flags = (*SYSTEM_FLAGS, *WATCHDOG_FLAGS, *flags)
    with running_system(workdir, "--model", str(MOE_DIR), *flags) as system:
        yield system


@pytest.fixture(scope="module")
def records(system, request):
    with case_records(system, request, "rank_faults.json", "rank faults") as records:
        yield records


@pytest.fixture(scope="module")
def start(system):
    """The model's name and the idle resources before the first case."""
    wait_healthy(system)
    name = httpx.get(f"{system.base_url}/models", timeout=30).json()["data"][0]["id"]
    settled = idle_resources(system)
    assert settled["used"] == settled["quarantined"] == 0, settled
    return name, settled


def case_ids(cases: list[tuple[str, int, signal.Signals]]) -> list[str]:
    return [f"{service}{rank}-{fault.name}" for service, rank, fault in cases]


@pytest.mark.parametrize("system", [DP_ATTENTION], indirect=True)
@pytest.mark.parametrize(
    ("service", "rank", "fault"), DP_ATTENTION_CASES, ids=case_ids(DP_ATTENTION_CASES)
)
def test_a_rank_of_prefill_cp_ep_or_decode_dp_attention_lost(
    system, records, start, service, rank, fault
):
    seed = 1000 * (DP_ATTENTION_CASES.index((service, rank, fault)) + 1)
    run_case(system, records, start, (service, rank, fault), seed)


@pytest.mark.parametrize("system", [DECODE_TP], indirect=True)
@pytest.mark.parametrize(
    ("service", "rank", "fault"), DECODE_TP_CASES, ids=case_ids(DECODE_TP_CASES)
)
def test_a_rank_of_decode_tp_lost(system, records, start, service, rank, fault):
    seed = 1000 * (DECODE_TP_CASES.index((service, rank, fault)) + 1)
    run_case(system, records, start, (service, rank, fault), seed)


def run_case(
    system: System,
    records: list[dict],
    start: tuple[str, dict[str, float]],
    case: tuple[str, int, signal.Signals],
    seed: int,
) -> None:
    (model, start_resources), (service, rank, fault) = start, case
    wait_healthy(system)
    old, formation = ranks_by_number(system, service), max(formations_ready(system, service))
    record: dict = {"case": f"{fault.name} {service} rank {rank}"}
    records.append(record)
    live, arriving = open_streams(system, model, 8, "live", seed), []
    health = None
    try:
        wait_streaming(live)
        fault_unix, fault_mono = time.time(), time.monotonic()
        os.kill(old[rank], fault)
        health = HealthWatch(system)
        arriving = open_streams(system, model, 4, "arriving", seed + 100)
        time.sleep(max(0.0, fault_mono + BOUND_S - time.monotonic()))
        check_at_bound(service, live, arriving, fault_mono, record)
        reformed_unix = wait_reformed(system, service, old, formation)
        record["reformed_s"] = round(reformed_unix - fault_unix, 2)
        resume(old[rank])  # a stopped rank is gone by now: the leader killed it
        wait_healthy(system)
        record["failed_requests_after_health"] = serve_again(system, model, seed + 200)
        health.stop()
        record.update(
            health_down_s=since(fault_mono, health.down_mono),
            health_up_s=since(fault_mono, health.up_mono),
            serving_s=since(fault_mono, time.monotonic()),
        )
    finally:
        if health is not None:
            health.stop()
        if fault is signal.SIGSTOP:
            resume(old[rank])
        close(live + arriving)
    settle_mono = time.monotonic()
    settled = wait_resources(system, start_resources)
    record["resources_settled_s"] = since(settle_mono, time.monotonic())
    assert settled == start_resources, record


def check_at_bound(
    service: str, live: list[Stream], arriving: list[Stream], fault_mono: float, record: dict
) -> None:
    """Every stream ended or streaming by the bound; a decode rank's loss ended every live one
    with an error, a prefill rank's left them streaming (they are in decode)."""
    silent = observe(live, arriving, fault_mono, record)
    assert not silent, f"silent {BOUND_S:.0f} s after the fault: {silent}; {record}"
    if service == "decode":
        assert all(s.outcome.startswith("sse error") for s in live), record
    else:
        assert record["live"] == {"streaming": len(live)}, record


def close(streams: list[Stream]) -> None:
    for s in streams:
        s.closing.set()
    for s in streams:
        assert s.thread is not None
        s.thread.join(timeout=HANG_S + 10)
