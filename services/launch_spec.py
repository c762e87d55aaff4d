"""What ``stageserve up`` starts: each child's flags and ports, from the launch config.

Every function here is pure: it turns a ``LaunchConfig`` (``services.launch_config``; and the
addresses of the services started before) into a ``ChildSpec``; ``services.launcher`` runs them.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from services.common.rank_devices import rank_devices
from services.common.service_main import COMMON_SETTINGS
from services.common.settings import config_to_argv
from services.decode.config import DecodeConfig
from services.launch_config import METRICS_PORT_ORDER, LaunchConfig
from services.prefill.config import PrefillConfig
from services.prefill.kv_store_master import MASTER_HOST
from services.prefill.kv_store_master import SERVICE as KV_STORE_SERVICE
from services.router.config import FlowConfig, LimitsConfig, RouterConfig, WorkerAddresses
from services.tokenizer.config import TokenizerConfig
from services.vision_encoder.config import VisionEncoderConfig


@dataclass(frozen=True)
class ChildSpec:
    """How to start one service: its own flags, and the ports it binds.

    ``ports`` maps a READY-line key to its first value (0: any free port); a restart
    binds the ports the first process reported, each as ``--<key with dashes>``.
    ``service``: the package it runs (default ``name``; the second router is
    ``router-2``, running ``services.router``).
    """

    name: str
    args: tuple[str, ...] = ()
    ports: Mapping[str, int] = field(default_factory=lambda: {"port": 0, "metrics_port": 0})
    service: str = ""

    @property
    def module(self) -> str:
        return f"services.{self.service or self.name}"


def device_of(cfg: LaunchConfig, name: str) -> str:
    """The device service ``name`` runs its model on (tokenizer and router run none)."""
    override = {
        "vision_encoder": cfg.encoder_device,
        "prefill": cfg.prefill_device,
        "decode": cfg.decode_device,
    }
    return override.get(name) or cfg.device


def decode_devices(cfg: LaunchConfig) -> tuple[str, ...]:
    """Decode's devices: a comma-separated --decode-device puts one rank process on each."""
    return tuple(device for device in device_of(cfg, "decode").split(",") if device)


def service_device(cfg: LaunchConfig, name: str) -> str:
    """Service ``name``'s ``--device``: decode's first device of a list."""
    return decode_devices(cfg)[0] if name == "decode" else device_of(cfg, name)


def common_args(cfg: LaunchConfig, name: str) -> list[str]:
    args = ["--model", str(cfg.model), "--host", cfg.host, "--device", service_device(cfg, name)]
    args += ["--log-format", cfg.log_format]
    return (
        args
        + (["--dtype", cfg.dtype] if cfg.dtype else [])
        + optional_arg("--log-level", cfg.log_level)
    )


def first_ports(cfg: LaunchConfig, name: str) -> dict[str, int]:
    """The ports service ``name`` starts on: any free gRPC port; its metrics port from
    ``metrics_port_base`` (0, any free one, without it)."""
    base = cfg.metrics_port_base
    metrics_port = 0 if base is None else base + METRICS_PORT_ORDER.index(name)
    return {"port": 0, "metrics_port": metrics_port}


def port_args(ports: Mapping[str, int]) -> list[str]:
    return [arg for key, port in ports.items() for arg in (f"--{key.replace('_', '-')}", str(port))]


def optional_arg(flag: str, value: float | str | None) -> list[str]:
    return [] if value is None else [flag, str(value)]


def tokenizer_spec(cfg: LaunchConfig) -> ChildSpec:
    """The tokenizer's own flags, from its config (``common_args`` give the shared ones)."""
    config = TokenizerConfig(
        max_model_len=cfg.max_model_len, worker_liveness_timeout_s=cfg.liveness.timeout_s
    )
    args = tuple(config_to_argv(config, skip=COMMON_SETTINGS))
    return ChildSpec("tokenizer", args, first_ports(cfg, "tokenizer"))


def _given(**values: object) -> dict[str, object]:
    """The settings up was given (None: the child keeps its own default)."""
    return {name: value for name, value in values.items() if value is not None}


def _service_settings(cfg: LaunchConfig, name: str) -> dict[str, object]:
    """The common settings ``common_args`` passes, for a config's own checks."""
    return {"model": cfg.model, "host": cfg.host, "device": service_device(cfg, name)}


