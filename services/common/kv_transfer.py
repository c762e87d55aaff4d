"""The transfer backends by name: what each can move, and the checks the services run on them.

One ``TransferBackend`` per name carries both families' constructors (KV handoff prefill ->
decode, embedding rows vision encoder -> prefill) as ``"module:Class"`` under
``services.transfer`` (imported only when ``services.transfer`` creates one), where the memory
it moves may live, how far it reaches, and the constructor kwargs it takes from a
``TransferSpec``. ``--transfer-backend`` names the embedding backend (and the KV one unless
``--kv-transfer-backend`` is given). Kept free of heavy imports: the ``stageserve`` command
line reads it.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

MOONCAKE_HOST_ONLY_BUILD = "mooncake-transfer-engine-non-cuda"
ROLES = ("kv_sender", "kv_receiver", "embedding_sender", "embedding_receiver")


class TransferSpec(msgspec.Struct, frozen=True):
    """How a process builds its end of ``backend``; what a backend does not take is not passed."""

    backend: str
    host: str = "127.0.0.1"  # Mooncake: the address its engine advertises
    protocol: str = "tcp"  # Mooncake: "tcp" | "rdma"
    staging_rows: int = 8192  # Mooncake: rows of the encoder's registered send staging buffer


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


def _mooncake_kwargs(spec: TransferSpec, role: str) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"hostname": spec.host, "protocol": spec.protocol}
    if role == "embedding_sender":
        kwargs["staging_rows"] = spec.staging_rows
    return kwargs


def _mooncake_gpu_build() -> str:
    if mooncake_moves_device_memory():
        return ""
    return f"mooncake-transfer-engine (the CUDA build; {MOONCAKE_HOST_ONLY_BUILD} is installed)"


def _no_kwargs(spec: TransferSpec, role: str) -> dict[str, Any]:
    del spec, role
    return {}


def _any_build() -> str:
    return ""


BOTH = frozenset({"cpu", "cuda"})


@dataclass(frozen=True)
class TransferBackend:
    """One backend: its four constructors, what memory it moves, how far, and what it takes."""

    name: str
    kv_sender: str  # "module:Class" in services.transfer
    kv_receiver: str
    embedding_sender: str
    embedding_receiver: str
    kv_devices: frozenset[str]  # device types ("cpu", "cuda") the KV pool it moves may be on
    buffer_devices: frozenset[str]  # device types prefill's embedding buffer may be on
    cross_process: bool  # its two ends may be different processes
    cross_host: bool  # ... on different hosts
    summary: str  # what it is, for --help
    # its sender writes some of each page's KV heads (a tensor-parallel prefill rank's)
    writes_head_slices: bool = False
    spec_kwargs: Callable[[TransferSpec, str], dict[str, Any]] = _no_kwargs  # (spec, role)
    # "" when the installed build moves GPU memory, else the build to install for that
    gpu_build: Callable[[], str] = _any_build

    def kwargs(self, spec: TransferSpec, role: str) -> dict[str, Any]:
        """The constructor kwargs ``spec`` gives this backend's ``role`` (one of ``ROLES``)."""
        assert spec.backend == self.name and role in ROLES
        return self.spec_kwargs(spec, role)


BACKENDS: dict[str, TransferBackend] = {
    b.name: b
    for b in (
        TransferBackend(
            "mooncake",
            "mooncake_backend:MooncakeKVSender",
            "mooncake_backend:MooncakeKVReceiver",
            "embeddings_mooncake:MooncakeEmbeddingSender",
            "embeddings_mooncake:MooncakeEmbeddingReceiver",
            kv_devices=BOTH,
            buffer_devices=BOTH,
            cross_process=True,
            cross_host=True,
            summary="Mooncake Transfer Engine over TCP or RDMA, across hosts",
            spec_kwargs=_mooncake_kwargs,
            gpu_build=_mooncake_gpu_build,
        ),
        TransferBackend(
            "inprocess",
            "inprocess_backend:InProcessKVSender",
            "inprocess_backend:InProcessKVReceiver",
            "embeddings_inprocess:InProcessEmbeddingSender",
            "embeddings_inprocess:InProcessEmbeddingReceiver",
            kv_devices=BOTH,
            buffer_devices=BOTH,
            cross_process=False,
            cross_host=False,
            summary="tensor copies inside one process",
            writes_head_slices=True,
        ),
        TransferBackend(
            "cuda_ipc",
            "cuda_ipc_backend:CudaIpcKVSender",
            "cuda_ipc_backend:CudaIpcKVReceiver",
            "embeddings_cuda_ipc:CudaIpcEmbeddingSender",
            "embeddings_cuda_ipc:CudaIpcEmbeddingReceiver",
            kv_devices=frozenset({"cuda"}),
            buffer_devices=frozenset({"cuda"}),
            cross_process=True,
            cross_host=False,
            summary="CUDA IPC between GPUs of one host, needs --device cuda",
        ),
        TransferBackend(
            "shm",
            "shm_backend:ShmKVSender",
            "shm_backend:ShmKVReceiver",
            "embeddings_shm:ShmEmbeddingSender",
            "embeddings_shm:ShmEmbeddingReceiver",
            kv_devices=frozenset({"cpu"}),
            buffer_devices=frozenset({"cpu"}),
            cross_process=True,
            cross_host=False,
            summary="host memory shared through /dev/shm by processes of one host and user, "
            "no network port, CPU KV pools only",
            writes_head_slices=True,
        ),
    )
}
CROSS_PROCESS_BACKENDS = tuple(name for name, b in BACKENDS.items() if b.cross_process)

