"""A stand-in for ``benchmarks.gpu_monitor.GpuMonitor``: records each window it is asked for and
answers it with one fixed summary."""

from __future__ import annotations

from benchmarks.gpu_monitor import GpuSummary


class RecordingMonitor:
    def __init__(self, summary: GpuSummary) -> None:
        self.summary = summary
        self.windows: list[tuple[float, float]] = []

    def window(self, start: float, end: float) -> GpuSummary:
        self.windows.append((start, end))
        return self.summary
