"""What ``stageserve up`` runs when its flags do not say, from the devices it was given.

On CUDA: CUDA IPC for the KV handoff and the embedding rows (GPUs of one host), flashinfer
attention when it is importable (else torch, said in the line ``UpChoices.describe`` gives),
and decode's CUDA graphs (on with flashinfer; torch attention runs eagerly). On the CPU: shm
and torch. A choice given on the command line (``UpFlags``, ``LaunchConfig.given``) is kept; one
that cannot work on its devices is refused with the reason (``ValueError``), before anything
starts.

GPU memory, ``--gpu-memory-utilization U`` (SGLang's ``--mem-fraction-static``): the share of
each GPU the services hold together. On a device, each prefill rank is set ``PREFILL_SHARE``
aside and each vision encoder rank ``ENCODER_SHARE``; decode's ranks there split the rest
evenly and each sizes its KV pool to fill its part (``services.engine.kv_sizing``). With
decode on several devices the smallest rest holds for all. ``--num-pages`` gives decode's
pool a count instead. Pure: the caller passes this host's GPU count and whether flashinfer
imports.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from services.common.kv_transfer import (
    default_embedding_backend,
    default_kv_backend,
    device_type,
)
from services.common.rank_devices import rank_devices
from services.engine.gpu_defaults import (
    AUTO_ATTENTION,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    FLASHINFER_DTYPES,
    default_attention_backend,
)
from services.launch_config import ENCODER_SHARE, PREFILL_SHARE, LaunchConfig, UpFlags
from services.launch_spec import decode_devices, decode_processes, device_of


@dataclass(frozen=True)
class RankLayout:
    """The device of every rank of the three model services, ``cuda`` written ``cuda:0``."""

    encoder: tuple[str, ...]
    prefill: tuple[str, ...]
    decode: tuple[str, ...]

    @property
    def all(self) -> tuple[str, ...]:
        return (*self.encoder, *self.prefill, *self.decode)


@dataclass(frozen=True)
class UpChoices:
    """What the services run: passed to each as its own flags."""

    transfer_backend: str  # the embedding rows, encoder -> prefill
    kv_transfer_backend: str  # the KV handoff, prefill -> decode
    attention_backend: str  # prefill and decode
    decode_memory_fraction: float | None  # decode's --gpu-memory-utilization; None: not on CUDA
    attention_note: str = ""  # why attention is what it is, when not the best

    def describe(self, layout: RankLayout, flags: UpFlags) -> str:
        """The one line ``up`` prints at start."""
        utilization = flags.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION
        graphs = "on" if self.attention_backend == "flashinfer" else "off (torch attention)"
        if flags.num_pages is not None:
            pool = f"{flags.num_pages} pages per rank (--num-pages)"
        elif self.decode_memory_fraction is None:
            pool = "decode's CPU default"
        else:
            pool = (
                f"{self.decode_memory_fraction:.2f} of each decode GPU "
                f"(--gpu-memory-utilization {utilization:g} less prefill's and the encoder's "
                "share), split between its ranks"
            )
        note = f" ({self.attention_note})" if self.attention_note else ""
        return (
            f"devices: encoder {','.join(layout.encoder)}, prefill {','.join(layout.prefill)}, "
            f"decode {','.join(layout.decode)}; attention {self.attention_backend}{note}; "
            f"KV transfer {self.kv_transfer_backend}; embedding transfer "
            f"{self.transfer_backend}; decode CUDA graphs {graphs}; KV pool {pool}"
        )


def rank_layout(cfg: LaunchConfig, num_cuda_devices: int | None = None) -> RankLayout:
    """Every model rank's device; ``ValueError`` for a layout the services would refuse.
    ``num_cuda_devices``: this host's GPUs (default: torch's count, asked only when needed)."""
    encoder = rank_devices(
        (),
        cfg.encoder_ranks,
        device_of(cfg, "vision_encoder"),
        spread_cuda=False,
        service="vision_encoder",
    )
    prefill = rank_devices(
        (),
        cfg.prefill_ranks,
        device_of(cfg, "prefill"),
        spread_cuda=True,
        service="prefill",
        flag=cfg.prefill_ranks_flag,
        num_cuda_devices=num_cuda_devices,
    )
    devices = decode_devices(cfg)
    listed = devices if len(devices) > 1 else ()
    decode = rank_devices(
        listed, decode_processes(cfg), devices[0], spread_cuda=False, service="decode"
    )
    return RankLayout(encoder, prefill, decode)


def check_cuda_devices(devices: Sequence[str], num_cuda_devices: int) -> None:
    """``ValueError`` naming a CUDA device this host does not have."""
    for device in devices:
        if device_type(device) != "cuda":
            continue
        index = int(device.partition(":")[2] or 0)
        if index >= num_cuda_devices:
            raise ValueError(
                f"device {device!r}: this host has {num_cuda_devices} CUDA device(s)"
                + ("" if num_cuda_devices else " (is the GPU visible, and torch a CUDA build?)")
            )


def resolve_up(
    layout: RankLayout,
    flags: UpFlags,
    num_cuda_devices: int,
    has_flashinfer: bool,
    dtype: str = "bfloat16",
    head_dim: int = 128,
) -> UpChoices:
    """The backends and memory share ``up`` gives its services for a model run in ``dtype``;
    ``ValueError`` for a combination that cannot work on ``layout``'s devices."""
    check_cuda_devices(layout.all, num_cuda_devices)
    if flags.num_pages is not None and flags.gpu_memory_utilization is not None:
        raise ValueError(
            "--num-pages and --gpu-memory-utilization both size decode's KV pool: give one"
        )
    kv_ends = (*layout.prefill, *layout.decode)
    transfer = flags.transfer_backend or default_embedding_backend(
        layout.encoder[0], layout.prefill[0]
    )
    kv = flags.kv_transfer_backend or flags.transfer_backend or default_kv_backend(kv_ends)
    attention, note = _attention(kv_ends, flags.attention_backend, has_flashinfer, dtype, head_dim)
    utilization = flags.gpu_memory_utilization
    fraction = None
    if flags.num_pages is None and device_type(layout.decode[0]) == "cuda":
        fraction = decode_memory_fraction(layout, utilization or DEFAULT_GPU_MEMORY_UTILIZATION)
    return UpChoices(transfer, kv, attention, fraction, note)


