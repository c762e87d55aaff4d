"""Shared helpers for the benchmark tests."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import REPO


@pytest.fixture
def quick_benchmark(tmp_path: Path) -> Callable[..., str]:
    """Run ``python -m <module> --quick <args>`` into a temporary report that already holds
    ``other_title``'s section; returns the report's text, checked to keep that section and to
    hold ``title``'s."""

    def run(module: str, title: str, other_title: str, *args: str) -> str:
        out = tmp_path / "benchmarks.md"
        out.write_text(f"# Benchmarks\n\n{other_title}\n\nkept\n")
        command = [sys.executable, "-m", module, "--quick", *args, "--out", str(out)]
        command += ["--workdir", str(tmp_path / "work")]
        run = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        text = out.read_text()
        assert "kept" in text and title in text
        return text

    return run
