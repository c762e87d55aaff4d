"""The status exchange of a group of one rank (every decode rank's, once per token): its own
status back, packed and unpacked as every row is, and no collective."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO

SCRIPT = """
import sys
import torch.distributed as dist
from services.common.ranks.agreement import exchange
from services.common.ranks.messages import RankStatus

dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
def no_collective(*args, **kwargs):
    raise AssertionError("a group of one gathered")
dist.all_gather = no_collective
failed = RankStatus(step=7, rank=0, is_ok=False, error="boom", error_type="ValueError")
assert exchange(dist.group.WORLD, failed, 1.0) == [failed]
ok = RankStatus(step=8, rank=0, is_ok=True)
assert exchange(dist.group.WORLD, ok, 1.0) == [ok]
dist.destroy_process_group()
print("agreed")
"""


def test_a_group_of_one_gets_its_own_status_without_a_collective(tmp_path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "store")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and done.stdout.strip() == "agreed", done.stderr
