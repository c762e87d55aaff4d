"""scripts/make_tiny_checkpoint.py regenerates the bundled checkpoint bit for bit."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO, TINY_MODEL_DIR


def test_checkpoint_script_regenerates_identical_files(tmp_path):
    out = tmp_path / "tiny"
    subprocess.run(
        [sys.executable, str(REPO / "scripts" / "make_tiny_checkpoint.py"), "--out", str(out)],
        check=True,
    )
    committed = sorted(p.name for p in TINY_MODEL_DIR.iterdir())
    assert sorted(p.name for p in out.iterdir()) == committed
    for name in committed:
        assert (out / name).read_bytes() == (TINY_MODEL_DIR / name).read_bytes(), name
