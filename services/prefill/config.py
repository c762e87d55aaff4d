"""Configuration of one prefill worker, built once from the command line."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.kv_transfer import resolve_kv_backend
from services.common.service_main import ServiceConfig


@dataclass(frozen=True)
class PrefillConfig(ServiceConfig):
    encoder_address: str = ""  # vision encoder "host:port"; empty: text-only prompts
    transfer_backend: str = (
        "mooncake"  # embedding rows from the encoder (and KV unless kv_transfer_backend)
    )
    kv_transfer_backend: str | None = None  # KV handoff backend; None = same as transfer_backend
    transfer_hostname: str = ""  # address the transfer engine advertises; empty: --host
    num_pages: int = 1024  # local KV pool: the batch's KV is computed here, then copied to decode
    page_size: int = 16  # must equal decode's page size
    embedding_rows: int = 16384  # rows of the image-embedding buffer the encoder writes into
    max_batch_tokens: int = 8192  # prompt tokens per prefill batch (a longer prompt runs alone)
    max_queued_requests: int = 256  # live requests before RESOURCE_EXHAUSTED
    attention_backend: str = "torch"
    default_timeout_s: float = 300.0  # requests that carry no deadline at all
    embedding_quarantine_s: float = 30.0  # rows of a timed-out Encode rest this long before reuse
    peer_ready_timeout_s: float = 120.0  # wait this long for the encoder to be SERVING at start
    watchdog_s: float = (
        30.0  # NOT_SERVING while the worker has work but makes no progress this long
    )
    max_kv_ref_nonces: int = 262144  # used KvRef nonces kept, each until its KvRef expires
    devices: tuple[str, ...] = ("cpu",)  # one rank process per entry: C = len(devices) CP ranks
    cp_block_tokens: int = (
        64  # block b of a pass's tokens goes to CP rank b % C (1 or k * page_size)
    )
    cp_min_tokens: int = 2048  # a batch with fewer prompt tokens runs on one rank
    step_timeout_s: float = 60.0  # a plan's deadline on the ranks; a rank past it is declared dead
    image_store_mb: int = 256  # image bytes held for calls that name an image by hash alone
    cuda_graph_max_tokens: int = 640  # unsharded passes up to this many tokens: graphs; 0: eager
    gpu_share_file: str = ""  # the ranks mark their forwards there for a decode on the same GPU

    @property
    def num_ranks(self) -> int:
        return len(self.devices)

    @property
    def kv_backend(self) -> str:
        """The KV handoff backend; ``ValueError`` for one the service cannot run."""
        return resolve_kv_backend(self.kv_transfer_backend, self.transfer_backend)

    @property
    def advertised_hostname(self) -> str:
        return self.transfer_hostname or self.host


def rank_devices(device: str, devices: str, ranks: int, flag: str = "--ranks") -> tuple[str, ...]:
    """One device per CP rank from ``--devices`` or ``ranks`` x ``--device``; ``ValueError`` naming
    the
    value (``flag``: the flag that gave ``ranks``)."""
    if devices:
        named = tuple(d.strip() for d in devices.split(","))
        if ranks not in (1, len(named)):
            raise ValueError(
                f"{flag} {ranks} does not match the {len(named)} --devices {devices!r}"
            )
        return named
    if device == "cuda" and ranks == 1:
        return (
            "cuda:0",
        )  # that it exists is the rank's start-up check, as for decode and the encoder
    if device == "cuda":
        import torch

        if ranks > torch.cuda.device_count():
            raise ValueError(
                f"{flag} {ranks} needs {ranks} GPUs; this host has {torch.cuda.device_count()}"
            )
        return tuple(f"cuda:{i}" for i in range(ranks))
    if device.startswith("cuda:") and ranks > 1:
        raise ValueError(
            f"{flag} {ranks} with device {device}: name each rank's GPU (prefill --devices)"
        )
    return (device,) * ranks


def check_block_tokens(block_tokens: int, page_size: int) -> None:
    if block_tokens != 1 and (block_tokens <= 0 or block_tokens % page_size):
        raise ValueError(
            f"--cp-block-tokens {block_tokens} must be 1 or a positive multiple of --page-size "
            f"{page_size}"
        )
