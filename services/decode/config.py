"""Decode service configuration: built once from the command line, never mutated."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path

from services.common.gpu_share import GpuShare
from services.common.kv_transfer import (
    BACKENDS,
    KV_BACKEND_HELP,
    check_kv_backend,
    resolve_kv_backend,
)
from services.common.paths import BUNDLED_MODEL
from services.common.service_main import ServiceConfig, add_common_args

_DEVICE = re.compile(r"^(cpu|cuda|cuda:\d+)$")
# With a GPU share file: a step waits at most this long for prefill's forwards. 100 ms keeps
# decode near one step per prefill forward (a 4 x 1000-token batch takes ~80 ms alone on an
# H200 at 7B dimensions) while a burst of prompts runs.
PREFILL_FIRST_MS = 100.0


@dataclass(frozen=True)
class DecodeConfig(ServiceConfig):
    model: Path = BUNDLED_MODEL
    ranks: int = 1  # DP ranks, each a process on --device (unless devices names them)
    devices: tuple[str, ...] = ()  # one DP rank per entry ("cuda:0", "cuda:1", "cpu")
    num_pages: int = 2048
    page_size: int = 16
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_running_requests: int = 256
    attention_backend: str = "torch"
    transfer_backend: str = "mooncake"  # the KV backend unless kv_transfer_backend
    kv_transfer_backend: str | None = None  # KV handoff backend; None = same as transfer_backend
    transfer_host: str | None = None  # None: --host; the address prefill's transfer engine reaches
    watchdog_s: float = 30.0
    sweep_interval_s: float = 0.5
    reservation_timeout_s: float = 60.0  # a Reserve without a deadline expires after this
    max_reservation_s: float = 300.0  # no reservation outlives this, whatever its Reserve asks
    kv_quarantine_s: float = (
        35.0  # pages of a reservation that failed before its KV was ready rest this long
    )
    gpu_share_file: str = ""  # prefill on this GPU marks its forwards there (gpu_share.py)
    prefill_first_ms: float | None = None  # with gpu_share_file; None: PREFILL_FIRST_MS

    @property
    def prefill_first_s(self) -> float:
        """How long a step waits at most for prefill's forwards (0: no share file)."""
        if not self.gpu_share_file:
            return 0.0
        ms = PREFILL_FIRST_MS if self.prefill_first_ms is None else self.prefill_first_ms
        return ms / 1000

    @property
    def rank_devices(self) -> tuple[str, ...]:
        """The device of each DP rank ("cuda" means "cuda:0")."""
        devices = self.devices or (self.device,) * self.ranks
        return tuple("cuda:0" if device == "cuda" else device for device in devices)

    @property
    def kv_backend(self) -> str:
        """The KV handoff backend; ``ValueError`` for one the service cannot run."""
        return resolve_kv_backend(self.kv_transfer_backend, self.transfer_backend)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m services.decode", description="The stageserve decode service."
    )
    add_common_args(p)
    p.add_argument(
        "--ranks",
        type=int,
        default=1,
        help="data-parallel decode ranks, each its own process with its own KV pool and "
        "running batch, all on --device",
    )
    p.add_argument(
        "--devices",
        type=_devices,
        default=(),
        help="one DP rank per device, comma-separated (cuda:0,cuda:1); overrides --ranks",
    )
    p.add_argument("--num-pages", type=int, default=2048, help="KV pages in the pool of each rank")
    p.add_argument("--page-size", type=int, default=16, help="token slots per KV page")
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="context limit, prompt + generated tokens (default: max_position_embeddings)",
    )
    p.add_argument(
        "--max-running-requests", type=int, default=256, help="largest decode batch of each rank"
    )
    p.add_argument("--attention-backend", default="torch", help="torch | flashinfer")
    p.add_argument(
        "--transfer-backend",
        default="mooncake",
        help=f"transfer backend: {' | '.join(BACKENDS)}; the KV one unless --kv-transfer-backend",
    )
    p.add_argument("--kv-transfer-backend", default=None, help=KV_BACKEND_HELP)
    p.add_argument(
        "--transfer-host",
        default=None,
        help="hostname the transfer engine advertises to prefill (default: --host)",
    )
    p.add_argument(
        "--watchdog-s",
        type=float,
        default=30.0,
        help="a rank whose step takes longer is declared dead: its requests fail and it restarts",
    )
    p.add_argument(
        "--sweep-interval-s",
        type=float,
        default=0.5,
        help="how often expired reservations are released",
    )
    p.add_argument(
        "--reservation-timeout-s",
        type=float,
        default=60.0,
        help="lifetime of a reservation whose request carries no deadline",
    )
    p.add_argument(
        "--max-reservation-s",
        type=float,
        default=300.0,
        help="longest a reservation lives before Generate, whatever deadline its "
        "Reserve asks (keep it at or above the router's --request-timeout-s)",
    )
    p.add_argument(
        "--kv-quarantine-s",
        type=float,
        default=35.0,
        help="how long the pages of a reservation aborted or expired before its KV was ready "
        "wait before reuse, since an abandoned transfer may still write them; keep it above "
        "Mooncake's MC_TRANSFER_TIMEOUT (default 30); 0 frees them at once",
    )
    p.add_argument(
        "--gpu-share-file",
        default="",
        help="the file a prefill service on the same GPU marks its forwards in (its "
        "--gpu-share-file): a rank holds its next step back while one runs, so the prompts "
        "run on the GPU alone; stageserve up sets it when prefill and decode share a CUDA device",
    )
    p.add_argument(
        "--prefill-first-ms",
        type=float,
        default=None,
        help="with --gpu-share-file: the longest a rank's step waits for prefill's forwards "
        f"(what it may add to one token's latency; default {PREFILL_FIRST_MS:g}); 0: never waits",
    )
    return p


