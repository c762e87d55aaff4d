"""Which transfer backends the prefill and decode services run: ``--kv-transfer-backend``.

The KV handoff (prefill -> decode) and the embedding rows (vision encoder -> prefill)
pick their backends separately: ``--transfer-backend`` names the embedding one (and the
KV one unless ``--kv-transfer-backend`` is given). Kept free of heavy imports: the
``stageserve`` command line reads it.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Sequence

# KV backends a service can build on its own (all of services.transfer's).
SERVICE_KV_BACKENDS = ("mooncake", "inprocess", "cuda_ipc", "shm")
EMBEDDING_BACKENDS = ("mooncake", "inprocess", "shm", "cuda_ipc")

KV_BACKEND_HELP = (
    "KV handoff prefill -> decode: mooncake | inprocess | cuda_ipc | shm (cuda_ipc = CUDA IPC "
    "between GPUs of one host, needs --device cuda; shm = host memory shared through /dev/shm by "
    "processes of one host and user, no network port, CPU KV pools only); default: "
    "--transfer-backend"
)


MOONCAKE_HOST_ONLY_BUILD = "mooncake-transfer-engine-non-cuda"


def mooncake_moves_device_memory() -> bool:
    """Whether the installed Mooncake build reads and writes GPU memory.

    ``mooncake-transfer-engine`` (the CUDA build) does; ``mooncake-transfer-engine-non-cuda``
    moves host memory only: its TCP transport fails a GPU address with EFAULT ("Bad address").
    """
    try:
        importlib.metadata.distribution(MOONCAKE_HOST_ONLY_BUILD)
    except importlib.metadata.PackageNotFoundError:
        return True
    return False


def resolve_kv_backend(kv_transfer_backend: str | None, transfer_backend: str) -> str:
    """The KV backend to run (``kv_transfer_backend``, else ``transfer_backend``); ``ValueError`` if unsupported."""
    name = transfer_backend if kv_transfer_backend is None else kv_transfer_backend
    choices = ", ".join(SERVICE_KV_BACKENDS)
    if name not in SERVICE_KV_BACKENDS:
        raise ValueError(f"unknown KV transfer backend {name!r}; supported: {choices}")
    return name


def check_kv_backend(kv_transfer_backend: str | None, transfer_backend: str, device: str) -> str:
    """``resolve_kv_backend``; cuda_ipc only on a CUDA ``device``, shm only off one, and Mooncake on
    one only with a build that moves GPU memory (the KV pool lives there); ``ValueError``
    otherwise."""
    name = resolve_kv_backend(kv_transfer_backend, transfer_backend)
    if name == "cuda_ipc" and not device.startswith("cuda"):
        raise ValueError(
            f"the cuda_ipc KV transfer backend needs a CUDA device (--device cuda), got {device!r}"
        )
    if name == "shm" and device.startswith("cuda"):
        raise ValueError(
            f"the shm KV transfer backend moves host memory and the KV pool is on {device!r}: use "
            "--kv-transfer-backend cuda_ipc (GPUs of one host)"
        )
    if name == "mooncake" and device.startswith("cuda") and not mooncake_moves_device_memory():
        raise ValueError(
            f"the installed Mooncake build ({MOONCAKE_HOST_ONLY_BUILD}) moves host memory only and the KV "
            f"pool is on {device!r}: use --kv-transfer-backend cuda_ipc (GPUs of one host) or install "
            "mooncake-transfer-engine (the CUDA build)"
        )
    return name


def check_embedding_backend(transfer_backend: str, devices: Sequence[str]) -> str:
    """``transfer_backend`` if embedding rows can travel over it between ends on ``devices`` (the
    encoder's or prefill's); cuda_ipc only when every one is a CUDA device; ``ValueError``
    otherwise."""
    if transfer_backend not in EMBEDDING_BACKENDS:
        raise ValueError(
            f"embedding transfer backend {transfer_backend!r} is not supported; supported: "
            f"{', '.join(EMBEDDING_BACKENDS)} (choose the KV backend with --kv-transfer-backend)"
        )
    off_gpu = [device for device in devices if not device.startswith("cuda")]
    if transfer_backend == "cuda_ipc" and off_gpu:
        raise ValueError(
            "the cuda_ipc embedding transfer backend moves rows between GPUs of one host and "
            f"needs the vision encoder and prefill on CUDA devices, got {off_gpu[0]!r}: use "
            "--transfer-backend shm"
        )
    return transfer_backend


def default_embedding_backend(
    kv_backend: str | None, encoder_device: str, prefill_device: str
) -> str:
    """``stageserve up``'s embedding backend when ``--transfer-backend`` is not given: cuda_ipc when
    the
    KV handoff is cuda_ipc and the encoder and prefill both run on CUDA, shm otherwise."""
    on_gpus = encoder_device.startswith("cuda") and prefill_device.startswith("cuda")
    return "cuda_ipc" if kv_backend == "cuda_ipc" and on_gpus else "shm"
