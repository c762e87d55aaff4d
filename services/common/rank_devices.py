"""One device per rank process, from ``--devices`` or ``--ranks`` on ``--device``.

The vision encoder, prefill and decode each run their ranks as processes, one per device of
their config's ``devices``; they differ only in what ``--device cuda`` with several ranks
means (``spread_cuda``).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence

from services.common.ranks.config import JOIN
from services.common.settings import positive_int

_DEVICE = re.compile(r"^(cpu|cuda|cuda:\d+)$")


def device_list(text: str) -> tuple[str, ...]:
    """``--devices``: ``cpu`` or ``cuda[:N]`` entries, comma-separated."""
    devices = tuple(d.strip() for d in text.split(",") if d.strip())
    if not devices or any(not _DEVICE.match(d) for d in devices):
        raise argparse.ArgumentTypeError(f"expected cpu or cuda:N, comma-separated; got {text!r}")
    return devices


def device_list_or_join(text: str) -> tuple[str, ...]:
    """``--devices`` of a rank group that may span hosts: ``device_list``'s entries, or ``join``
    for a rank started on another host (``stageserve join-rank``); never the first (rank 0 runs
    beside its leader)."""
    entries = tuple(d.strip() for d in text.split(",") if d.strip())
    local = ",".join(d for d in entries if d != JOIN)
    if not entries or entries[0] == JOIN or not local:
        raise argparse.ArgumentTypeError(
            f"expected cpu or cuda:N, comma-separated, with 'join' for a rank on another host "
            f"(never the first); got {text!r}"
        )
    device_list(local)
    return entries


def local_devices(devices: Sequence[str]) -> tuple[str, ...]:
    """The devices of the ranks spawned on this host (a ``join`` rank brings its own, of the
    same kind: its leader refuses one that does not)."""
    return tuple(d for d in devices if d != JOIN)


def shares_a_device(devices: Sequence[str]) -> bool:
    """Whether two of this host's ranks share a device (a joining rank has one of its own)."""
    local = local_devices(devices)
    return len(set(local)) < len(local)


def add_rank_args(parser: argparse.ArgumentParser, ranks_help: str) -> None:
    """``--ranks`` (not a config field: it resolves into ``devices``), and ``--devices`` (the
    config's field) defaulting to none named."""
    parser.add_argument("--ranks", type=positive_int, default=None, help=ranks_help)
    parser.set_defaults(devices=())


def rank_devices(
    devices: Sequence[str],
    ranks: int | None,
    device: str,
    *,
    spread_cuda: bool,
    service: str,
    flag: str = "--ranks",
    num_cuda_devices: int | None = None,
) -> tuple[str, ...]:
    """The device of each rank: the named ``devices`` (``ranks``, when given, must count
    them), else ``ranks`` (default 1) on ``device``; ``cuda`` alone is ``cuda:0``. With
    ``spread_cuda``, ``cuda`` and C ranks mean ``cuda:0`` .. ``cuda:C-1`` (this host must have
    them) and ``cuda:N`` with C > 1 is refused; without it every rank shares ``device``.
    ``ValueError`` naming ``flag`` (the flag that gave ``ranks``). ``num_cuda_devices``: this
    host's GPUs (default: torch's count, asked only when needed)."""
    if ranks is not None and ranks < 1:
        raise ValueError(f"{flag} must be >= 1, got {ranks}")
    if devices:
        if ranks is not None and ranks != len(devices):
            named = ",".join(devices)
            raise ValueError(
                f"{flag} {ranks} disagrees with the {len(devices)} --devices {named!r}"
            )
        return tuple(_one(d) for d in devices)
    if not _DEVICE.match(device):
        raise ValueError(f"--device must be cpu, cuda or cuda:N, got {device!r}")
    count = ranks or 1
    if spread_cuda and count > 1 and device == "cuda":
        if num_cuda_devices is None:
            import torch

            num_cuda_devices = torch.cuda.device_count()
        if count > num_cuda_devices:
            raise ValueError(f"{flag} {count} needs {count} GPUs; this host has {num_cuda_devices}")
        return tuple(f"cuda:{i}" for i in range(count))
    if spread_cuda and count > 1 and device.startswith("cuda:"):
        raise ValueError(
            f"{flag} {count} with device {device}: name each rank's GPU ({service} --devices)"
        )
    return (_one(device),) * count


def _one(device: str) -> str:
    return "cuda:0" if device == "cuda" else device
