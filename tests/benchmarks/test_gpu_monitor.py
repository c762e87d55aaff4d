"""``benchmarks.gpu_monitor``: nvidia-smi's lines parsed, a window summarized, and the monitor
against a stand-in ``nvidia-smi`` on PATH (none at all on a CPU machine)."""

from __future__ import annotations

import os
import textwrap
import time

import pytest

from benchmarks.gpu_monitor import (
    GpuMonitor,
    GpuSample,
    GpuSummary,
    gpu_cells,
    gpu_monitor,
    parse_line,
    summarize,
)


def test_parse_line_reads_busy_clock_power_and_the_slowdown_bits():
    sample = parse_line("97, 1755, 689.61, 0x0000000000000004", 3.0)
    assert sample == GpuSample(3.0, 0.97, 1755.0, 689.61, 0x4)  # SW power cap
    # idle (0x1) and applications-clocks (0x2) are not slowdowns
    assert parse_line("0, 1980, 120.0, 0x0000000000000003", 0.0).slowdown == 0
    assert parse_line("50, 1980, [N/A]", 1.0) == GpuSample(1.0, 0.5, 1980.0, None, None)
    assert parse_line("[N/A], 1980, 100", 0.0) is None
    assert parse_line("Failed to initialize NVML", 0.0) is None


def test_summarize_means_and_the_share_of_slowed_samples():
    samples = [
        GpuSample(0.0, 1.0, 1800.0, 700.0, 0x4),
        GpuSample(0.2, 0.9, 1900.0, None, 0),
        GpuSample(0.4, 0.8, 2000.0, 600.0, None),
    ]
    assert summarize(samples) == GpuSummary(3, pytest.approx(0.9), 1900.0, 650.0, 0.5)
    assert summarize([]) is None
    assert gpu_cells(summarize(samples)) == ("0.90", "1900", "650", "0.50")
    assert gpu_cells(None) == ("-", "-", "-", "-")


FAKE_SMI = textwrap.dedent(
    """\
    #!/bin/sh
    # stands for nvidia-smi: the newer reasons field is refused, the older one answered
    case "$*" in *clocks_event_reasons*) echo "Field is not a valid field"; exit 2;; esac
    case "$*" in *-lms*) ;; *) echo "91, 1830, 650.5, 0x4"; exit 0;; esac
    i=0
    while true; do
        echo "9$((i % 10)), 1830, 650.5, 0x4"
        i=$((i + 1))
        sleep 0.05
    done
    """
)


def test_the_monitor_samples_until_closed_and_summarizes_a_window(tmp_path, monkeypatch):
    smi = tmp_path / "nvidia-smi"
    smi.write_text(FAKE_SMI)
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    with gpu_monitor(interval_ms=50) as monitor:
        start = time.monotonic()
        deadline_mono = start + 30
        while len(monitor.samples) < 5 and time.monotonic() < deadline_mono:
            time.sleep(0.05)
        end = time.monotonic()
    count = len(monitor.samples)
    assert count >= 5
    time.sleep(0.2)
    assert len(monitor.samples) == count  # closed: nothing more is read
    summary = monitor.window(start, end)
    assert summary is not None and 0.9 <= summary.busy <= 0.99
    assert summary.sm_mhz == 1830.0 and summary.power_w == 650.5 and summary.slowed == 1.0
    assert monitor.window(end + 1, end + 2) is None


def test_without_nvidia_smi_nothing_is_sampled(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monitor = GpuMonitor()
    assert monitor.samples == [] and monitor.window(0.0, time.monotonic()) is None
    monitor.close()
