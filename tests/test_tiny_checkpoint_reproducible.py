"""scripts/make_tiny_checkpoint.py regenerates each bundled checkpoint bit for bit."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO, TINY_MODEL_DIR

ASSETS = TINY_MODEL_DIR.parent


@pytest.mark.parametrize(
    ("arch", "committed_dir"),
    [
        ("qwen2_5_vl", TINY_MODEL_DIR),
        ("qwen3_vl", ASSETS / "tiny-qwen3-vl"),
        ("qwen3_vl_moe", ASSETS / "tiny-qwen3-vl-moe"),
    ],
)
def test_checkpoint_script_regenerates_identical_files(tmp_path, arch, committed_dir):
    out = tmp_path / "tiny"
    script = str(REPO / "scripts" / "make_tiny_checkpoint.py")
    subprocess.run([sys.executable, script, "--arch", arch, "--out", str(out)], check=True)
    committed = sorted(p.name for p in committed_dir.iterdir())
    assert sorted(p.name for p in out.iterdir()) == committed
    for name in committed:
        assert (out / name).read_bytes() == (committed_dir / name).read_bytes(), name
