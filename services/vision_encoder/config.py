"""Vision encoder configuration: built once from the command line, never mutated."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.kv_transfer import CROSS_PROCESS_BACKENDS, check_embedding_backend
from services.common.service_main import ServiceConfig

# The encoder's ranks are their own processes: rows leave them through a backend that
# crosses processes ("inprocess" needs the encoder and prefill in one process).
TRANSFER_BACKENDS = CROSS_PROCESS_BACKENDS
PIXEL_METHODS = (
    "auto",
    "pil",
    "torch",
)  # pixels.resolve_method: auto is torch on CUDA, pil elsewhere


@dataclass(frozen=True)
class VisionEncoderConfig(ServiceConfig):
    devices: tuple[str, ...] = ("cpu",)  # one rank process per entry ("cpu", "cuda:N")
    transfer_backend: str = "mooncake"  # embedding rows to prefill: "mooncake" | "shm" | "cuda_ipc"
    transfer_host: str = "127.0.0.1"  # address each rank's transfer engine advertises (Mooncake)
    transfer_protocol: str = "tcp"  # Mooncake transport: "tcp" | "rdma"
    staging_rows: int = 8192  # rows of each rank's registered staging buffer (Mooncake)
    cache_bytes: int = 256 * 1024 * 1024  # embedding cache budget of each rank
    max_batch_images: int = 32  # images (spans) one batch takes at most, over all ranks
    max_image_bytes: int = 20 * 1024 * 1024  # compressed size limit of one image
    default_timeout_s: float = 60.0  # deadline of a call that carries none
    step_timeout_s: float = 60.0  # a batch's step on the ranks; a rank past it is declared dead
    watchdog_s: float = 30.0  # NOT_SERVING while encodes wait but no batch starts or ends this long
    pixel_method: str = (
        "auto"  # resize/normalize/patchify: "auto" (torch on CUDA) | "pil" | "torch"
    )
    vit_cuda_graphs: int = 8  # batch layouts whose ViT graphs each CUDA rank keeps; 0: eager

    def __post_init__(self) -> None:
        if self.transfer_backend not in TRANSFER_BACKENDS:
            raise ValueError(
                f"the vision encoder sends rows through {', '.join(TRANSFER_BACKENDS)}, got "
                f"{self.transfer_backend!r} (its ranks are their own processes; inprocess "
                "needs the encoder and prefill in one process)"
            )
        if self.pixel_method not in PIXEL_METHODS:
            raise ValueError(
                f"pixel_method must be one of {PIXEL_METHODS}, got {self.pixel_method!r}"
            )
        if not self.devices:
            raise ValueError("the vision encoder needs at least one rank device")
        check_embedding_backend(self.transfer_backend, self.devices)
        if self.vit_cuda_graphs < 0:
            raise ValueError(f"vit_cuda_graphs must be >= 0, got {self.vit_cuda_graphs}")
        for field in ("cache_bytes", "max_batch_images", "max_image_bytes", "staging_rows"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{field} must be > 0, got {getattr(self, field)}")
        for field in ("default_timeout_s", "step_timeout_s", "watchdog_s"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{field} must be > 0, got {getattr(self, field)}")

    @property
    def num_ranks(self) -> int:
        return len(self.devices)


def rank_devices(devices: str | None, num_ranks: int | None, device: str) -> tuple[str, ...]:
    """The ranks' devices from ``--devices a,b`` or ``--ranks W`` (each on ``--device``);
    ``ValueError`` when they disagree."""
    if num_ranks is not None and num_ranks < 1:
        raise ValueError(f"--ranks must be >= 1, got {num_ranks}")
    if devices:
        listed = tuple(d.strip() for d in devices.split(","))
        if num_ranks is not None and num_ranks != len(listed):
            raise ValueError(f"--ranks {num_ranks} disagrees with --devices {devices!r}")
        return listed
    return ("cuda:0" if device == "cuda" else device,) * (num_ranks or 1)
