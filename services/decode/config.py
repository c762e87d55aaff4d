"""Decode service configuration: built once from the command line, never mutated."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from services.common.kv_transfer import BACKENDS, KV_BACKEND_HELP, resolve_kv_backend
from services.common.rank_devices import device_list
from services.common.service_main import ServiceConfig
from services.common.settings import at_least, flag, non_negative, positive, positive_int
from services.engine.gpu_defaults import (
    ATTENTION_CHOICES,
    ATTENTION_HELP,
    AUTO_ATTENTION,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    memory_fraction,
)
from services.engine.kv_sizing import CPU_NUM_PAGES
from services.engine.quantization import kv_cache_dtype_flag, quantization_flag

# With a GPU share file: a step waits at most this long for prefill's forwards; a little more
# than one forward of a large prefill batch, so decode stays near one step per prefill forward
# while a burst of prompts runs (docs/benchmarks.md, "Measurements cited by the code").
PREFILL_FIRST_MS = 100.0
# A decode process's shutdown after its drain: the gRPC grace (5 s, services/common/server.py),
# then its ranks' stop (their stop grace, 5 s), and a margin.
STOP_AFTER_DRAIN_S = 15.0


@dataclass(frozen=True)
class DecodeConfig(ServiceConfig):
    devices: tuple[str, ...] = flag(
        ("cpu",),
        type=device_list,
        metavar="DEV,DEV,...",
        help="one rank process per device, comma-separated (cuda:0,cuda:1); default: --ranks "
        "on --device. With --tp T, processes d*T .. d*T+T-1 are data-parallel rank d",
    )
    tp: int = flag(
        1,
        type=positive_int,
        help="tensor-parallel processes per data-parallel rank (dividing the processes): each "
        "holds 1/T of the decoder and a KV pool of its KV heads; the first runs the rank's "
        "batch and the others its forwards",
    )
    ep: int = flag(
        1,
        type=positive_int,
        help="expert-parallel processes of an MoE model's experts: 1, or --tp (with "
        "--dp-attention: 1, or every process)",
    )
    dp_attention: bool = flag(
        False,
        help="DP attention: the data-parallel ranks (one process each, --tp 1) keep their own "
        "requests, KV pool and attention, and their MLP and MoE layers split over all of them "
        "(experts: --ep D); every rank joins every step, an idle rank with no rows",
    )
    num_pages: int | None = flag(
        None,
        type=positive_int,
        help="KV pages in the pool of each rank (default: sized at start from "
        f"--gpu-memory-utilization on CUDA, {CPU_NUM_PAGES} on the CPU)",
    )
    gpu_memory_utilization: float = flag(
        DEFAULT_GPU_MEMORY_UTILIZATION,
        type=memory_fraction,
        aliases=("--mem-fraction-static",),
        help="share of each of its GPUs decode holds, split evenly between its ranks on that "
        "GPU: weights, activations, CUDA graphs, and a KV pool of what is left (without "
        "--num-pages)",
    )
    page_size: int = flag(16, type=positive_int, help="token slots per KV page")
    max_model_len: int | None = flag(
        None,
        type=at_least(2),
        help="context limit, prompt + generated tokens (default: max_position_embeddings)",
    )
    max_running_requests: int = flag(
        256, type=positive_int, help="largest decode batch of each rank"
    )
    attention_backend: str = flag(AUTO_ATTENTION, choices=ATTENTION_CHOICES, help=ATTENTION_HELP)
    quantization: str = quantization_flag()
    kv_cache_dtype: str = kv_cache_dtype_flag()
    transfer_backend: str = flag(
        "mooncake",
        help=f"transfer backend: {' | '.join(BACKENDS)}; the KV one unless --kv-transfer-backend",
    )
    kv_transfer_backend: str | None = flag(None, help=KV_BACKEND_HELP)
    transfer_host: str | None = flag(
        None, help="hostname the transfer engine advertises to prefill (default: --host)"
    )
    watchdog_s: float = flag(
        30.0,
        type=positive,
        help="a rank with work that reports no step for this long is declared dead (hung): "
        "its requests fail and it restarts",
    )
    reservation_timeout_s: float = flag(
        60.0, type=positive, help="lifetime of a reservation whose request carries no deadline"
    )
    max_reservation_s: float = flag(
        300.0,
        type=positive,
        help="longest a reservation lives before Generate, whatever deadline its "
        "Reserve asks (keep it at or above the router's --request-timeout-s)",
    )
    kv_quarantine_s: float = flag(
        35.0,
        type=non_negative,
        help="how long the pages of a reservation aborted or expired before its KV was ready "
        "wait before reuse, since an abandoned transfer may still write them; keep it above "
        "Mooncake's MC_TRANSFER_TIMEOUT (default 30); 0 frees them at once",
    )
    gpu_share_file: str = flag(
        "",
        help="the file a prefill service on the same GPU marks its forwards in (its "
        "--gpu-share-file): a rank holds its next step back while one runs, so the prompts "
        "run on the GPU alone; stageserve up sets it when prefill and decode share a CUDA device",
    )
    drain_timeout_s: float | None = flag(
        None,
        type=non_negative,
        help="on SIGTERM: report not ready, refuse new Reserves (UNAVAILABLE: the router tries "
        "another decode worker) and give the requests held (reserved and generating) this long "
        "to finish, then fail the rest and exit (default: --max-reservation-s, the longest a "
        "request lives here)",
    )
    prefill_first_ms: float | None = flag(
        None,
        type=non_negative,
        help="with --gpu-share-file: the longest a rank's step waits for prefill's forwards "
        f"(what it may add to one token's latency; default {PREFILL_FIRST_MS:g}); 0: never waits",
    )

    def __post_init__(self) -> None:
        if self.reservation_timeout_s > self.max_reservation_s:
            raise ValueError(
                f"--reservation-timeout-s ({self.reservation_timeout_s}) must be <= "
                f"--max-reservation-s ({self.max_reservation_s})"
            )
        if self.prefill_first_ms is not None and not self.gpu_share_file:
            raise ValueError("--prefill-first-ms needs --gpu-share-file (prefill's marks)")

    @property
    def drain_s(self) -> float:
        """How long a SIGTERM leaves the requests held to finish."""
        return self.max_reservation_s if self.drain_timeout_s is None else self.drain_timeout_s

    @property
    def stop_s(self) -> float:
        """The longest a SIGTERM takes to end the process: the drain, then the rest."""
        return self.drain_s + STOP_AFTER_DRAIN_S

    @property
    def prefill_first_s(self) -> float:
        """How long a step waits at most for prefill's forwards (0: no share file)."""
        if not self.gpu_share_file:
            return 0.0
        ms = PREFILL_FIRST_MS if self.prefill_first_ms is None else self.prefill_first_ms
        return ms / 1000

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks, each ``tp`` processes (``check_rank_split`` checked it divides)."""
        return len(self.devices) // self.tp

    @property
    def rank_memory_fraction(self) -> float:
        """Each rank's share of its GPU: ``gpu_memory_utilization`` over the most ranks that
        share one device."""
        return self.gpu_memory_utilization / max(Counter(self.devices).values())

    @property
    def kv_backend(self) -> str:
        """The KV handoff backend; ``ValueError`` for one the service cannot run."""
        return resolve_kv_backend(self.kv_transfer_backend, self.transfer_backend)
