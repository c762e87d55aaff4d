"""Agreed failure: after each step the ranks all-gather their statuses and reach one verdict.

Every rank packs its ``RankStatus`` into a fixed-size byte row, the rows are all-gathered
over the gloo control group with ``async_op=True`` + ``wait(timeout)``, and every rank
runs the same pure ``agree`` on the same rows: the step failed iff any rank failed, and
the error text is built from the lowest failing rank, so every rank (and the leader, who
gets it in each reply) holds the identical text. An exchange that times out or loses a
peer cannot agree: the rank reports itself BROKEN and the leader restarts the group.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec

from services.common.ranks.messages import RankStatus

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

STATUS_BYTES = 8192  # one rank's row: 4-byte length + msgpack RankStatus (errors are cut to fit)
_LEN_BYTES = 4
_status_decoder = msgspec.msgpack.Decoder(RankStatus)


class DesyncError(RuntimeError):
    """The ranks answered different steps: the group ran different sequences."""


def pack_status(status: RankStatus) -> bytes:
    body = msgspec.msgpack.encode(status)
    assert len(body) <= STATUS_BYTES - _LEN_BYTES, "error texts are cut to MAX_ERROR_CHARS"
    return len(body).to_bytes(_LEN_BYTES, "little") + body.ljust(STATUS_BYTES - _LEN_BYTES, b"\0")


def unpack_status(row: bytes) -> RankStatus:
    size = int.from_bytes(row[:_LEN_BYTES], "little")
    return _status_decoder.decode(row[_LEN_BYTES : _LEN_BYTES + size])


def agree(statuses: Sequence[RankStatus], step: int) -> RankStatus | None:
    """None when every rank succeeded at ``step``; else the one agreed failure.

    The failure keeps the lowest failing rank's ``error_type`` and an ``error`` text that
    names the step, that rank and its cause (and the other failing ranks). Raises
    ``DesyncError`` when a rank reports another step or ranks are missing or repeated.
    """
    ranks = [s.rank for s in statuses]
    if ranks != list(range(len(statuses))) or any(s.step != step for s in statuses):
        seen = ", ".join(f"rank {s.rank} at step {s.step}" for s in statuses)
        raise DesyncError(f"status exchange of step {step} is out of sync: {seen}")
    failed = [s for s in statuses if not s.is_ok]
    if not failed:
        return None
    first = failed[0]
    text = f"step {step} failed on rank {first.rank}: {first.error}"
    if len(failed) > 1:
        text += f" (ranks {', '.join(str(s.rank) for s in failed[1:])} failed too)"
    return RankStatus(
        step=step, rank=first.rank, is_ok=False, error=text, error_type=first.error_type
    )


def exchange(group: ProcessGroup, status: RankStatus, timeout_s: float) -> list[RankStatus]:
    """All-gather ``status`` over the gloo ``group``; raises if it does not end within
    ``timeout_s``. A group of one rank has nothing to gather: its own row, packed and
    unpacked as every row is (every decode rank is such a group, and steps once per token)."""
    import torch
    import torch.distributed as dist

    packed = pack_status(status)
    world_size = dist.get_world_size(group)
    if world_size == 1:
        return [unpack_status(packed)]
    row = torch.frombuffer(bytearray(packed), dtype=torch.uint8)
    rows = [torch.empty_like(row) for _ in range(world_size)]
    work = dist.all_gather(rows, row, group=group, async_op=True)
    assert work is not None
    work.wait(timeout=datetime.timedelta(seconds=max(timeout_s, 0.001)))
    return [unpack_status(r.numpy().tobytes()) for r in rows]