def _ranks_arg(ranks: int | None) -> tuple[str, ...]:
    """``--ranks`` (not a config field: the child resolves it into its ``devices``)."""
    return () if ranks is None else ("--ranks", str(ranks))


def encoder_spec(cfg: LaunchConfig) -> ChildSpec:
    """The vision encoder's own flags, from its config (its ranks as ``--ranks``)."""
    settings = _service_settings(cfg, "vision_encoder")
    devices = rank_devices(
        (),
        cfg.encoder_ranks,
        service_device(cfg, "vision_encoder"),
        spread_cuda=False,
        service="vision_encoder",
    )
    config = VisionEncoderConfig(
        **settings, devices=devices, tp=cfg.encoder_tp, transfer_backend=cfg.transfer_backend
    )
    args = (
        *config_to_argv(config, skip=COMMON_SETTINGS | {"devices"}),
        *_ranks_arg(cfg.encoder_ranks),
    )
    return ChildSpec("vision_encoder", args, first_ports(cfg, "vision_encoder"))


def shared_device(cfg: LaunchConfig) -> str | None:
    """The device prefill and decode both run on, all their ranks on it; None otherwise."""
    devices = {
        "cuda:0" if d == "cuda" else d for d in (device_of(cfg, "prefill"), *decode_devices(cfg))
    }
    if cfg.prefill_ranks != 1 or len(devices) != 1:
        return None
    return devices.pop()


def with_gpu_share(cfg: LaunchConfig) -> LaunchConfig:
    """``cfg`` with its GPU share file (``services/common/gpu_share.py``) when prefill and
    decode share one device: by default for a CUDA device, and on any shared device when
    ``cfg.prefill_first_ms`` is given (0: none). ``ValueError`` for a ``prefill_first_ms``
    that nothing would use."""
    device = shared_device(cfg)
    prefill_first_ms = cfg.prefill_first_ms
    if device is None:
        if prefill_first_ms is not None:
            raise ValueError(
                "--prefill-first-ms needs prefill and decode on one device (and one prefill rank)"
            )
        return cfg
    if prefill_first_ms == 0 or (prefill_first_ms is None and not device.startswith("cuda")):
        return cfg
    run_dir = cfg.log_dir or Path(tempfile.gettempdir())
    return replace(cfg, gpu_share_file=run_dir / f"gpu-share-{os.getpid()}")


def _gpu_share_file(cfg: LaunchConfig) -> str:
    return "" if cfg.gpu_share_file is None else str(cfg.gpu_share_file)


def decode_config(cfg: LaunchConfig) -> DecodeConfig:
    """Decode's config as ``up`` starts it: one rank per device of a device list, else
    ``decode_dp`` ranks on its device (``--ranks``, resolved by decode)."""
    devices = decode_devices(cfg)
    return DecodeConfig(
        **_service_settings(cfg, "decode"),
        **_given(devices=devices if len(devices) > 1 else None),
        transfer_backend=cfg.transfer_backend,
        kv_transfer_backend=cfg.kv_transfer_backend,
        num_pages=cfg.given.num_pages,
        **_given(gpu_memory_utilization=cfg.decode_memory_fraction),
        page_size=cfg.page_size,
        attention_backend=cfg.attention_backend,
        quantization=cfg.quantization,
        kv_cache_dtype=cfg.kv_cache_dtype,
        max_model_len=cfg.max_model_len,
        max_running_requests=decode_batch_size(cfg),
        **_given(
            kv_quarantine_s=cfg.kv_quarantine_s,
            drain_timeout_s=cfg.drain_timeout_s,
            watchdog_s=cfg.decode_watchdog_s,
        ),
        gpu_share_file=_gpu_share_file(cfg),
        prefill_first_ms=cfg.prefill_first_ms if cfg.gpu_share_file else None,
        tp=cfg.decode_tp,
        ep=cfg.decode_ep,
        dp_attention=cfg.decode_dp_attention,
    )


def decode_processes(cfg: LaunchConfig) -> int | None:
    """Decode's ``--ranks``: its DP ranks times its TP processes; None with a device list
    (one process on each)."""
    return None if len(decode_devices(cfg)) > 1 else cfg.decode_dp * cfg.decode_tp


