"""What ``stageserve up`` is told: ``LaunchConfig``, each of its settings a flag declared once.

``add_up`` (``services/cli_up.py``) builds ``up``'s parser from these fields and ``_run_up`` the
config from the parsed flags (``services.common.settings``). ``UpFlags`` holds the settings whose
default depends on the devices (None: ``services.cli_up_defaults`` chooses); the fields that are
not flags hold what ``up`` chose (the backends, decode's memory share) or computes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from services.common.exposure import INSECURE_NO_API_KEY_FLAG
from services.common.kv_transfer import BACKENDS, CROSS_PROCESS_BACKENDS, KV_BACKEND_HELP
from services.common.logs import LOG_FORMATS
from services.common.paths import BUNDLED_MODEL
from services.common.restarts import RestartPolicy
from services.common.settings import (
    MAX_PORT,
    at_least,
    flag,
    nested,
    non_negative,
    port_number,
    positive,
)
from services.engine.gpu_defaults import (
    ATTENTION_CHOICES,
    ATTENTION_HELP,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    memory_fraction,
)
from services.engine.quantization import kv_cache_dtype_flag, quantization_flag
from services.router.config import AUTO_TOOL_CALL_PARSER
from services.router.tool_parsers import ToolFormat

# --metrics-port-base N: the service at index i serves /metrics on port N + i.
METRICS_PORT_ORDER = ("tokenizer", "vision_encoder", "prefill", "decode", "router")
MAX_LIVENESS_INTERVAL_S = 2.0
PREFILL_SHARE = 0.3  # of a GPU, set aside for each prefill rank on it
ENCODER_SHARE = 0.05  # of a GPU, set aside for each vision encoder rank on it


def default_router_workers(num_cpus: int | None = None) -> int:
    """Router processes for this machine: one per 8 CPUs, at least 1, at most 4."""
    num_cpus = num_cpus if num_cpus is not None else os.cpu_count() or 1
    return max(1, min(4, num_cpus // 8))


@dataclass(frozen=True)
class LivenessPolicy:
    """A running child that answered no liveness check (gRPC health ``liveness``) for
    ``timeout_s``, the latest check included, is killed (SIGKILL) and restarted like one that
    exited. Checks go out every ``interval_s``, each with that deadline. The tokenizer's pool
    workers get the same bound (its ``--worker-liveness-timeout-s``)."""

    timeout_s: float = flag(
        10.0,
        type=positive,
        help="a running service (or tokenizer worker process) that answers no liveness check "
        "for this long is killed and restarted",
    )

    @property
    def interval_s(self) -> float:
        return min(MAX_LIVENESS_INTERVAL_S, self.timeout_s / 4)


@dataclass(frozen=True)
class UpFlags:
    """The settings ``services.cli_up_defaults`` resolves against the devices; None: not
    given, chosen there."""

    transfer_backend: str | None = flag(
        None,
        help="embedding transfer (and KV unless --kv-transfer-backend): "
        f"{' | '.join(CROSS_PROCESS_BACKENDS)}; shm: /dev/shm shared by this host's processes, "
        "no network port; cuda_ipc: GPU to GPU on one host (encoder and prefill on CUDA). "
        "Default: cuda_ipc when the encoder and prefill run on CUDA, else shm",
    )
    kv_transfer_backend: str | None = flag(
        None,
        choices=BACKENDS,
        help=f"{KV_BACKEND_HELP}, else cuda_ipc when prefill and decode run on CUDA, "
        "shm on the CPU",
    )
    attention_backend: str | None = flag(
        None,
        choices=ATTENTION_CHOICES,
        help=f"prefill and decode attention: {ATTENTION_HELP} (default: auto)",
    )
    gpu_memory_utilization: float | None = flag(
        None,
        type=memory_fraction,
        aliases=("--mem-fraction-static",),
        help="share of each GPU the services hold together (weights, activations, CUDA graphs, "
        f"KV pools): each prefill rank on a GPU is set {PREFILL_SHARE:g} aside, each encoder "
        f"rank {ENCODER_SHARE:g}, and decode's ranks size their KV pools to the rest "
        f"(default {DEFAULT_GPU_MEMORY_UTILIZATION:g}); not with --num-pages",
    )
    num_pages: int | None = flag(
        None,
        type=at_least(1),
        help="decode KV pages per decode rank (default: sized from --gpu-memory-utilization on "
        "CUDA, decode's default on the CPU)",
    )


@dataclass(frozen=True)
class LaunchConfig:
    """Every service ``up`` starts, as one config. A flag whose default is None ("default: the
    router's" and the like) leaves the service's own default: the service gets no flag for it."""

    model: Path = flag(BUNDLED_MODEL, help="Hugging Face checkpoint directory")
    host: str = flag("127.0.0.1", help="address the services and the HTTP API bind")
    http_port: int = flag(
        8000, name="port", type=port_number, metavar="PORT", help="OpenAI-compatible HTTP port"
    )
    grpc_port: int = flag(
        0,
        type=port_number,
        metavar="PORT",
        help="the router's gRPC port, stageserve.v1.Router (default 0: a free one, printed once "
        "ready); with --router-workers > 1 the other routers take free ones",
    )
    enable_reflection: bool = flag(
        False, help="serve gRPC server reflection on the routers' gRPC ports (for grpcurl)"
    )
    device: str = flag("cpu", help="where the models run (each of the next three overrides it)")
    encoder_device: str | None = flag(None, help="the vision encoder's device (default: --device)")
    encoder_ranks: int | None = flag(
        None,
        type=int,
        help="the vision encoder's rank processes, all on its device (its --ranks; default: 1)",
    )
    encoder_tp: int = flag(
        1,
        type=at_least(1),
        help="the vision encoder's --tp: processes per encoder rank, each holding 1/T of the "
        "ViT (--encoder-ranks counts every process; CPU only here: they share its device)",
    )
    prefill_device: str | None = flag(
        None, help="prefill's device, e.g. cuda:0 (default: --device)"
    )
    decode_device: str | None = flag(
        None,
        help="decode's device, e.g. cuda:1 (default: --device); a list (cuda:0,cuda:1) puts one "
        "data-parallel rank on each",
    )
    dtype: str | None = flag(
        None, help="every model's dtype: float32 | bfloat16 | float16 (default: the checkpoint's)"
    )
    quantization: str = quantization_flag()  # prefill's and decode's
    kv_cache_dtype: str = kv_cache_dtype_flag()  # prefill's and decode's: their pages must agree
    given: UpFlags = nested(UpFlags)
    decode_dp: int = flag(
        1,
        type=at_least(1),
        help="decode's data-parallel ranks, each its own process (--decode-tp of them) with its "
        "own KV pool and batch, all on --decode-device",
    )
    decode_tp: int = flag(
        1,
        type=at_least(1),
        help="decode's --tp: tensor-parallel processes per data-parallel rank, each holding 1/T "
        "of the decoder and a KV pool of its KV heads (a --decode-device list names every "
        "process)",
    )
    decode_ep: int = flag(
        1,
        type=at_least(1),
        help="decode's --ep: 1, or --decode-tp to split an MoE model's experts over each rank "
        "(with --decode-dp-attention: 1, or --decode-dp)",
    )
    decode_dp_attention: bool = flag(
        False,
        help="decode's --dp-attention: the --decode-dp ranks (one process each) keep their own "
        "requests and attention, and split the MLP and MoE layers over all of them",
    )
    max_running_requests: int | None = flag(
        None,
        type=at_least(1),
        help="decode's largest batch per rank (default: every request the routers admit, "
        "over the decode ranks; at least 256)",
    )
    prefill_first_ms: float | None = flag(
        None,
        type=non_negative,
        help="when prefill and decode share one device: the longest a decode step waits for "
        "prefill's forwards, so prompts run on the GPU alone (default: on for a CUDA device, "
        "with decode's default; 0: off)",
    )
    router_workers: int = flag(
        1,
        type=at_least(1),
        help="router processes sharing the HTTP port (default: one per 8 CPUs, 1 to 4)",
    )
    page_size: int = flag(
        16, type=at_least(1), help="token slots per KV page, prefill's and decode's"
    )
    stall_timeout_s: float | None = flag(
        None, type=positive, help="the router's per-hop progress bound (default: the router's)"
    )
    max_concurrent_requests: int | None = flag(
        None, type=at_least(1), help="the router's admission slots (default: the router's)"
    )
    max_queued_requests: int | None = flag(
        None,
        type=at_least(0),
        help="requests waiting for a slot before 429 (default: the router's)",
    )
    queue_timeout_s: float | None = flag(
        None,
        type=non_negative,
        help="a request's wait limit in the admission queue before 429 (default: the router's)",
    )
    tool_call_parser: str | None = flag(
        None,
        choices=(AUTO_TOOL_CALL_PARSER, *ToolFormat),
        help="the router's --tool-call-parser: the model's tool-call format, hermes or "
        "qwen3_coder (default: the router's, auto: from the chat template)",
    )
    max_n: int | None = flag(
        None,
        type=at_least(1),
        help="the router's --max-n: most choices (n) a request may ask for, else 400 "
        "(default: the router's)",
    )
    drain_timeout_s: float | None = flag(
        None,
        type=non_negative,
        help="on Ctrl-C / SIGTERM: how long the routers' requests in flight get to finish before "
        "the services stop (default: the router's, its request deadline); decode and prefill "
        "then drain what they still hold within the same budget (default: their own)",
    )
    kv_quarantine_s: float | None = flag(
        None,
        type=non_negative,
        help="decode's rest for the pages of a failed reservation (default: decode's)",
    )
    embedding_quarantine_s: float | None = flag(
        None,
        type=non_negative,
        help="prefill's rest for the embedding rows of a timed-out Encode (default: prefill's)",
    )
    prefill_cp_block_tokens: int | None = flag(
        None, type=at_least(1), help="prefill's --cp-block-tokens (default: prefill's)"
    )
    prefill_cp_min_tokens: int | None = flag(
        None,
        type=at_least(0),
        help="prefill's --cp-min-tokens: smaller batches run on one rank (default: prefill's)",
    )
    prefill_step_timeout_s: float | None = flag(
        None, type=positive, help="prefill's --step-timeout-s (default: prefill's, 60)"
    )
    prefill_watchdog_s: float | None = flag(
        None, type=positive, help="prefill's --watchdog-s (default: prefill's, 30)"
    )
    decode_watchdog_s: float | None = flag(
        None, type=positive, help="decode's --watchdog-s (default: decode's, 30)"
    )
    prefill_num_pages: int | None = flag(
        None,
        type=at_least(1),
        help="prefill's --num-pages: its KV pool, where the prefix cache keeps recent prompts' "
        "pages (default: prefill's, 1024)",
    )
    disable_prefix_cache: bool = flag(
        False,
        help="prefill's --disable-prefix-cache: compute every prompt whole (the routers "
        "get it too: a request's n choices then start at once)",
    )
    host_cache_gb: float | None = flag(
        None,
        type=non_negative,
        help="prefill's --host-cache-gb: host memory (GB) per prefill rank for the prefix "
        "cache's second tier (default: prefill's, none)",
    )
    kv_store_gb: float = flag(
        0.0,
        type=non_negative,
        help="memory (GB) each prefill rank lends a Mooncake store, the prefix cache's third "
        "tier: up starts and supervises a mooncake_master on a free 127.0.0.1 port and gives "
        "prefill --kv-store-master and --kv-store-segment-gb (needs the cpu or gpu extra, and "
        "a non-loopback --host: the store's clients listen on every interface; default 0: no "
        "store)",
    )
    prefill_cp: int = flag(
        1,
        type=at_least(1),
        help="prefill's context-parallel ranks, each a group of --prefill-tp processes (on "
        "--prefill-device; cuda: one GPU per process, cuda:0 .. cuda:C*T-1)",
    )
    prefill_tp: int = flag(
        1,
        type=at_least(1),
        help="prefill's --tp: tensor-parallel ranks per CP rank, each holding 1/T of the decoder "
        "(needs the shm KV backend on CPU; decode stays one rank per model copy)",
    )
    prefill_ep: int = flag(
        1,
        type=at_least(1),
        help="prefill's --ep: 1, or --prefill-tp to split an MoE model's experts over each TP "
        "group, or (--prefill-tp 1) --prefill-cp to split them over the CP ranks",
    )
    ready_timeout_s: float = flag(
        300.0,
        type=positive,
        help="how long a service may take to print READY, at start and after a restart",
    )
    liveness: LivenessPolicy = nested(LivenessPolicy, prefix="liveness")
    log_dir: Path | None = flag(
        None,
        help="each service's log goes to <dir>/<service>.log (default: a new run directory "
        "under the temporary directory, printed at start)",
    )
    served_model_name: str | None = flag(
        None, help="model name in the API (default: the model dir's)"
    )
    max_model_len: int | None = flag(
        None,
        type=at_least(2),
        help="context limit, prompt + generated tokens, for the tokenizer, decode and the router "
        "(default: the model's max_position_embeddings)",
    )
    log_level: str | None = flag(
        None,
        type=str.upper,
        help="every service's log level: DEBUG, INFO, ... "
        "(default: STAGESERVE_LOG_LEVEL, else INFO)",
    )
    log_format: str = flag(
        "text",
        type=str.lower,
        choices=LOG_FORMATS,
        help="every service's log format; json: one object per line with request_id and "
        "trace_id (default: STAGESERVE_LOG_FORMAT, else text)",
    )
    metrics_port_base: int | None = flag(
        None,
        type=int,
        metavar="N",
        help="fixed /metrics ports N, N+1, ... for tokenizer, vision_encoder, prefill, "
        "decode, router (default: free ports, printed once ready)",
    )
    state_file: Path | None = flag(
        None,
        help="write pids and ports as JSON once ready, rewritten after a restart "
        "(default: none written)",
    )
    insecure_no_api_key: bool = flag(
        False,
        name=INSECURE_NO_API_KEY_FLAG.removeprefix("--").replace("-", "_"),
        help="serve the API without a key although --host is not a loopback address "
        "(anyone who reaches the port may call it)",
    )
    transfer_backend: str = "shm"  # the embedding rows: given.transfer_backend, or chosen
    kv_transfer_backend: str | None = None  # the KV handoff; None: transfer_backend
    attention_backend: str = "torch"
    decode_memory_fraction: float | None = None  # decode's --gpu-memory-utilization (None: its)
    gpu_share_file: Path | None = None  # prefill and decode on one device: prefill first
    stop_grace_s: float = 10.0
    restart: RestartPolicy = field(default_factory=RestartPolicy)

    @property
    def prefill_ranks(self) -> int:
        """Prefill's rank processes: its CP ranks times its TP ranks."""
        return self.prefill_cp * self.prefill_tp

    @property
    def prefill_ranks_flag(self) -> str:
        """The flags ``prefill_ranks`` comes from, for errors."""
        return "--prefill-cp" if self.prefill_tp == 1 else "--prefill-cp x --prefill-tp"

    def __post_init__(self) -> None:
        if self.encoder_ranks is not None and self.encoder_ranks < 1:
            raise ValueError(f"--encoder-ranks must be >= 1, got {self.encoder_ranks}")
        if self.grpc_port and self.grpc_port == self.http_port:
            raise ValueError(f"--grpc-port and --port are both {self.http_port}")
        base = self.metrics_port_base
        if base is None:
            return
        last = base + len(METRICS_PORT_ORDER) - 1
        if not 1 <= base <= last <= MAX_PORT:
            highest = MAX_PORT - len(METRICS_PORT_ORDER) + 1
            raise ValueError(f"--metrics-port-base must be in [1, {highest}], got {base}")
        for name, port in (("HTTP", self.http_port), ("gRPC", self.grpc_port)):
            if base <= port <= last:
                raise ValueError(
                    f"--metrics-port-base {base} gives the ports {base}-{last}, which include "
                    f"the {name} port {port}"
                )
