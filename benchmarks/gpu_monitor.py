"""What the GPU did during a benchmark: ``nvidia-smi`` sampled in the background.

Each sample is the busy fraction (``utilization.gpu``: the share of the last sample period in
which a kernel ran, on any process), the SM clock, the power draw and the clock slowdown
reasons (``clocks_event_reasons.active``: power cap, thermal or hardware slowdown). A window's
summary tells apart a GPU left idle between kernels (busy below 1) from one that ran slower
than on an idle machine (SM clock below its boost, slowed by power or heat).
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from benchmarks.report import fmt

# clocks_event_reasons bits that slow the clocks under load (nvml's nvmlClocksEventReason*):
# SW power cap, HW slowdown, SW thermal, HW thermal, HW power brake
SLOWDOWN_BITS = 0x4 | 0x8 | 0x20 | 0x40 | 0x80
FIELDS = ("utilization.gpu", "clocks.sm", "power.draw")
REASONS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")  # newer, older name


@dataclass(frozen=True)
class GpuSample:
    t: float  # time.monotonic() when read
    busy: float  # 0..1
    sm_mhz: float
    power_w: float | None
    slowdown: int | None  # the active slowdown reasons' bits; None when not reported


@dataclass(frozen=True)
class GpuSummary:
    num_samples: int
    busy: float  # mean busy fraction
    sm_mhz: float  # mean SM clock
    power_w: float | None  # mean power draw
    slowed: float | None  # fraction of samples with a power or thermal slowdown active


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:  # "[N/A]", "[Not Supported]"
        return None


def parse_line(line: str, t: float) -> GpuSample | None:
    """One ``--format=csv,noheader,nounits`` line of FIELDS (+ a reasons field); None if not."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) not in (len(FIELDS), len(FIELDS) + 1):
        return None
    busy, sm_mhz = _number(parts[0]), _number(parts[1])
    if busy is None or sm_mhz is None:
        return None
    slowdown = None
    if len(parts) > len(FIELDS):
        with contextlib.suppress(ValueError):
            slowdown = int(parts[3], 16) & SLOWDOWN_BITS
    return GpuSample(t, busy / 100.0, sm_mhz, _number(parts[2]), slowdown)


def summarize(samples: list[GpuSample]) -> GpuSummary | None:
    if not samples:
        return None
    powers = [s.power_w for s in samples if s.power_w is not None]
    reasons = [s.slowdown for s in samples if s.slowdown is not None]
    return GpuSummary(
        num_samples=len(samples),
        busy=sum(s.busy for s in samples) / len(samples),
        sm_mhz=sum(s.sm_mhz for s in samples) / len(samples),
        power_w=sum(powers) / len(powers) if powers else None,
        slowed=sum(bool(r) for r in reasons) / len(reasons) if reasons else None,
    )


GPU_COLUMNS = ("GPU busy", "SM MHz", "GPU W", "clocks slowed")  # a table's columns


def gpu_cells(gpu: GpuSummary | None) -> tuple[str, ...]:
    """GPU_COLUMNS' cells of a window's summary; dashes without one."""
    if gpu is None:
        return ("-",) * len(GPU_COLUMNS)
    return (
        fmt(gpu.busy, ".2f"),
        fmt(gpu.sm_mhz, ".0f"),
        fmt(gpu.power_w, ".0f"),
        fmt(gpu.slowed, ".2f"),
    )


class GpuMonitor:
    """``nvidia-smi`` sampling GPU ``index`` every ``interval_ms`` until ``close``; with no
    ``nvidia-smi`` (a CPU machine) it samples nothing and every window's summary is None."""

    def __init__(self, index: int = 0, interval_ms: int = 200) -> None:
        self.samples: list[GpuSample] = []
        self._process: subprocess.Popen | None = None
        smi = shutil.which("nvidia-smi")
        if smi is None:
            return
        for fields in ((*FIELDS, REASONS[0]), (*FIELDS, REASONS[1]), FIELDS):
            command = [smi, "-i", str(index), "--format=csv,noheader,nounits"]
            command.append("--query-gpu=" + ",".join(fields))
            probe = subprocess.run(command, capture_output=True, text=True, check=False)
            if probe.returncode == 0 and parse_line(probe.stdout.strip(), 0.0) is not None:
                break
        else:
            return
        self._process = subprocess.Popen(
            [*command, "-lms", str(interval_ms)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        for line in self._process.stdout:
            sample = parse_line(line, time.monotonic())
            if sample is not None:
                self.samples.append(sample)

    def window(self, start: float, end: float) -> GpuSummary | None:
        """The samples read between ``start`` and ``end`` (time.monotonic())."""
        return summarize([s for s in self.samples if start <= s.t <= end])

    def close(self) -> None:
        if self._process is not None:
            self._process.terminate()
            self._process.wait(10)
            self._reader.join(10)


@contextlib.contextmanager
def gpu_monitor(index: int = 0, interval_ms: int = 200) -> Iterator[GpuMonitor]:
    monitor = GpuMonitor(index, interval_ms)
    try:
        yield monitor
    finally:
        monitor.close()