def decode_spec(cfg: LaunchConfig) -> ChildSpec:
    """Decode's own flags, from its config."""
    ranks = decode_processes(cfg)
    args = (*config_to_argv(decode_config(cfg), skip=COMMON_SETTINGS), *_ranks_arg(ranks))
    return ChildSpec("decode", args, first_ports(cfg, "decode"))


def kv_store_spec(cfg: LaunchConfig) -> ChildSpec | None:
    """The Mooncake store's master (``services.prefill.kv_store_master``) when
    ``cfg.kv_store_gb`` asks for a store: any free gRPC (health), metrics and master port."""
    if not cfg.kv_store_gb:
        return None
    ports = {"port": 0, "metrics_port": 0, "master_port": 0}
    return ChildSpec("kv_store_master", (), ports, KV_STORE_SERVICE)


def kv_store_address(master_port: int | str) -> str:
    """Prefill's ``--kv-store-master`` for the master ``up`` started on ``master_port``."""
    return f"{MASTER_HOST}:{master_port}"


def prefill_config(
    cfg: LaunchConfig, encoder_address: str = "", kv_store_master: str = ""
) -> PrefillConfig:
    """Prefill's config as ``up`` starts it, its vision encoder at ``encoder_address``, the
    master of its KV store (with ``cfg.kv_store_gb``) at ``kv_store_master``."""
    store = (
        {"kv_store_master": kv_store_master, "kv_store_segment_gb": cfg.kv_store_gb}
        if kv_store_master
        else {}
    )
    return PrefillConfig(
        **_service_settings(cfg, "prefill"),
        encoder_address=encoder_address,
        transfer_backend=cfg.transfer_backend,
        kv_transfer_backend=cfg.kv_transfer_backend,
        page_size=cfg.page_size,
        attention_backend=cfg.attention_backend,
        quantization=cfg.quantization,
        kv_cache_dtype=cfg.kv_cache_dtype,
        max_queued_requests=prefill_queue_size(cfg),
        disable_prefix_cache=cfg.disable_prefix_cache,
        tp=cfg.prefill_tp,
        ep=cfg.prefill_ep,
        # prefill starts while the encoder loads: it waits for it as long as up waits for both
        peer_ready_timeout_s=cfg.ready_timeout_s,
        **_given(
            num_pages=cfg.prefill_num_pages,
            host_cache_gb=cfg.host_cache_gb,
            embedding_quarantine_s=cfg.embedding_quarantine_s,
            cp_block_tokens=cfg.prefill_cp_block_tokens,
            cp_min_tokens=cfg.prefill_cp_min_tokens,
            step_timeout_s=cfg.prefill_step_timeout_s,
            watchdog_s=cfg.prefill_watchdog_s,
            drain_timeout_s=cfg.drain_timeout_s,
        ),
        **store,
        gpu_share_file=_gpu_share_file(cfg),
    )


def prefill_spec(cfg: LaunchConfig, encoder_address: str, kv_store_master: str = "") -> ChildSpec:
    """Prefill's own flags, from its config (its rank processes, CP x TP, as ``--ranks``)."""
    config = prefill_config(cfg, encoder_address, kv_store_master)
    args = (*config_to_argv(config, skip=COMMON_SETTINGS), *_ranks_arg(cfg.prefill_ranks))
    return ChildSpec("prefill", args, first_ports(cfg, "prefill"))


def prefill_queue_size(cfg: LaunchConfig) -> int:
    """Requests the one prefill worker must hold: every request each router process admits
    can be at prefill at once (with prefill's own default, a burst through two routers had
    requests refused: ``docs/benchmarks.md``, "Measurements cited by the code")."""
    slots = cfg.max_concurrent_requests or FlowConfig.max_concurrent_requests
    return cfg.router_workers * slots