def _devices(text: str) -> tuple[str, ...]:
    devices = tuple(d.strip() for d in text.split(",") if d.strip())
    bad = [d for d in devices if not _DEVICE.match(d)]
    if not devices or bad:
        raise argparse.ArgumentTypeError(f"expected cpu or cuda:N, comma-separated; got {text!r}")
    return devices


def parse_config(argv: list[str] | None = None) -> DecodeConfig:
    args = build_parser().parse_args(argv)
    config = DecodeConfig(**{name.replace("-", "_"): value for name, value in vars(args).items()})
    _check(config)
    return config


def _check(config: DecodeConfig) -> None:
    if config.devices and config.ranks not in (1, len(config.devices)):
        raise SystemExit(
            f"--ranks {config.ranks} disagrees with --devices ({len(config.devices)} devices)"
        )
    if not config.devices and not _DEVICE.match(config.device):
        raise SystemExit(f"--device must be cpu, cuda or cuda:N, got {config.device!r}")
    positives = (
        "ranks",
        "num_pages",
        "page_size",
        "max_running_requests",
        "watchdog_s",
        "sweep_interval_s",
        "reservation_timeout_s",
        "max_reservation_s",
    )
    for name in positives:
        if getattr(config, name) <= 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be > 0, got {getattr(config, name)}")
    if config.reservation_timeout_s > config.max_reservation_s:
        raise SystemExit(
            f"--reservation-timeout-s ({config.reservation_timeout_s}) must be <= "
            f"--max-reservation-s ({config.max_reservation_s})"
        )
    if config.kv_quarantine_s < 0:
        raise SystemExit(f"--kv-quarantine-s must be >= 0, got {config.kv_quarantine_s}")
    if config.prefill_first_ms is not None:
        if not config.gpu_share_file:
            raise SystemExit("--prefill-first-ms needs --gpu-share-file (prefill's marks)")
        if config.prefill_first_ms < 0:
            raise SystemExit(f"--prefill-first-ms must be >= 0, got {config.prefill_first_ms}")
    if config.gpu_share_file:
        try:
            GpuShare(config.gpu_share_file).close()  # a path it cannot map fails here
        except ValueError as exc:
            raise SystemExit(f"--gpu-share-file: {exc}") from None
    if config.max_model_len is not None and config.max_model_len < 2:
        raise SystemExit(f"--max-model-len must be >= 2, got {config.max_model_len}")
    try:
        for device in config.rank_devices:
            check_kv_backend(config.kv_transfer_backend, config.transfer_backend, device)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
