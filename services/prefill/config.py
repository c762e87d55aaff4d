"""Configuration of one prefill worker, built once from the command line."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.kv_transfer import CROSS_PROCESS_BACKENDS, KV_BACKEND_HELP, resolve_kv_backend
from services.common.rank_devices import device_list_or_join
from services.common.ranks.config import JOIN
from services.common.service_main import ServiceConfig
from services.common.settings import (
    MAX_PORT,
    flag,
    non_negative,
    non_negative_int,
    positive,
    positive_int,
)
from services.engine.gpu_defaults import ATTENTION_CHOICES, ATTENTION_HELP, AUTO_ATTENTION
from services.engine.quantization import kv_cache_dtype_flag, quantization_flag

# A prefill process's shutdown after its drain: the gRPC grace (5 s, services/common/server.py),
# then its rank group's stop (its stop grace, 5 s), and a margin.
STOP_AFTER_DRAIN_S = 15.0


@dataclass(frozen=True)
class PrefillConfig(ServiceConfig):
    encoder_address: str = flag("", help="vision encoder host:port (empty: text-only prompts)")
    transfer_backend: str = flag(
        "mooncake",
        help="embedding rows from the encoder (and KV unless --kv-transfer-backend): "
        f"{' | '.join(CROSS_PROCESS_BACKENDS)} (cuda_ipc: into a GPU buffer over CUDA IPC, needs "
        "--device cuda)",
    )
    kv_transfer_backend: str | None = flag(None, help=KV_BACKEND_HELP)
    transfer_hostname: str = flag(
        "",
        name="transfer_host",
        aliases=("--transfer-hostname",),
        help="address the transfer engine advertises (default --host)",
    )
    num_pages: int = flag(
        1024,
        type=positive_int,
        help="pages of the local KV pool (the batch's KV is computed here, then copied to decode)",
    )
    page_size: int = flag(16, type=positive_int, help="tokens per KV page; must equal decode's")
    disable_prefix_cache: bool = flag(
        False,
        help="compute every prompt whole; by default the pool's pages not in use keep the KV "
        "of recent prompts' full pages (least recently used out first), and a prompt that "
        "starts with the same tokens and images reads them instead of computing them",
    )
    host_cache_gb: float = flag(
        0.0,
        type=non_negative,
        help="host memory (GB, per rank) for the prefix cache's second tier: pages evicted from "
        "the device pool are copied there, and a prompt that reuses one gets it copied back "
        "instead of computing it (pinned memory on a GPU; 0: no host tier)",
    )
    kv_store_master: str = flag(
        "",
        help="HOST:PORT of a Mooncake store's master shared by every prefill worker: the prefix "
        "cache's third tier (pages one worker computed, another reads instead of computing "
        "them; a store that is down is skipped). Default: none",
    )
    kv_store_segment_gb: float = flag(
        1.0,
        type=non_negative,
        help="--kv-store-master: memory (GB) each rank lends the store for pages (0: none)",
    )
    embedding_rows: int = flag(
        16384, type=positive_int, help="rows of the image-embedding buffer the encoder writes into"
    )
    max_batch_tokens: int = flag(
        8192,
        type=positive_int,
        help="prompt tokens per prefill batch (a longer prompt runs alone)",
    )
    max_queued_requests: int = flag(
        256, type=positive_int, help="live requests; more get RESOURCE_EXHAUSTED"
    )
    attention_backend: str = flag(AUTO_ATTENTION, choices=ATTENTION_CHOICES, help=ATTENTION_HELP)
    quantization: str = quantization_flag()
    kv_cache_dtype: str = kv_cache_dtype_flag()
    default_timeout_s: float = flag(
        300.0, type=positive, help="deadline of a request that carries none"
    )
    drain_timeout_s: float | None = flag(
        None,
        type=non_negative,
        help="on SIGTERM: report not ready, refuse new prefills (UNAVAILABLE: the router tries "
        "another prefill worker) and give the ones in flight this long to finish, then fail the "
        "rest and exit (default: --default-timeout-s, the longest a prefill runs here)",
    )
    embedding_quarantine_s: float = flag(
        30.0, type=non_negative, help="rows of a timed-out Encode wait this long before reuse"
    )
    peer_ready_timeout_s: float = flag(
        120.0, type=positive, help="how long to wait at start for the vision encoder to be SERVING"
    )
    watchdog_s: float = flag(
        30.0,
        type=positive,
        help="health turns NOT_SERVING when the worker has a batch but makes no progress for "
        "this long",
    )
    max_kv_ref_nonces: int = flag(
        262144,
        type=positive_int,
        help="nonces of used KvRefs kept (each until its KvRef expires, for replay "
        "checks); when full, new requests get RESOURCE_EXHAUSTED",
    )
    devices: tuple[str, ...] = flag(
        ("cpu",),
        type=device_list_or_join,
        metavar="DEV,DEV,...",
        help="one rank process per device, e.g. cuda:0,cuda:1 (default: --ranks on --device); "
        "with --tp T, processes c*T .. c*T+T-1 are CP rank c's tensor-parallel group; 'join': "
        "a rank started on another host by `stageserve join-rank` (needs --rank-address)",
    )
    rank_address: str = flag(
        "",
        metavar="HOST:PORT",
        help="with 'join' devices: where the rank group listens for ranks on other hosts (its "
        "control socket, rank 0's rendezvous and the ranks' collectives on HOST, this host's "
        "address they reach; the control socket on PORT); the joining ranks' --leader is "
        "tcp://HOST:PORT",
    )
    tp: int = flag(
        1,
        type=positive_int,
        help="tensor-parallel ranks per CP rank (dividing the rank processes): each holds 1/T of "
        "the decoder's attention heads, MLP, vocabulary and (with --ep T) experts, and writes "
        "its KV heads into decode's pools (the shm and inprocess KV backends write any heads; "
        "the others whole pages: decode's --tp must then be T); the vision tower is not split",
    )
    ep: int = flag(
        1,
        type=positive_int,
        help="expert-parallel ranks of an MoE model's experts: 1, --tp (each rank of a TP "
        "group holds 1/T of every MoE layer's experts), or with --tp 1 the CP ranks (each CP "
        "rank holds 1/C of them and the rest of the decoder whole; every layer's MoE runs on "
        "every CP rank's tokens)",
    )
    cp_block_tokens: int = flag(
        64,
        type=int,
        help="CP shard: block b of a pass's tokens goes to rank b %% C (1, or a multiple of "
        "--page-size)",
    )
    cp_min_tokens: int = flag(
        2048,
        type=positive_int,
        help="a batch with fewer prompt tokens runs on one rank (no CP collectives)",
    )
    step_timeout_s: float = flag(
        60.0,
        type=positive,
        help="a batch's deadline on the ranks: a rank past it is declared dead and the group "
        "re-formed",
    )
    image_store_mb: int = flag(
        256,
        type=positive_int,
        help="MiB of compressed image bytes held (least recently used out first), so that a "
        "router sends an image's bytes once: later calls name it by its hash alone",
    )
    cuda_graph_max_tokens: int = flag(
        640,
        type=non_negative_int,
        help="a CUDA rank runs a pass of up to this many tokens (not CP-sharded) on CUDA graphs "
        "of every layer but attention, captured at start for token sizes up to it; 0 runs "
        "every pass eagerly (CPU ranks always do)",
    )
    gpu_share_file: str = flag(
        "",
        help="a file shared with a decode service on the same GPU: each rank marks its forwards "
        "in it and that decode holds its steps back while one runs (its --prefill-first-ms); "
        "stageserve up sets it when prefill and decode share a CUDA device",
    )

    @property
    def num_ranks(self) -> int:
        """Rank processes: ``cp_size`` TP groups of ``tp``."""
        return len(self.devices)

    @property
    def cp_size(self) -> int:
        """Context-parallel ranks (``check_tensor_parallel`` made ``tp`` divide the ranks)."""
        return self.num_ranks // self.tp

    @property
    def drain_s(self) -> float:
        """How long a SIGTERM leaves the prefills in flight to finish."""
        return self.default_timeout_s if self.drain_timeout_s is None else self.drain_timeout_s

    @property
    def stop_s(self) -> float:
        """The longest a SIGTERM takes to end the process: the drain, then the rest."""
        return self.drain_s + STOP_AFTER_DRAIN_S

    @property
    def kv_backend(self) -> str:
        """The KV handoff backend; ``ValueError`` for one the service cannot run."""
        return resolve_kv_backend(self.kv_transfer_backend, self.transfer_backend)

    @property
    def advertised_hostname(self) -> str:
        return self.transfer_hostname or self.host


def check_block_tokens(block_tokens: int, page_size: int) -> None:
    if block_tokens != 1 and (block_tokens <= 0 or block_tokens % page_size):
        raise ValueError(
            f"--cp-block-tokens {block_tokens} must be 1 or a positive multiple of --page-size "
            f"{page_size}"
        )


def joining_address(config: PrefillConfig) -> tuple[str, int] | None:
    """``(host, port)`` of ``--rank-address`` when ranks join from other hosts, else None;
    ``ValueError`` for a rank address without 'join' devices, or one that cannot be listened on
    (the backends that must cross hosts are ``app.check_backends``')."""
    joining = JOIN in config.devices
    if not config.rank_address:
        if joining:
            raise ValueError(
                "--devices has 'join' ranks: --rank-address HOST:PORT names where they find their "
                "group (this host's address they reach)"
            )
        return None
    if not joining:
        raise ValueError("--rank-address is where ranks on other hosts join: --devices has none")
    host, _, port = config.rank_address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) <= MAX_PORT:
        raise ValueError(f"--rank-address must be HOST:PORT, got {config.rank_address!r}")
    if host in ("0.0.0.0", "::", "[::]", "*"):
        raise ValueError(
            f"--rank-address {config.rank_address}: name this host's address the joining ranks "
            "reach (its store and collectives listen there), not a wildcard"
        )
    if config.gpu_share_file:
        raise ValueError("--gpu-share-file is a file of one host: not with 'join' ranks")
    return host, int(port)