def decode_batch_size(cfg: LaunchConfig) -> int:
    """Decode's largest batch per rank: ``max_running_requests``, or room for every request
    the router processes admit, over the decode ranks (at least decode's own 256). A request
    past it waits on decode for a place (its stream says so), behind whole generations of
    the requests before it (``docs/benchmarks.md``, "Measurements cited by the code")."""
    if cfg.max_running_requests is not None:
        return cfg.max_running_requests
    num_ranks = max(len(decode_devices(cfg)) // cfg.decode_tp, cfg.decode_dp)
    admitted = cfg.router_workers * (
        cfg.max_concurrent_requests or FlowConfig.max_concurrent_requests
    )
    return max(DecodeConfig.max_running_requests, -(-admitted // num_ranks))


# given as a port (``http_port``); derived by the router from --max-image-bytes, which up
# leaves to it (``max_request_bytes``)
ROUTER_UNSET = frozenset({"http_port", "max_request_bytes"})
# the common settings up gives the routers alone, through their config
ROUTER_COMMON = frozenset({"enable_reflection"})


def router_config(
    cfg: LaunchConfig, *, tokenizer: str, prefill: str, decode: str, encoder: str
) -> RouterConfig:
    """Every router process's config (the first and the workers alike); the others are given
    by their gRPC addresses ("host:port")."""
    flow = FlowConfig(
        **_given(
            stall_timeout_s=cfg.stall_timeout_s,
            max_concurrent_requests=cfg.max_concurrent_requests,
            max_queued_requests=cfg.max_queued_requests,
            queue_timeout_s=cfg.queue_timeout_s,
        )
    )
    return RouterConfig(
        model=cfg.model,
        host=cfg.host,
        http_host=cfg.host,
        served_model_name=cfg.served_model_name,
        max_context_len=cfg.max_model_len or RouterConfig.max_context_len,
        http_reuse_port=cfg.router_workers > 1,
        workers=WorkerAddresses((tokenizer,), (prefill,), (decode,), (encoder,)),
        flow=flow,
        limits=LimitsConfig(**_given(max_n=cfg.max_n)),
        disable_prefix_cache=cfg.disable_prefix_cache,
        drain_timeout_s=cfg.drain_timeout_s,
        insecure_no_api_key=cfg.insecure_no_api_key,
        enable_reflection=cfg.enable_reflection,
        **_given(tool_call_parser=cfg.tool_call_parser),
    )


def router_stop_s(cfg: LaunchConfig) -> float:
    """How long a router may take to exit after SIGTERM (``RouterConfig.stop_s``: its drain
    budget, then the rest of its shutdown)."""
    return RouterConfig(model=cfg.model, drain_timeout_s=cfg.drain_timeout_s).stop_s


def worker_stop_s(cfg: LaunchConfig, service: str) -> float:
    """How long worker ``service`` may take to exit after SIGTERM: decode's and prefill's
    ``stop_s`` (their drain budget, then the rest of their shutdown), at least
    ``cfg.stop_grace_s``; the others' ``cfg.stop_grace_s``."""
    if service == "decode":
        return max(cfg.stop_grace_s, decode_config(cfg).stop_s)
    if service == "prefill":
        return max(cfg.stop_grace_s, prefill_config(cfg).stop_s)
    return cfg.stop_grace_s


def router_args(
    cfg: LaunchConfig, *, tokenizer: str, prefill: str, decode: str, encoder: str
) -> tuple[str, ...]:
    """Every router process's own flags, from ``router_config`` (the HTTP port is a port)."""
    config = router_config(
        cfg, tokenizer=tokenizer, prefill=prefill, decode=decode, encoder=encoder
    )
    skip = (COMMON_SETTINGS - ROUTER_COMMON) | ROUTER_UNSET
    return tuple(config_to_argv(config, skip=skip))


def router_spec(cfg: LaunchConfig, args: tuple[str, ...]) -> ChildSpec:
    """The first router: on ``cfg.grpc_port`` (0: a free one) and ``cfg.http_port``."""
    ports = {**first_ports(cfg, "router"), "port": cfg.grpc_port, "http_port": cfg.http_port}
    return ChildSpec("router", args, ports)


def router_worker_specs(
    cfg: LaunchConfig, args: tuple[str, ...], http_port: int
) -> list[ChildSpec]:
    """The routers after the first: ``router-2`` ... on the first one's HTTP port
    (SO_REUSEPORT), each on any free gRPC and metrics port."""
    return [
        ChildSpec(
            f"router-{i + 1}",
            args,
            {"port": 0, "metrics_port": 0, "http_port": http_port},
            "router",
        )
        for i in range(1, cfg.router_workers)
    ]
