"""The router and the tokenizer run no model: importing their processes' modules loads no torch
(about 180 MB of resident memory each)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO

PROBE = "import importlib, sys; importlib.import_module(sys.argv[1]); print('torch' in sys.modules)"


@pytest.mark.parametrize(
    "module",
    [
        "services.router.app",
        "services.router.__main__",
        "services.tokenizer.app",
        "services.tokenizer.__main__",
        "services.tokenizer.workers",
        "stageserve.client",  # what users import: the gRPC client
    ],
)
def test_service_imports_no_torch(module: str) -> None:
    result = subprocess.run(
        [sys.executable, "-c", PROBE, module],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False", f"{module} imports torch"


def test_the_probe_sees_torch_when_it_is_imported() -> None:
    result = subprocess.run(
        [sys.executable, "-c", PROBE, "services.engine.model.rope"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.stdout.strip() == "True", result.stderr
