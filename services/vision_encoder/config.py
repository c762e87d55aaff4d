"""Vision encoder configuration: built once from the command line, never mutated."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from services.common.kv_transfer import CROSS_PROCESS_BACKENDS, check_embedding_backend
from services.common.rank_devices import device_list
from services.common.service_main import ServiceConfig
from services.common.settings import flag, positive_int

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
    devices: tuple[str, ...] = flag(
        ("cpu",),
        type=device_list,
        metavar="DEV,DEV,...",
        help="one rank process per device, e.g. cuda:0,cuda:1 (default: --ranks on --device)",
    )
    tp: int = flag(
        1,
        type=positive_int,
        help="tensor-parallel processes per encoder rank (dividing the rank processes, each "
        "group of T on distinct GPUs): each holds 1/T of the ViT's attention heads and MLP and "
        "runs every forward; the first holds the rank's cache and sends its rows",
    )
    cache_bytes: int = flag(
        256 * 1024 * 1024,
        help="embedding cache budget of each rank, bytes (W ranks hold W times this)",
    )
    max_batch_images: int = flag(32, help="images one batch takes at most, over all ranks")
    max_image_bytes: int = flag(20 * 1024 * 1024, help="size limit of one compressed image")
    default_timeout_s: float = flag(60.0, help="deadline of a call that carries none")
    step_timeout_s: float = flag(
        60.0,
        help="a batch's limit on the ranks: a rank past it is declared dead and re-formed alone",
    )
    watchdog_s: float = flag(
        30.0,
        help="health turns NOT_SERVING when encodes wait but no batch starts or ends for this long",
    )
    pixel_method: str = flag(
        "auto",
        choices=PIXEL_METHODS,
        help="where the ranks resize, normalize and patchify: pil (CPU, bit-exact with "
        "transformers), torch (on the rank's device, within one uint8 level), "
        "auto (torch on CUDA ranks, pil on CPU ranks)",
    )
    vit_cuda_graphs: int = flag(
        8,
        help="batch layouts (lists of image grids) whose ViT CUDA graph each CUDA rank keeps, "
        "least recently used out first; a layout is captured the second time it is seen; "
        "0 runs the ViT eagerly (CPU ranks always do)",
    )
    transfer_backend: str = flag(
        "mooncake",
        choices=TRANSFER_BACKENDS,
        help="embedding rows to prefill (cuda_ipc: GPU to GPU on one host, ranks on CUDA "
        "devices; shm: /dev/shm on one host)",
    )
    transfer_host: str = flag(
        "127.0.0.1",
        help="address each rank's transfer engine advertises to peers (Mooncake; it "
        "listens on every interface)",
    )
    transfer_protocol: str = flag("tcp", help="Mooncake transport: tcp | rdma")
    staging_rows: int = flag(
        8192, help="rows of each rank's registered send staging buffer (Mooncake)"
    )

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
        check_tp_groups(self.devices, self.tp)
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
        """Encoder ranks (W), each ``tp`` processes."""
        return len(self.devices) // self.tp

    def rank_devices(self, rank: int) -> tuple[str, ...]:
        """The devices of encoder rank ``rank``'s ``tp`` processes (adjacent in ``devices``)."""
        return self.devices[rank * self.tp : (rank + 1) * self.tp]


def check_tp_groups(devices: tuple[str, ...], tp: int) -> None:
    """``ValueError`` naming the numbers unless ``devices`` split into encoder ranks of ``tp``
    processes whose collectives can run (``check_group_devices``)."""
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    from services.engine.parallel import check_group_devices

    check_group_devices(devices, tp, "vision_encoder", f"--tp {tp}")


def check_vision_split(model_dir: Path, tp: int) -> None:
    """``ValueError`` naming the numbers unless the checkpoint's vision tower splits over
    ``tp`` processes (its heads and MLP intermediate size divide by it)."""
    if tp == 1:
        return
    from services.common.errors import ModelLoadError
    from services.engine.config import ModelConfig
    from services.engine.model.vision import check_vision_parallel

    try:
        check_vision_parallel(ModelConfig.from_dir(model_dir).vision, tp)
    except ModelLoadError as exc:
        raise ValueError(f"vision_encoder: {model_dir}: {exc.message}") from exc
