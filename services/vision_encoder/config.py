"""Vision encoder configuration: built once from the command line, never mutated."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.service_main import ServiceConfig


@dataclass(frozen=True)
class VisionEncoderConfig(ServiceConfig):
    transfer_backend: str = "mooncake"  # embedding rows to prefill: "mooncake" | "inprocess" | "shm"
    transfer_host: str = "127.0.0.1"  # address this process's transfer engine advertises to peers (Mooncake)
    transfer_protocol: str = "tcp"  # Mooncake transport: "tcp" | "rdma"
    staging_rows: int = 8192  # rows of the registered staging buffer sends go through (Mooncake)
    cache_bytes: int = 256 * 1024 * 1024  # embedding cache budget
    max_batch_images: int = 32  # images (spans) one ViT batch takes at most
    max_image_bytes: int = 20 * 1024 * 1024  # compressed size limit of one image
    default_timeout_s: float = 60.0  # deadline of a call that carries none
    watchdog_s: float = 30.0  # NOT_SERVING while encodes wait but no batch starts or ends this long
    world_size: int = 1  # encoder ranks (owner election); only 1 runs in this version