def _attention(
    devices: Sequence[str], given: str | None, has_flashinfer: bool, dtype: str, head_dim: int
) -> tuple[str, str]:
    on_cuda = all(device_type(device) == "cuda" for device in devices)
    if given == "flashinfer" and not on_cuda:
        raise ValueError(
            "--attention-backend flashinfer runs on CUDA devices only; prefill and decode are on "
            f"{', '.join(devices)}"
        )
    if given == "flashinfer" and not has_flashinfer:
        raise ValueError(
            "--attention-backend flashinfer: flashinfer is not installed (pip install "
            "'stageserve[gpu]'), or choose --attention-backend torch"
        )
    if given == "flashinfer" and dtype not in FLASHINFER_DTYPES:
        raise ValueError(
            f"--attention-backend flashinfer runs bfloat16 or float16 models; this one runs "
            f"{dtype} (give --dtype bfloat16, or --attention-backend torch)"
        )
    if given not in (None, AUTO_ATTENTION):
        return given, ""
    chosen = default_attention_backend(devices, has_flashinfer, dtype, head_dim)
    if on_cuda and chosen == "torch" and not has_flashinfer:
        return chosen, "flashinfer is not installed: install the `gpu` extra"
    if on_cuda and chosen == "torch" and dtype not in FLASHINFER_DTYPES:
        return chosen, f"flashinfer runs bfloat16 or float16; the model is {dtype}"
    if on_cuda and chosen == "torch":
        return chosen, f"flashinfer has no kernels for the model's head size {head_dim}"
    return chosen, ""


def decode_memory_fraction(layout: RankLayout, utilization: float) -> float:
    """Decode's share of each of its GPUs: ``utilization`` less what its prefill and encoder
    ranks are set aside there, the smallest over decode's devices; ``ValueError`` when none is
    left."""
    encoder, prefill = Counter(layout.encoder), Counter(layout.prefill)
    rests = {}
    for device in set(layout.decode):
        aside = prefill[device] * PREFILL_SHARE + encoder[device] * ENCODER_SHARE
        rests[device] = utilization - aside
    device, rest = min(rests.items(), key=lambda item: item[1])
    if rest <= 0:
        raise ValueError(
            f"--gpu-memory-utilization {utilization:g} leaves decode nothing on {device}: "
            f"{prefill[device]} prefill rank(s) are set {PREFILL_SHARE:g} aside each and "
            f"{encoder[device]} encoder rank(s) {ENCODER_SHARE:g}; raise it, give --num-pages, "
            "or put decode on its own GPU"
        )
    return round(rest, 4)