def check_parallel(config: PrefillConfig) -> None:
    """``ValueError`` naming the numbers when ``--tp`` / ``--ep`` cannot split the ranks or
    the model (``check_rank_split``, or ``check_experts_over_cp``), or the shared KV store is
    asked of TP ranks."""
    from services.engine.parallel import check_rank_split

    if config.tp == 1 and config.ep > 1:
        check_experts_over_cp(config)
    else:
        check_rank_split(config.model, config.devices, config.tp, config.ep, "prefill")
    if config.tp > 1 and config.kv_store_master and not config.disable_prefix_cache:
        raise ValueError(
            f"--kv-store-master with --tp {config.tp}: the shared store keeps whole pages, and a "
            "tensor-parallel rank holds some of each page's KV heads"
        )


def check_experts_over_cp(config: PrefillConfig) -> None:
    """``ValueError`` naming the numbers unless ``--ep`` (with ``--tp 1``) splits an MoE
    model's experts over every CP rank, each on a GPU of its own (NCCL) or on the CPU."""
    from services.common.errors import ModelLoadError
    from services.engine.config import ModelConfig
    from services.engine.parallel import check_tensor_parallel

    ep, num_ranks = config.ep, config.num_ranks
    if ep != num_ranks:
        raise ValueError(
            f"expert parallel size {ep} with tensor parallel size 1 splits the experts over the "
            f"CP ranks: prefill --ep must then equal their number, {num_ranks} (or --tp, to "
            "split them over each TP group)"
        )
    try:
        check_tensor_parallel(ModelConfig.from_dir(config.model).text, ep, ep, dp_attention=True)
    except ModelLoadError as exc:
        raise ValueError(f"prefill: {config.model}: {exc.message}") from exc
    cuda = [d for d in config.devices if d.startswith("cuda")]
    if len(set(cuda)) < len(cuda):
        raise ValueError(
            f"prefill --ep {ep} over CP ranks that share a CUDA device "
            f"({', '.join(config.devices)}): the experts' collectives run over NCCL, one GPU "
            "per rank"
        )