KV_BACKEND_HELP = (
    f"KV handoff prefill -> decode: {' | '.join(BACKENDS)} ("
    + "; ".join(f"{b.name} = {b.summary}" for b in BACKENDS.values())
    + "); default: --transfer-backend"
)


def lookup_backend(name: str, family: str = "KV") -> TransferBackend:
    """The backend registered as ``name``; ``ValueError`` naming ``family`` if there is none."""
    backend = BACKENDS.get(name)
    if backend is None:
        raise ValueError(
            f"unknown {family} transfer backend {name!r}; supported: {', '.join(BACKENDS)}"
        )
    return backend


def device_type(device: str) -> str:
    return "cuda" if device.startswith("cuda") else "cpu"


def one_host_backend(device: str) -> str:
    """The backend made for memory on ``device`` between processes of one host (shm, cuda_ipc)."""
    kind = frozenset({device_type(device)})
    return next(
        name
        for name, b in BACKENDS.items()
        if b.cross_process and not b.cross_host and b.kv_devices == kind
    )


def check_cross_process(name: str, why: str) -> None:
    """``ValueError`` when backend ``name`` cannot cross processes (``why`` says whose are
    apart); an unknown name is left to the checks of its family."""
    backend = BACKENDS.get(name)
    if backend is not None and not backend.cross_process:
        raise ValueError(
            f"the {name} transfer backend moves data within one process, and {why}: use one of "
            f"{', '.join(CROSS_PROCESS_BACKENDS)}"
        )


def check_cross_host(name: str, why: str) -> None:
    """``ValueError`` when backend ``name`` cannot cross hosts (``why`` says whose are apart)."""
    backend = BACKENDS.get(name)
    if backend is not None and not backend.cross_host:
        across = [b.name for b in BACKENDS.values() if b.cross_host]
        raise ValueError(
            f"the {name} transfer backend moves data within one host, and {why}: use "
            f"{' or '.join(across)}"
        )


def resolve_kv_backend(kv_transfer_backend: str | None, transfer_backend: str) -> str:
    """The KV backend to run (``kv_transfer_backend``, else ``transfer_backend``); ``ValueError``
    if unknown."""
    name = transfer_backend if kv_transfer_backend is None else kv_transfer_backend
    return lookup_backend(name).name


def check_kv_backend(kv_transfer_backend: str | None, transfer_backend: str, device: str) -> str:
    """``resolve_kv_backend``, with a KV pool on ``device`` the backend can move (its
    ``kv_devices``, and GPU memory only with a build that moves it); ``ValueError`` otherwise."""
    backend = BACKENDS[resolve_kv_backend(kv_transfer_backend, transfer_backend)]
    kind, alternative = device_type(device), one_host_backend(device)
    if kind not in backend.kv_devices:
        raise ValueError(
            f"the {backend.name} KV transfer backend moves host memory and the KV pool is on "
            f"{device!r}: use --kv-transfer-backend {alternative} ({BACKENDS[alternative].summary})"
            if kind == "cuda"
            else f"the {backend.name} KV transfer backend needs a CUDA device (--device cuda), "
            f"got {device!r}"
        )
    gpu_build = backend.gpu_build() if kind == "cuda" else ""
    if gpu_build:
        raise ValueError(
            f"the installed {backend.name} build moves host memory only and the KV pool is on "
            f"{device!r}: use --kv-transfer-backend {alternative} or install {gpu_build}"
        )
    return backend.name


def check_embedding_backend(name: str, devices: Sequence[str]) -> str:
    """``name`` if embedding rows can travel over it between ends on ``devices`` (the encoder's
    or prefill's): a backend whose buffer must be GPU memory only when every one is a CUDA
    device; ``ValueError`` otherwise."""
    if name not in BACKENDS:
        raise ValueError(
            f"embedding transfer backend {name!r} is not supported; supported: "
            f"{', '.join(BACKENDS)} (choose the KV backend with --kv-transfer-backend)"
        )
    backend = BACKENDS[name]
    off_gpu = [device for device in devices if device_type(device) == "cpu"]
    if "cpu" not in backend.buffer_devices and off_gpu:
        reach = "" if backend.cross_host else " of one host"
        raise ValueError(
            f"the {name} embedding transfer backend moves rows between GPUs{reach} and needs the "
            f"vision encoder and prefill on CUDA devices, got {off_gpu[0]!r}: use "
            f"--transfer-backend {one_host_backend('cpu')}"
        )
    return name


def default_embedding_backend(encoder_device: str, prefill_device: str) -> str:
    """``stageserve up``'s embedding backend when ``--transfer-backend`` is not given: GPU to
    GPU (cuda_ipc) when the encoder and prefill both run on CUDA, else host memory (shm)."""
    on_gpus = device_type(encoder_device) == device_type(prefill_device) == "cuda"
    return one_host_backend("cuda" if on_gpus else "cpu")


def default_kv_backend(devices: Sequence[str]) -> str:
    """``stageserve up``'s KV backend when neither transfer flag is given: the one-host backend
    of the memory every KV pool (prefill's and decode's, on ``devices``) is in; ``ValueError``
    when they are in both."""
    kinds = {device_type(device) for device in devices}
    if len(kinds) != 1:
        raise ValueError(
            f"prefill and decode's KV pools are on {', '.join(devices)}: no one-host KV backend "
            "moves both host and GPU memory; use --kv-transfer-backend mooncake (its CUDA build)"
        )
    return one_host_backend(kinds.pop())
